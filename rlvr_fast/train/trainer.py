"""GRPO for reinforcement learning with verifiable rewards (the study's §1), one loop that reads
top-down.

Per step, for the next ``questions_per_step`` training questions (one by default):
  1. rollouts: the run's step kind (``rlvr_fast.train.kinds``: flat groups, two-stage trees or
     parallel paths, ``config.sampler``) samples them on the run's one rollout engine, all
     questions in one batch;
  2. rewards and credit: the task grades them (``MathTask``: the last boxed answer, with the
     arm's derivation gate; ``rlvr_fast.trl_compat`` gives TRL's reward functions instead) and
     the kind turns rewards into per-token weights;
  3. the stepping rule (``rlvr_fast.train.decision``, which ``verify`` shares): a backward pass
     when a question's rewards vary, or always on arms that do not skip homogeneous groups;
     else a zero-gradient AdamW step or none;
  4. the update (``rlvr_fast.train.stepping``): each question's loss (the kind's: the study's
     -(1/G) sum_i sum_t w_it log pi(y_t), eager sum-then-scale on arm 1, else the fused
     ``weighted_token_nll``; TRL's loss types through ``fused_policy_loss``, with the KL to a
     reference model and the entropy, ``rlvr_fast.train.policy``), backward, clipping, AdamW;
     several questions average their unit
     gradients (the accum4 ablation) or pool their losses over the step (TRL's several prompts
     per step), as ``combine_questions`` says (``rlvr_fast.train.steps``); a generation serves
     num_iterations x generation_steps steps, each of generation_steps on its share of the
     generation's shuffled completions (``rlvr_fast.train.steps.generation_shares``);
  5. one checked ledger line and one rollouts line (``rlvr_fast.train.steps``,
     ``rlvr_fast.run.recorder``), and the step's figures to the monitor
     (``rlvr_fast.train.monitor``: the progress bar, --log-every lines, the --report-to
     loggers, --eval-every evaluations and --save-every Hugging Face checkpoints).
Every ``checkpoint_every`` steps the components (weights, optimizer, RNG states, Polyak sums,
the evaluation before training) are checkpointed (``rlvr_fast.run.checkpoint``); a killed run
resumes from there to the same bytes. The study's ablations are settings of this loop: the
Polyak tail (``polyak_start``, ``rlvr_fast.train.polyak``), ``active_steps`` budgets, zero
continuation mass (tree kind), multi-question steps. Data parallel
(``rlvr_fast.train.distributed``, torchrun or ``rlvr-fast train --nproc N``): each rank takes
its contiguous share of a step's questions with the sampling seeds one process would give them;
the contributing questions are counted over all ranks and the gradients all-reduced, so the run
is the one-process run up to fp32 rounding; rank 0 writes the run directory.

    trainer = RLVRTrainer(load_policy("tiny"), TrainConfig.from_arm("ra_flat"), problems)
    summary = trainer.train()
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from rlvr_fast.data.problems import Problem
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.engine.engine import check_room
from rlvr_fast.engine.counters import SUMMED_COUNTERS
from rlvr_fast.ledger.records import FLOP_FIELDS, TOTALLED_FIELDS
from rlvr_fast.models.lora import apply_lora
from rlvr_fast.rollouts.evaluation import check_prompt_lengths, encode_prompts
from rlvr_fast.rollouts.generation import base_seed
from rlvr_fast.run.checkpoint import (
    Checkpointer,
    GeneratorState,
    GlobalRNGState,
    checkpoint_identity,
)
from rlvr_fast.run.directory import (
    check_eval_name,
    run_signature,
    settings_sha256,
    starts_with_problems,
)
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.run.provenance import run_meta
from rlvr_fast.run.recorder import RunRecorder, count_active_steps, finished_summary
from rlvr_fast.train import distributed
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.decision import decide_step
from rlvr_fast.train.evaluator import Evaluator
from rlvr_fast.train.kinds import Question, step_kind
from rlvr_fast.train.checkpointing import host_memory
from rlvr_fast.train.memory_plan import MemoryPlan, plan_for_training
from rlvr_fast.train.monitor import Monitoring, TrainingMonitor
from rlvr_fast.train.nonfinite import check_finite
from rlvr_fast.train.polyak import PolyakAverage, averaged_weights
from rlvr_fast.train.precision import MIXED, resolve_precision
from rlvr_fast.train.sharded_checkpoint import ShardedCheckpoint
from rlvr_fast.train.sharding import check_sharding, shard_policy, world_size_check
from rlvr_fast.train.steps import (
    StepResult,
    multi_question_step,
    pooled_weights,
    share_of_step,
    single_question_step,
)
from rlvr_fast.train.stepping import OptimizerStepping
from rlvr_fast.train.task import MathTask
from rlvr_fast.utils.phases import Phases, StepProfiler


class RLVRTrainer:
    def __init__(
        self,
        policy,
        config: TrainConfig,
        train_data: Sequence[Problem],
        eval_data: dict[str, Sequence[Problem]] | None = None,
        *,
        out_dir: str | os.PathLike | None = None,
        resume: bool = False,
        progress: bool = True,
        profile_steps: int = 0,
        task=None,
        adapter_weights: dict | None = None,
        monitoring: Monitoring | None = None,
    ) -> None:
        """``adapter_weights``: the LoRA adapters' starting tensors by peft's saved names (a
        ``peft.PeftModel``'s), in place of peft's initialisation."""
        if not train_data:
            raise ValueError("train_data is empty")
        kind = step_kind(config.sampler)
        kind.check_task(task)
        self.policy, self.config = policy, config
        add_adapters(policy, config, adapter_weights)
        self.task = task or MathTask(policy.tokenizer, config.gate_min_chars)
        distributed.check_step_split(config.questions_per_step, config.generation_steps)
        self.train_data = list(train_data)
        self.eval_data = {
            check_eval_name(name): problems for name, problems in (eval_data or {}).items()
        }
        # Every prompt fits the model beside its completion, checked before anything is written.
        check_prompt_lengths(
            policy,
            self.train_data,
            [self.task.prompt_ids(p) for p in self.train_data],
            config.max_new_tokens,
        )
        for problems in self.eval_data.values():
            encode_prompts(policy, problems, config.eval_max_new_tokens)
        # Every rank reads the run directory (to resume); rank 0 alone writes it and prints.
        writes = out_dir is not None and distributed.is_main()
        self.layout = RunLayout(Path(out_dir)) if out_dir is not None else None
        self.recorder = RunRecorder(Path(out_dir)) if writes else None
        self.progress = progress and distributed.is_main()
        self.profile_steps = profile_steps
        # Before the engine: the stepping casts the model to the precision's compute dtype.
        self.precision = resolve_precision(config.precision, policy.device)
        check_sharding(config)
        plan = None
        if policy.device.type == "cuda":
            plan = check_memory(
                policy, config, self.precision, self.longest_prompt(), self.progress
            )
        self.sharded = shard_policy(policy, self.precision) if config.shard else None
        # Sharded: the engine's copy gathered from the shards after a step (then, with LoRA,
        # its merged weights recomputed, as unsharded).
        publish = self.sharded.refresh if self.sharded else policy.refresh_decoder
        self.stepping = OptimizerStepping(
            policy.model, config, self.precision, after_publish=publish, sharded=self.sharded
        )
        self.num_params = self.stepping.num_params
        self.generator = torch.Generator(device=policy.device).manual_seed(config.seed)
        # One engine, one KV cache, for every rollout and evaluation of the run.
        self.engine = RolloutEngine.for_policy(policy, **engine_settings(config, plan))
        # Before the run directory is touched: a cache that cannot hold one sequence.
        check_room(self.engine, self.longest_prompt() + config.max_new_tokens)
        policy.trained_model.model.checkpointed_layers = checkpointed_layers(
            policy.config, config, self.precision, plan, self.longest_prompt, self.progress
        )
        self.kind = kind(config, policy, self.engine, self.task, self.generator, self.num_params)
        self.evaluator = Evaluator(
            policy,
            self.eval_data,
            self.engine,
            max_new_tokens=config.eval_max_new_tokens,
            progress=self.progress,
            layout=self.recorder.layout if self.recorder is not None else None,
        )
        self.monitor = TrainingMonitor(monitoring or Monitoring(), self)
        # Allocated after the engine, so that a device short of memory keeps the KV cache.
        self.polyak = PolyakAverage(self.trained_weights) if config.polyak_start else None
        # As config.json holds it: what the resume signature and the checkpoint identity hash.
        self.config_json = json.loads(json.dumps(config.to_json()))
        identity = checkpoint_identity(
            settings_sha256(self.config_json), config.seed, self.precision
        )
        components = checkpointed_components(self)
        self.checkpointer = Checkpointer(
            components,
            steps=config.steps,
            identity=identity,
            shards=ShardedCheckpoint(self.stepping, components),
        )
        self.start_step = 0
        # The questions num_iterations and generation_steps reuse.
        self.generation: list[Question] | None = None
        self.active_steps = 0
        self.finished_summary = None
        if self.layout is not None:
            self._open_run_dir(resume)
        if self.sharded is None:  # (sharded: shard_policy broadcast the weights)
            distributed.broadcast_parameters(policy.model, self.stepping.masters)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.stepping.optimizer

    def longest_prompt(self) -> int:
        return max(len(self.task.prompt_ids(p)) for p in self.train_data)

    @property
    def trained_weights(self):
        """What the optimizer steps, by name: the model, its fp32 masters, or the shards."""
        masters = self.stepping.masters
        return masters if masters is not None else self.stepping.model

    def saved_weights(self) -> dict | None:
        """What model/ holds in place of the model's weights: under bf16-mixed the fp32 masters
        the optimizer steps (the checkpoint's precision), not their bf16 rounding (sharded:
        gathered whole, one tensor at a time; every rank calls this)."""
        if self.sharded is not None:
            return self.sharded.saved_weights(self.precision)
        masters = self.stepping.masters
        return masters.state_dict() if masters is not None else None

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        if self.finished_summary is not None:
            return self.finished_summary
        config = self.config
        summary: dict = {"arm": config.arm}
        if config.eval_before and self.start_step == 0 and self.eval_data:
            self.monitor.evaluated(0, self.evaluator.run("before"))
        if self.evaluator.before is not None:
            summary["eval_before"] = self.evaluator.before
        totals: dict[str, float] = {}
        step = self.start_step
        profiler = StepProfiler(
            self.profile_steps, self.recorder.layout.trace if self.recorder else None
        )
        with tqdm(
            desc=f"train {config.arm}",
            unit="step",
            disable=not self.progress,
            initial=step,
            total=config.steps,
        ) as bar:
            while step < config.steps and not self.reached_active_steps():
                result = self.run_step(step)
                if not config.allow_nonfinite:
                    checkpoint = self.layout.checkpoint if self.recorder is not None else None
                    check_finite(step, result.record, self.policy.model, config.lr, checkpoint)
                profiler.step_done(step + 1 - self.start_step)
                add_to_totals(totals, result.record)
                step += 1
                self.monitor.step_done(step, result.record, bar)
                bar.update()
                if self.polyak is not None and step >= config.polyak_start:
                    self.polyak.add(self.trained_weights)
                # (sharded, every rank gathers the checkpoint's tensors; rank 0 writes it)
                if (self.recorder or (self.sharded and self.layout)) and (
                    step % config.checkpoint_every == 0
                    or step == config.steps
                    or self.reached_active_steps()
                ):
                    self.save_checkpoint(step)
                self.monitor.during_training(step)
        profiler.stop()
        summary["steps"] = step
        summary["totals_this_run"] = totals
        if self.eval_data:
            summary["eval_after"] = self.evaluator.run("after")
            self.monitor.evaluated(step, summary["eval_after"])
        self.monitor.close()
        weights = self.saved_weights() if self.layout is not None else None
        if self.recorder is not None:
            self.recorder.save_model(self.policy, weights=weights)
        if self.polyak is not None:
            summary.update(self.finish_polyak())
        if self.recorder is not None:
            self.recorder.finish(summary)
        return summary

    def reached_active_steps(self) -> bool:
        return (
            self.config.active_steps is not None and self.active_steps >= self.config.active_steps
        )

    def run_step(self, step: int) -> StepResult:
        """Step ``step`` on its questions: the next ``questions_per_step`` of the training data,
        which the run cycles through (one generation's for num_iterations x generation_steps
        steps)."""
        count = self.config.questions_per_step
        data, generation = self.train_data, step // self.config.updates_per_generation
        return self.step_on(
            step, [data[(generation * count + i) % len(data)] for i in range(count)]
        )

    def step_on(self, step: int, problems: list[Problem]) -> StepResult:
        """One optimizer step on ``problems``. On several ranks (a multi-question step) each
        takes its share, with the sampling seeds one process would give it; whether the step
        is active, and the unit gradients' divisor, are counted over the ranks."""
        config, kind = self.config, self.kind
        phase = Phases(self.policy.device)
        multi = config.questions_per_step > 1
        # Update ``iteration`` of the generation (0: it is sampled now); a run resumed inside a
        # generation samples a new one, as TRL does.
        iteration = step % config.updates_per_generation if self.generation is not None else 0
        if iteration == 0:
            self.generation = self.generate(problems, phase)
        questions = self.generation
        shares = share_of_step(config, step, [len(kind.rewards(q)) for q in questions])
        for question, share in zip(questions, shares or [None] * len(questions)):
            question.share = share
        contributing = [q for q in questions if kind.contributes(q)]
        decision = decide_step(
            distributed.sum_over_ranks(len(contributing)),
            skip_zero_var=config.skip_zero_var,
            zero_var_step=config.zero_var_step,
        )
        running = {id(q) for q in (contributing if multi else questions if decision.active else [])}
        kind.measure([q for q in questions if id(q) not in running], phase)
        losses = [functools.partial(kind.loss, q) for q in (contributing if multi else questions)]
        # A share of a generation is pooled as TRL normalises it (rlvr_fast.train.steps).
        combination = config.combine_questions if multi else None
        if shares is not None and not multi:
            combination = "pooled"
        weights = None
        if combination == "pooled":
            weights = pooled_weights(kind, questions, contributing if multi else questions)
        update = self.stepping.update(
            phase, decision, losses, combination=combination, weights=weights
        )
        self.active_steps += decision.active
        if kind.reference is not None:
            kind.reference.after_step(step + 1, self.policy.model)
        if multi:
            result = multi_question_step(
                kind, questions, step, decision, update, phase.seconds, iteration
            )
        else:
            result = single_question_step(
                kind, questions[0], step, decision, update, phase.seconds, iteration
            )
        # Of every rank's questions, as one process taking them all has them.
        result.ledger_record.policy = kind.figures(questions, over_ranks=True) or None
        result.ledger_record.loss_scale = update.loss_scale
        if self.recorder is not None:
            self.recorder.write_step(result.ledger_record, result.line)
        return result

    def generate(self, problems: list[Problem], phase: Phases) -> list[Question]:
        """A generation: ``problems``' rollouts (on several ranks this rank's share, with the
        sampling seeds one process would give it) and their credit."""
        bases = None
        if self.config.questions_per_step > 1:
            bases = [base_seed(self.generator) for _ in problems]
            mine = distributed.shard(len(problems))
            problems, bases = problems[mine], bases[mine]
        questions = [Question(p, self.task.prompt_ids(p)) for p in problems]
        with phase("rollout"):
            self.policy.model.eval()
            self.kind.sample(questions, bases, active_steps=self.active_steps)
        self.kind.credit(questions, phase)
        return questions

    def finish_polyak(self) -> dict:
        """The Polyak average's summary entries: the steps it spans and, when it holds any (an
        ``active_steps`` run can end first), its evaluation (evals/polyak/) and final_polyak/."""
        info = {
            "polyak": {"first_step": self.config.polyak_start, "steps_averaged": self.polyak.count}
        }
        if self.polyak.count == 0:
            return info
        with averaged_weights(self.polyak, self.policy.model):
            if self.eval_data:
                info["eval_polyak"] = self.evaluator.run("polyak")
            average = self.polyak.average() if self.precision in MIXED and self.layout else None
            if self.recorder is not None:
                self.recorder.save_model(self.policy, polyak=True, weights=average)
        return info

    def close(self, summary: dict | None = None) -> None:
        """Close the ledger of a run stepped from outside ``train`` (``step_on``); with its
        ``summary`` (arm, steps, totals_this_run) the run is finished, summary.json written."""
        if self.recorder is not None and summary is not None:
            self.recorder.finish(summary)
        elif self.recorder is not None:
            self.recorder.close()

    # ------------------------------------------------------------------ run directory
    def _open_run_dir(self, resume: bool) -> None:
        """Start the run in its directory, or resume it there (``rlvr_fast.run.directory``):
        from its checkpoint, or from step 0 when it was killed before the first one. On several
        ranks rank 0 (which holds the recorder) alone checks, cleans and writes the directory;
        every rank reads the checkpoint and the ledger's active steps."""
        config = self.config_json
        signature = run_signature(config, self.policy, self.train_data, self.eval_data)
        identify_run_directory(self.checkpointer, signature, self.train_data)
        recorded = None
        if self.recorder is not None:
            recorded = self.recorder.open(signature, config, self.train_data, resume)
        recorded = distributed.all_gather(recorded)[0]
        if recorded is not None and self.layout.checkpoint.exists():
            self.start_step = self.load_checkpoint(self.layout.checkpoint)
        if recorded is not None and recorded["config"]["steps"] == config["steps"]:
            self.finished_summary = finished_summary(self.layout)
            if self.finished_summary is not None:
                return
        if self.recorder is not None:
            self.recorder.keep_steps(self.start_step)
            self.recorder.keep_eval_steps(self.start_step)
            self.monitor.open_loggers(self.layout.root, self.config_json, self.start_step)
        self.active_steps = count_active_steps(self.layout, self.start_step)
        distributed.agree((self.start_step, self.active_steps), "the step to resume from")
        if self.recorder is None:
            return
        if recorded is None or recorded["config"] != config:
            meta = run_meta(
                signature,
                config,
                recorded,
                model=str(self.policy.path),
                trainable_parameters=self.num_params,
                precision=self.precision,
                world_size=distributed.world_size(),
                at_step=self.start_step,
                rewards_recorded=not isinstance(self.task, MathTask),
            )
            self.recorder.write_config(meta)
        self.recorder.start_ledger()

    def save_checkpoint(self, next_step: int) -> None:
        """Every component's state after ``next_step`` steps, in one safetensors file written
        atomically (no pickle) by rank 0, with the world size (sharded: the weights and moments
        written by every rank as its shards, in DCP, which the file names)."""
        world_size = distributed.world_size()
        state = self.sharded and self.checkpointer.state(
            next_step, world_size, sharded=True, shards_at=self.layout.checkpoint
        )
        if self.recorder is not None:
            self.recorder.save_checkpoint(self.checkpointer, next_step, world_size, state)

    def load_checkpoint(self, path: Path) -> int:
        """Restore a checkpoint of this run; returns the step to continue from."""
        step = self.checkpointer.load(path, world_size_check(self.sharded is not None))
        if self.sharded is not None and not self.checkpointer.restored_shards:
            self.sharded.after_load(self.precision)
        self.policy.refresh_decoder()
        return step


def checkpointed_components(trainer: RLVRTrainer) -> dict:
    """What a checkpoint of ``trainer`` holds, by name: every component with a state_dict."""
    stepping, kind = trainer.stepping, trainer.kind
    components = {
        "model": trainer.policy.model,
        "optimizer": stepping,
        "generator": GeneratorState(trainer.generator),
        "torch_rng": GlobalRNGState(),
        "polyak": trainer.polyak,
        "eval_before": trainer.evaluator,
        **(trainer.sharded.components(trainer.precision) if trainer.sharded else {}),
    }
    if stepping.masters is not None:
        components["masters"] = stepping.masters
    if stepping.scaler is not None:
        components["loss_scale"] = stepping.scaler
    if kind.reference is not None and kind.reference.owns_weights:
        components["reference"] = kind.reference
    if kind.entropy_control is not None:
        components["entropy_control"] = kind.entropy_control
    return components


def check_memory(
    policy, config: TrainConfig, precision: str, prompt_tokens: int, progress: bool
) -> MemoryPlan:
    """The memory plan of a run on the policy's GPU (``rlvr_fast.train.memory_plan``), printed
    when ``progress``; PlanError, naming the largest term, when the run cannot fit."""
    device = policy.device
    free, _ = torch.cuda.mem_get_info(device)
    usable = free + torch.cuda.memory_allocated(device)  # the weights already loaded count
    plan = plan_for_training(policy.config, config, precision, prompt_tokens, usable)
    if progress:
        print(plan.render())
    return plan.check()


def identify_run_directory(checkpointer: Checkpointer, signature: dict, train_data) -> None:
    """A run directory's checkpoints also name the model, dtype, device and eval sets, and the
    training problems, which a resume accepts when its own begin with them (an extended run)."""
    for key in ("model_sha256", "dtype", "device", "eval_data", "train_data"):
        checkpointer.identity[key] = signature[key]
    checkpointer.accepts["train_data"] = functools.partial(starts_with_problems, train_data)


def add_adapters(policy, config: TrainConfig, adapter_weights=None) -> None:
    """With ``lora_r`` set, LoRA adapters on the policy (``rlvr_fast.models.lora``), their A
    drawn from the run's seed (the starting weights, which the resume signature hashes, are the
    same in every start), or starting from ``adapter_weights`` (peft's saved names), before
    anything reads which parameters train."""
    settings = config.lora_settings
    if settings is None:
        if adapter_weights is not None:
            raise ValueError("adapter_weights without lora_r: set the adapters' settings")
        return
    if policy.adapters is not None:
        raise ValueError("the policy has LoRA adapters already: set lora_r on a base policy")
    generator = torch.Generator().manual_seed(config.seed)
    policy.adapters = apply_lora(policy.model, settings, generator)
    if adapter_weights is not None:
        policy.adapters.load_peft_state(adapter_weights)


def engine_settings(config: TrainConfig, plan: MemoryPlan | None) -> dict:
    """The rollout engine's settings from ``config``; when the memory plan ran (on CUDA) the KV
    cache is the plan's blocks, so that the engine takes what the plan left it rather than a
    fraction of whatever is free when it starts."""
    return dict(
        max_batch=config.max_batch,
        cuda_graphs=config.cuda_graphs,
        kv_memory_fraction=config.kv_memory_fraction,
        kv_blocks=plan.kv_blocks if plan is not None else config.kv_blocks,
        max_model_len=config.max_model_len,
    )


def add_to_totals(totals: dict[str, float], record: dict) -> None:
    """The run's totals of the ledger's token counts, the engine's counters, the FLOPs and the
    seconds per phase, plus one step's ``record``."""
    for key in (*TOTALLED_FIELDS, *SUMMED_COUNTERS, *FLOP_FIELDS):
        totals[key] = totals.get(key, 0) + record[key]
    for phase, seconds in record["seconds"].items():
        totals[f"seconds_{phase}"] = totals.get(f"seconds_{phase}", 0.0) + seconds


def checkpointed_layers(
    model_config, config: TrainConfig, precision: str, plan, longest_prompt, progress: bool
) -> int:
    """The decoder layers that recompute in backward: all or none as activation_checkpointing
    says; under "auto" as many as the memory plan picks, on the GPU's memory (``plan``) or,
    without a device plan, on the host's available memory and what this process holds."""
    setting, layers = config.activation_checkpointing, model_config.num_hidden_layers
    if setting != "auto":
        return layers if setting else 0
    if plan is None:
        plan = plan_for_training(model_config, config, precision, longest_prompt(), host_memory())
        if progress:
            print(plan.notes[-1])
    return plan.checkpointed_layers
