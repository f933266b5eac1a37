"""``GRPOTrainer``: TRL's constructor and the ``Trainer`` surface scripts use, on rlvr_fast's
engine and trainer (``rlvr_fast.train.trainer.RLVRTrainer``, driven a step at a time through
``step_on``).

Each generation batch takes the next ``args.prompts_per_step`` prompts (TRL's order: a
``torch.randperm`` per epoch from a generator seeded with ``seed``, cut into batches, an
incomplete last step dropped), samples ``num_generations`` completions of each on the rollout
engine in one batch (each prompt prefilled once and forked), scores them with the reward
functions in one call, and steps ``num_iterations`` times on them (times
``steps_per_generation / gradient_accumulation_steps``, each step on its share of the shuffled
generation batch: ``rlvr_fast.train.steps.generation_shares``) with TRL's loss of
``loss_type`` (``rlvr_fast.train.policy``: the fused policy loss, its clipping against the
generation's old log-probabilities, the KL of ``beta`` to a frozen reference, the entropy),
each question's loss pooled over the step (``rlvr_fast.train.steps.pooled_weights``): dapo and
cispo divide by all the step's tokens, the others average over all its completions, as TRL
over a generation batch. A_i are TRL's advantages (``scale_rewards`` group, batch or none).
``loss_type="sum"`` is the study's loss instead: -(1/G) sum_i A_i sum_t log pi(y_it) on
untempered log-probabilities. Zero-variance groups (every A_i = 0, so with beta = 0 TRL's
gradient from them is exactly zero) run no forward or backward; a step whose groups all agree
takes the zero-gradient AdamW step, the same update bit for bit. ``arm=`` applies a study arm's preset (its gate, stepping rule and sampler).

The loop is transformers' (``TrainerState``, ``TrainerControl``, ``DefaultFlowCallback`` deciding
when to log, evaluate and save, ``ProgressCallback`` / ``PrinterCallback`` printing the logs,
the ``report_to`` integrations, the caller's callbacks); metrics are TRL's
(``rlvr_fast.trl_compat.reporting``), evaluations TRL's (``...evaluation``), checkpoints
transformers' ``checkpoint-N`` (``...checkpoints``), resumed bit for bit.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import torch

from rlvr_fast.train import distributed
from rlvr_fast.train.nonfinite import check_finite
from rlvr_fast.train.trainer import RLVRTrainer, add_to_totals
from rlvr_fast.trl_compat import checkpoints
from rlvr_fast.trl_compat.accelerator import Accelerator
from rlvr_fast.trl_compat.config import GRPOConfig
from rlvr_fast.trl_compat.peft_model import adapter_config, adapter_state, peft_model_of
from rlvr_fast.trl_compat.model_io import (
    is_transformers_model,
    load_processing_class,
    load_trl_policy,
    meta_transformers_model,
    model_directory,
    policy_dtype,
)
from rlvr_fast.trl_compat.reporting import (
    CompletionsLog,
    group_advantages,
    step_metrics,
    step_policy_figures,
    window_means,
)
from rlvr_fast.trl_compat.run_files import TRAINER_STATE_EVAL_STEPS, mirror_pad_token
from rlvr_fast.trl_compat.rewards import RewardFunctionsTask, RewardModel, callable_name
from rlvr_fast.trl_compat.run_setup import (
    dataset_rows,
    eval_datasets,
    refuse_unsupported_arguments,
    train_config,
    training_device,
)

from rlvr_fast.trl_compat.saving import ALLOW_NONFINITE, SavingAndSurface
from rlvr_fast.trl_compat.tools import tool_calling


def completion_end_ids(tokenizer) -> set[int]:
    """The ids that end a completion as TRL cuts them: every EOS id and the padding id."""
    return set(tokenizer.eos_token_ids) | {tokenizer.pad_token_id}


def resolved_args(model, args: GRPOConfig | None) -> GRPOConfig:
    """``args``, or TRL's default GRPOConfig named after the model (``NAME-GRPO``)."""
    if args is None:
        name = str(model) if isinstance(model, (str, Path)) else model.config._name_or_path
        args = GRPOConfig(f"{name.rstrip('/').split('/')[-1]}-GRPO")
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be rlvr_fast's GRPOConfig, got {type(args).__name__}")
    return args


def reward_functions(reward_funcs, processing_classes, args, device) -> list:
    """The reward functions as TRL takes them: callables, and models (a path or a transformers
    model, with its processing class) scored as ``RewardModel``; one weight each."""
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    processors = processing_classes
    processors = processors if isinstance(processors, list) else [processors] * len(funcs)
    functions = [
        f if callable(f) and not is_transformers_model(f) else RewardModel(f, p, device)
        for f, p in zip(funcs, processors)
    ]
    if not functions or reward_funcs is None:
        raise ValueError("reward_funcs is required: a callable, a model path, or a list")
    weights = args.reward_weights or [1.0] * len(functions)
    if len(weights) != len(functions):
        raise ValueError(
            f"number of reward weights ({len(weights)}) must match number of "
            f"reward functions ({len(functions)})"
        )
    return functions


def steps_per_epoch(args, rows: int) -> int:
    """Optimizer steps per pass over ``rows`` prompts, as TRL's sampler repeats each generation
    batch and its buffer splits it."""
    steps = rows // args.prompts_per_step * args.updates_per_generation
    if steps == 0:
        raise ValueError(
            f"train_dataset has {rows} prompts, fewer than one step's "
            f"{args.prompts_per_step} (generation_batch_size / num_generations)"
        )
    return steps


def trainer_state(args, epoch_steps: int):
    """transformers' TrainerState at the start: max_steps (from num_train_epochs when
    max_steps <= 0) and the logging, evaluation and saving intervals in steps."""
    from transformers import TrainerState

    max_steps = args.max_steps
    if max_steps <= 0:
        max_steps = math.ceil(args.num_train_epochs * epoch_steps)
    return TrainerState(
        max_steps=max_steps,
        num_train_epochs=math.ceil(max_steps / epoch_steps),
        train_batch_size=args.per_device_train_batch_size,
        logging_steps=args.resolve_steps(args.logging_steps, max_steps),
        eval_steps=(
            args.resolve_steps(args.eval_steps or args.logging_steps, max_steps)
            if args.eval_steps is not None or args.strategy("eval_strategy") != "no"
            else TRAINER_STATE_EVAL_STEPS
        ),
        save_steps=args.resolve_steps(args.save_steps, max_steps),
        is_world_process_zero=distributed.is_main(),
        is_local_process_zero=distributed.is_main(),
    )


def completions_log(args, names: list[str]) -> CompletionsLog | None:
    """TRL's completions log under ``output_dir/completions`` (None: log_completions off)."""
    if not args.log_completions:
        return None
    return CompletionsLog(
        Path(args.output_dir) / "completions",
        names,
        args.num_completions_to_print,
        args.log_unique_prompts,
    )


class GRPOTrainer(SavingAndSurface):
    """TRL 1.16's ``GRPOTrainer`` on rlvr_fast (see the module docstring)."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ) -> None:
        from transformers import TrainerControl

        refuse_unsupported_arguments(
            optimizers=optimizers,
            quantization_config=quantization_config,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        args = resolved_args(model, args)
        self.args, self.hub_model_id = args, args.hub_model_id
        device = training_device(args)
        self.accelerator = Accelerator(device)
        self.processing_class = load_processing_class(model, processing_class)
        self.policy = load_trl_policy(
            model, self.processing_class, device=device, dtype=policy_dtype(args)
        )
        self.model_dir = model_directory(model)
        # A PeftModel's adapter trains (its LoraConfig, from its weights) and is saved by it.
        self.peft_model = peft_model_of(model)
        adapter_weights = None
        if self.peft_model is not None:
            peft_config = adapter_config(self.peft_model, peft_config)
            adapter_weights = adapter_state(self.peft_model)
        # The model the trainer reports: the one given, or a meta-device stand-in for a path.
        self.model = (
            model if is_transformers_model(model) else meta_transformers_model(self.model_dir)
        )
        mirror_pad_token(self.model, self.processing_class, args.gradient_checkpointing)

        self.tool_calling = tool_calling(tools, self.processing_class, args, self.policy)
        self.reward_funcs = reward_functions(reward_funcs, reward_processing_classes, args, device)
        self.reward_func_names = [callable_name(f) for f in self.reward_funcs]

        self.rows = dataset_rows(train_dataset, args.remove_unused_columns, "train_dataset")
        self.prompts_per_step = args.prompts_per_step
        self.steps_per_epoch = steps_per_epoch(args, len(self.rows))
        self.state = trainer_state(args, self.steps_per_epoch)
        max_steps = self.state.max_steps
        self.control = TrainerControl()
        self._metrics: dict[str, list] = {}
        # checkpoint-N directories this run wrote (recorded in each one's manifest): the only
        # ones save_total_limit rotates.
        self._checkpoints_written: list[str] = []
        # The LoraConfig of a peft_config= run, which its adapter_config.json is written from.
        self.peft_config = peft_config
        config = train_config(
            args, max_steps, self.prompts_per_step, peft_config, adapter_weights is not None
        )
        self.task = self._task(self.rows, config.gate_min_chars)
        self.eval_tasks = self._eval_tasks(eval_dataset, config.gate_min_chars)
        # The ledger is a run directory of its own, which save_model never writes into.
        ledger_dir = Path(args.output_dir) / "ledger" if args.ledger else None
        self.trainer = RLVRTrainer(
            self.policy,
            config,
            self.task.problems(),
            out_dir=ledger_dir,
            progress=False,
            task=self.task,
            adapter_weights=adapter_weights,
        )
        self.optimizer = self.trainer.optimizer
        self.lr_scheduler = self._scheduler(max_steps)
        self.completions_log = completions_log(args, self.reward_func_names)
        self.callback_handler = self._callback_handler(callbacks)
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def _eval_tasks(self, eval_dataset, gate_min_chars) -> dict:
        """Each eval dataset's task and prompt count, by name ("" for a single dataset)."""
        args = self.args
        tasks = {
            name: (self._task(rows, gate_min_chars), len(rows))
            for name, rows in eval_datasets(eval_dataset, args.remove_unused_columns).items()
        }
        if args.strategy("eval_strategy") != "no" and not tasks:
            raise ValueError(f"eval_strategy={args.strategy('eval_strategy')!r} needs eval_dataset")
        return tasks

    def _task(self, rows: list[dict], gate_min_chars) -> RewardFunctionsTask:
        return RewardFunctionsTask(
            rows,
            self.reward_funcs,
            self.args.reward_weights or [1.0] * len(self.reward_funcs),
            self._encode_prompt,
            gate_min_chars=gate_min_chars,
            trainer_state=self.state,
            log_metric=self._record,
            log_extra=lambda column, values: None,
            normalize_each=self.args.multi_objective_aggregation == "normalize_then_sum",
            turns=self.tool_calling,
        )

    def _scheduler(self, max_steps: int):
        from transformers import get_scheduler

        return get_scheduler(
            self.args.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=self.args.warmup(max_steps),
            num_training_steps=max_steps,
            scheduler_specific_kwargs=self.args.lr_scheduler_kwargs or {},
        )

    def _callback_handler(self, callbacks):
        from transformers.integrations import get_reporting_integration_callbacks
        from transformers.trainer_callback import (
            CallbackHandler,
            DefaultFlowCallback,
            PrinterCallback,
            ProgressCallback,
        )

        reporting = get_reporting_integration_callbacks(self.args.report_to)
        handler = CallbackHandler(
            [DefaultFlowCallback, *reporting, *(callbacks or [])],
            self.model,
            self.processing_class,
            self.optimizer,
            self.lr_scheduler,
        )
        handler.add_callback(PrinterCallback if self.args.disable_tqdm else ProgressCallback)
        return handler

    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """transformers' loop: on_train_begin, per step on_step_begin, one rlvr_fast step,
        on_step_end, then log / evaluate / save as the flow callback says (and at each epoch's
        end); finally the train metrics and on_train_end."""
        from transformers.trainer_utils import TrainOutput, speed_metrics

        args, state = self.args, self.state
        checkpoint = checkpoints.resolve_checkpoint(resume_from_checkpoint, Path(args.output_dir))
        if checkpoint is not None:
            self._resume(checkpoint)
        first_step, started = state.global_step, time.time()
        self._loss_total, self._last_logged, self._totals = 0.0, state.global_step, {}
        self.control = self.callback_handler.on_train_begin(args, state, self.control)
        if args.eval_on_start and self.eval_tasks:
            self.evaluate()
        while state.global_step < state.max_steps and not self.control.should_training_stop:
            position = state.global_step % self.steps_per_epoch
            if position == 0:
                self.control = self.callback_handler.on_epoch_begin(args, state, self.control)
            self._train_step()
            self.control = self.callback_handler.on_step_end(args, state, self.control)
            self._maybe_log_save_evaluate()
            if position + 1 == self.steps_per_epoch:
                self.control = self.callback_handler.on_epoch_end(args, state, self.control)
                self._maybe_log_save_evaluate()
        steps = state.global_step - first_step
        metrics = speed_metrics(
            "train",
            started,
            num_samples=steps * args.generation_batch_size // args.generation_steps,
            num_steps=steps,
        )
        metrics["total_flos"] = state.total_flos
        metrics["train_loss"] = self._loss_total / max(steps, 0.001)
        # TRL's log merges the metrics of the steps since the last log into this one.
        pending = self._window() if state.global_step > self._last_logged else {}
        self.log({**metrics, **{k: v for k, v in pending.items() if k != "loss"}})
        # A ledger of every step asked for is a finished run (verify reads it so); one stopped
        # early by a callback stays unfinished.
        finished = state.global_step == state.max_steps
        self.trainer.close(
            dict(arm=self.trainer.config.arm, steps=state.global_step, totals_this_run=self._totals)
            if finished
            else None
        )
        self._sync_model()
        self.control = self.callback_handler.on_train_end(args, state, self.control)
        return TrainOutput(state.global_step, metrics["train_loss"], metrics)

    def _train_step(self) -> None:
        state = self.state
        self.control = self.callback_handler.on_step_begin(self.args, state, self.control)
        started = time.perf_counter()
        learning_rate = self.optimizer.param_groups[0]["lr"]
        result = self.trainer.step_on(state.global_step, self._step_problems(state.global_step))
        if not self.args.allow_nonfinite:
            check_finite(
                state.global_step,
                result.record,
                self.policy.model,
                learning_rate,
                None,
                ALLOW_NONFINITE,
            )
        add_to_totals(self._totals, result.record)
        with warnings.catch_warnings():
            # torch warns when a schedule steps before optimizer.step(); zero-gradient AdamW
            # steps (the fused kernel) advance the moments without calling it.
            warnings.simplefilter("ignore", UserWarning)
            self.lr_scheduler.step()
        state.global_step += 1
        state.epoch = state.global_step / self.steps_per_epoch
        state.total_flos += result.record["flops_full"]
        self._record_step(time.perf_counter() - started, result.record)
        self._grad_norm = result.record["grad_norm"] or 0.0
        self._learning_rate = learning_rate

    def _step_problems(self, step: int) -> list:
        """The prompts of optimizer step ``step``: its generation's slice of its epoch's
        order."""
        epoch, position = divmod(step, self.steps_per_epoch)
        order = self._epoch_order(epoch)
        first = position // self.args.updates_per_generation * self.prompts_per_step
        return [self.trainer.train_data[i] for i in order[first : first + self.prompts_per_step]]

    def _epoch_order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s prompt order: TRL's RepeatSampler draws one randperm per epoch from
        one generator seeded with ``seed`` (replayed here, so a resumed run reads the same)."""
        if not self.args.shuffle_dataset:
            return list(range(len(self.rows)))
        cached = getattr(self, "_order", None)
        if cached is None or cached[0] != epoch:
            generator = torch.Generator().manual_seed(self.args.seed)
            for _ in range(epoch + 1):
                order = torch.randperm(len(self.rows), generator=generator).tolist()
            self._order = (epoch, order)
        return self._order[1]

    def _maybe_log_save_evaluate(self) -> None:
        control, state = self.control, self.state
        if control.should_log and state.global_step > self._last_logged:
            logs = self._window()
            self._last_logged = state.global_step
            self.log(
                {
                    "loss": logs.pop("loss"),
                    "grad_norm": self._grad_norm,
                    "learning_rate": self._learning_rate,
                    **logs,
                }
            )
        if control.should_evaluate:
            self.evaluate()
        if control.should_save:
            self._save_checkpoint()
            self.control = self.callback_handler.on_save(self.args, state, self.control)

    # ------------------------------------------------------------------ metrics and logs
    def _record(self, name: str, value) -> None:
        self._metrics.setdefault(name, []).append(value)

    def _record_step(self, seconds: float, record: dict) -> None:
        groups = self.task.groups
        config = self.trainer.config
        self.state.num_input_tokens_seen += sum(
            len(self.task.encoded[g.row]) * len(g.completion_ids) + sum(g.lengths) for g in groups
        )
        values = step_metrics(
            groups,
            config,
            completion_end_ids(self.policy.tokenizer),
            self.reward_func_names,
            self.state.num_input_tokens_seen,
            dict(record, policy=step_policy_figures(self, self.state.global_step - 1)),
        )
        self._loss_total += values["loss"]
        if self.tool_calling is not None:
            values.update(self.task.tool_metrics)
        values["step_time"] = seconds
        for name, value in values.items():
            self._record(name, value)
        if self.completions_log is not None:
            self.completions_log.add(
                self.state.global_step, groups, group_advantages(groups, config)
            )

    def _window(self) -> dict:
        logs = window_means(self._metrics)
        self._metrics = {}
        return logs

    # ------------------------------------------------------------------ prompts
    def _encode_prompt(self, prompt) -> list[int]:
        """Prompt ids as TRL makes them: the processing class's chat template for a message
        list, its tokenizer for text; the last max_prompt_length kept."""
        from rlvr_fast.trl_compat.rewards import is_conversational

        if self.tool_calling is not None:
            ids = self.tool_calling.encode_prompt(prompt)
        elif is_conversational(prompt):
            ids = self.processing_class.apply_chat_template(
                [prompt],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **(self.args.chat_template_kwargs or {}),
            )["input_ids"][0]
        else:
            ids = self.processing_class(text=prompt)["input_ids"]
        ids = list(ids)
        if self.args.max_prompt_length is not None:
            ids = ids[-self.args.max_prompt_length :]
        return ids
