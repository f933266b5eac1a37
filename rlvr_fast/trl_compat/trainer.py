"""``GRPOTrainer``: TRL's constructor, ``train()``, ``save_model()``, ``state.log_history`` and
callbacks, on rlvr_fast's engine and trainer (``rlvr_fast.train.trainer.RLVRTrainer``).

Each optimizer step takes the next prompt (TRL's order: a ``torch.randperm`` per epoch from a
generator seeded with ``seed``), samples ``num_generations`` completions on the rollout engine
(the prompt prefilled once and forked), scores them with the reward functions, and steps with
TRL's loss at one update per generation, where the clipped ratio is exactly 1:

    loss = -sum_i sum_t A_i s_i log pi_T(y_it) / G,   pi_T = softmax(logits / temperature)

with s_i the normaliser of ``loss_type`` (``rlvr_fast.train.losses.sequence_scales``: grpo 1/|o_i|,
dapo and bnpo G / sum_j |o_j|, dr_grpo 1/max_completion_length) and A_i TRL's advantages
(``scale_rewards``). ``loss_type="sum"`` is the study's loss instead: s_i = 1 on untempered
log-probabilities. Zero-variance groups (every A_i = 0, so TRL's gradient is exactly zero) skip
the forward and backward and take the zero-gradient AdamW step, the same update bit for bit
(``skip_zero_variance_backward=False`` runs TRL's backward instead). ``arm=`` applies a study
arm's preset (its gate, stepping rule and sampler) on top.

Logged as TRL logs them (means over the logging window): loss (TRL's surrogate value,
-sum_it w_it), grad_norm, learning_rate, num_tokens, completions/*, rewards/NAME/mean|std,
reward, reward_std, frac_reward_zero_std, entropy, clip_ratio/* (0: the ratio is 1),
step_time, epoch; at the end train_runtime, train_samples_per_second,
train_steps_per_second, total_flos (the study's Full FLOPs), train_loss. ``entropy`` is logged
as None (TRL's value for a metric without data): the fused loss never forms the per-token
distribution, and computing it would cost a second pass over the LM head.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from rlvr_fast.train.arms import arm_settings
from rlvr_fast.utils.files import files_into, replaced_directory
from rlvr_fast.train.nonfinite import NonFiniteError, check_finite, first_nonfinite_weight
from rlvr_fast.train.trainer import RLVRTrainer, add_to_totals
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.losses import sequence_scales
from rlvr_fast.credit.group import standardised_advantages
from rlvr_fast.trl_compat.config import GRPOConfig
from rlvr_fast.trl_compat.model_io import copy_weights_to, is_transformers_model, load_trl_policy
from rlvr_fast.trl_compat.rewards import RewardFunctionsTask, callable_name, is_conversational

ALLOW_NONFINITE = "GRPOConfig(allow_nonfinite=True)"
CLIP_RATIO_KEYS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


@dataclass
class TrainerState:
    """The fields of ``transformers.TrainerState`` callbacks and scripts read."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: float = 0.0
    logging_steps: int = 0
    save_steps: int = 0
    train_batch_size: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict] = field(default_factory=list)
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True


@dataclass
class TrainerControl:
    """``transformers.TrainerControl``: callbacks set these to steer the loop."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict


class LRSchedule:
    """transformers' schedulers of these names (linear, constant, constant_with_warmup,
    cosine), setting each group's lr before a step. Not a torch LRScheduler: those count
    ``optimizer.step()`` calls, and zero-gradient steps advance AdamW without one."""

    def __init__(self, optimizer, kind: str, warmup: int, total: int) -> None:
        self.optimizer, self.kind, self.warmup, self.total = optimizer, kind, warmup, total
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_step = 0
        self._apply()

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        if self.kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def _apply(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * self.factor(self.last_step)


def dataset_rows(dataset, remove_unused_columns: bool) -> list[dict]:
    """Rows of a ``datasets.Dataset`` or a list of dicts, each with a ``prompt``."""
    if dataset is None:
        raise ValueError("train_dataset is required")
    rows = [dict(row) for row in dataset]
    if not rows:
        raise ValueError("train_dataset is empty")
    for index, row in enumerate(rows):
        if "prompt" not in row:
            raise ValueError(f"train_dataset row {index} has no 'prompt' column")
    if remove_unused_columns:
        rows = [{"prompt": row["prompt"]} for row in rows]
    return rows


def train_config(args: GRPOConfig, max_steps: int) -> TrainConfig:
    """The rlvr_fast settings of a GRPOConfig (arm presets applied over TRL's loss)."""
    study_loss = args.loss_type == "sum"
    settings = dict(
        steps=max_steps,
        seed=args.seed,
        group_size=args.num_generations,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_completion_length,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm or None,
        loss_order="token_weighted",
        loss_type="dapo" if args.loss_type == "bnpo" else args.loss_type,
        scale_rewards=args.scale_rewards != "none",
        tempered_logprobs=not study_loss,
        mask_truncated=args.mask_truncated_completions,
        skip_zero_var=args.skip_zero_variance_backward,
        zero_var_step="zero_grad",
        fused_zero_grad_step=args.fused_zero_grad_step,
        eval_before=False,
        allow_nonfinite=args.allow_nonfinite,
        t_min=args.tree_t_min,
        t_max=args.tree_t_max,
    )
    if args.arm is not None:
        preset = arm_settings(args.arm)
        if preset.get("sampler") == "parallel":
            raise ValueError(
                f"GRPOConfig: arm {args.arm!r} votes on graded answers; reward "
                "functions cannot drive parallel-path arms"
            )
        if not study_loss:
            # TRL's loss types weight every token; the arm's sum-then-scale order is the study's.
            preset.pop("loss_order", None)
        settings.update(preset)
    if args.tree:
        settings.update(
            sampler="tree", bifurcate_after_active=settings.get("bifurcate_after_active", 0)
        )
    if settings.get("sampler") == "tree":
        if not study_loss or args.scale_rewards == "none" or args.mask_truncated_completions:
            raise ValueError(
                "GRPOConfig: tree rollouts weight tokens by TreeRL credit; set "
                "loss_type='sum' with scale_rewards on and no "
                "mask_truncated_completions"
            )
        settings["tree_k"] = args.num_generations // 2
    return TrainConfig(**settings)


class GRPOTrainer:
    """TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset,
    processing_class, callbacks)`` on rlvr_fast (see the module docstring)."""

    def __init__(
        self,
        model,
        reward_funcs,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
    ) -> None:
        if args is None:
            name = Path(str(model)).name if isinstance(model, (str, Path)) else type(model).__name__
            args = GRPOConfig(f"{name}-GRPO")
        self.args = args
        self.hf_model = model if is_transformers_model(model) else None
        self.processing_class = processing_class
        self.eval_dataset = eval_dataset
        self.callbacks = list(callbacks or [])
        device = torch.device("cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu")
        self.policy = load_trl_policy(model, processing_class, device=device, bf16=args.bf16)
        self.model = self.hf_model if self.hf_model is not None else self.policy.model

        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if not funcs or not all(callable(f) for f in funcs):
            raise TypeError("reward_funcs must be a callable or a list of callables")
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(
                f"number of reward weights ({len(weights)}) must match number of "
                f"reward functions ({len(funcs)})"
            )
        self.reward_func_names = [callable_name(f) for f in funcs]

        self.rows = dataset_rows(train_dataset, args.remove_unused_columns)
        self.steps_per_epoch = len(self.rows)
        max_steps = (
            args.max_steps
            if args.max_steps > 0
            else math.ceil(args.num_train_epochs * self.steps_per_epoch)
        )
        self.state = TrainerState(
            max_steps=max_steps,
            num_train_epochs=math.ceil(max_steps / self.steps_per_epoch),
            train_batch_size=args.per_device_train_batch_size,
            logging_steps=args.resolve_steps(args.logging_steps, max_steps),
            save_steps=args.resolve_steps(args.save_steps, max_steps),
        )
        self.control = TrainerControl()
        self._metrics: dict[str, list] = {}
        config = train_config(args, max_steps)
        self.task = RewardFunctionsTask(
            self.rows,
            funcs,
            weights,
            self._encode_prompt,
            gate_min_chars=config.gate_min_chars,
            trainer_state=self.state,
            log_metric=self._record,
        )
        # The ledger is a run directory of its own, which save_model never writes into.
        out_dir = Path(args.output_dir) / "ledger" if args.ledger else None
        self.trainer = RLVRTrainer(
            self.policy,
            config,
            self.task.problems(),
            out_dir=out_dir,
            progress=False,
            task=self.task,
        )
        self.optimizer = self.trainer.optimizer
        self.lr_scheduler = LRSchedule(
            self.optimizer, args.lr_scheduler_type, args.warmup(max_steps), max_steps
        )
        self.order = torch.Generator().manual_seed(args.seed)
        self._tensorboard = self._open_tensorboard() if "tensorboard" in args.report_to else None
        self._callback("on_init_end")

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainOutput:
        args, state = self.args, self.state
        started = time.perf_counter()
        losses, flops, totals = [], 0.0, {}
        self._callback("on_train_begin")
        order: list[int] = []
        progress = tqdm(
            total=state.max_steps, desc="train", unit="step", disable=bool(args.disable_tqdm)
        )
        while state.global_step < state.max_steps and not self.control.should_training_stop:
            if not order:
                order = self._epoch_order()
            index = order.pop(0)
            self._callback("on_step_begin")
            step_started = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            result = self.trainer.step_on(state.global_step, [self.trainer.train_data[index]])
            if not args.allow_nonfinite:
                check_finite(
                    state.global_step, result.record, self.policy.model, lr, None, ALLOW_NONFINITE
                )
            add_to_totals(totals, result.record)
            self.lr_scheduler.step()
            loss = self._record_step(result.record, time.perf_counter() - step_started)
            losses.append(loss)
            flops += result.record["flops_full"]
            state.global_step += 1
            state.epoch = state.global_step / self.steps_per_epoch
            progress.update(1)
            self._callback("on_step_end")
            if self._should_log():
                self._log({**self._window_means(), "learning_rate": lr})
            if args.save_strategy == "steps" and state.global_step % state.save_steps == 0:
                self._save_checkpoint()
        progress.close()
        runtime = time.perf_counter() - started
        state.total_flos = flops
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(
                state.global_step * args.num_generations / runtime, 3
            ),
            "train_steps_per_second": round(state.global_step / runtime, 3),
            "total_flos": flops,
            "train_loss": sum(losses) / max(1, len(losses)),
        }
        self._log(dict(metrics))
        # A ledger of every step asked for is a finished run (verify reads it so); one stopped
        # early by a callback stays unfinished.
        finished = state.global_step == state.max_steps
        self.trainer.close(
            dict(arm=self.trainer.config.arm, steps=state.global_step, totals_this_run=totals)
            if finished
            else None
        )
        if self.hf_model is not None:
            copy_weights_to(self.policy, self.hf_model)
        self._callback("on_train_end")
        return TrainOutput(state.global_step, metrics["train_loss"], metrics)

    def _epoch_order(self) -> list[int]:
        if not self.args.shuffle_dataset:
            return list(range(len(self.rows)))
        return torch.randperm(len(self.rows), generator=self.order).tolist()

    def _should_log(self) -> bool:
        if self.args.logging_strategy == "no":
            return False
        step = self.state.global_step
        return (
            step % self.state.logging_steps == 0
            or step == self.state.max_steps
            or (step == 1 and self.args.logging_first_step)
        )

    # ------------------------------------------------------------------ metrics
    def _record(self, name: str, value) -> None:
        self._metrics.setdefault(name, []).append(value)

    def _record_step(self, record: dict, seconds: float) -> float:
        """Record one step's TRL metrics; returns its loss as TRL logs it."""
        scored = self.task.last
        lengths = [len(ids) for ids in scored.completion_ids]
        eos = set(self.policy.tokenizer.eos_token_ids) | {self.policy.tokenizer.pad_token_id}
        truncated = [ids[-1] not in eos for ids in scored.completion_ids]
        terminated = [n for n, cut in zip(lengths, truncated) if not cut] or [0]
        self.state.num_input_tokens_seen += record["prompt_len"] * len(lengths) + sum(lengths)
        config = self.trainer.config
        advantages, sigma = standardised_advantages(
            scored.rewards.tolist(), scale=config.scale_rewards
        )
        scales = sequence_scales(
            lengths,
            config.loss_type,
            config.max_new_tokens,
            truncated if config.mask_truncated else None,
        )
        # TRL's loss value: the surrogate -sum_it A_i s_i / G at ratio 1.
        loss = -float((advantages * scales * torch.tensor(lengths)).sum()) / len(lengths)
        values = {
            "loss": loss,
            "grad_norm": record["grad_norm"] or 0.0,
            "num_tokens": float(self.state.num_input_tokens_seen),
            "completions/mean_length": sum(lengths) / len(lengths),
            "completions/min_length": float(min(lengths)),
            "completions/max_length": float(max(lengths)),
            "completions/clipped_ratio": sum(truncated) / len(truncated),
            "completions/mean_terminated_length": sum(terminated) / len(terminated),
            "completions/min_terminated_length": float(min(terminated)),
            "completions/max_terminated_length": float(max(terminated)),
        }
        for index, name in enumerate(self.reward_func_names):
            column = scored.per_function[:, index]
            values[f"rewards/{name}/mean"] = nan_mean(column)
            values[f"rewards/{name}/std"] = nan_std(column)
        values.update(
            {
                "reward": nan_mean(scored.rewards),
                "reward_std": nan_std(scored.rewards),
                "frac_reward_zero_std": float(sigma == 0.0),
                "entropy": None,
            }
        )
        values.update({key: 0.0 for key in CLIP_RATIO_KEYS})
        values["step_time"] = seconds
        for name, value in values.items():
            self._record(name, value)
        return loss

    def _window_means(self) -> dict:
        """The window's metrics as TRL logs them: means over steps (None and NaN left out; a
        metric with no value is None), num_tokens the running total."""
        logs = {}
        for name, values in self._metrics.items():
            valid = [v for v in values if v is not None and not math.isnan(v)]
            logs[name] = (
                (valid[-1] if name == "num_tokens" else sum(valid) / len(valid)) if valid else None
            )
        self._metrics = {}
        return logs

    def _log(self, logs: dict) -> None:
        logs = {**logs, "epoch": self.state.epoch, "step": self.state.global_step}
        self.state.log_history.append(logs)
        if self._tensorboard is not None:
            for name, value in logs.items():
                if isinstance(value, (int, float)) and name != "step":
                    self._tensorboard.add_scalar(f"train/{name}", value, self.state.global_step)
        self._callback("on_log", logs=logs)

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("report_to='tensorboard' needs the tensorboard package") from err
        return SummaryWriter(str(Path(self.args.output_dir) / "runs"))

    def _callback(self, event: str, **kwargs) -> None:
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is not None:
                hook(
                    self.args,
                    self.state,
                    self.control,
                    model=self.model,
                    processing_class=self.processing_class,
                    optimizer=self.optimizer,
                    lr_scheduler=self.lr_scheduler,
                    **kwargs,
                )

    # ------------------------------------------------------------------ prompts and saving
    def _encode_prompt(self, prompt) -> list[int]:
        """Prompt ids as TRL makes them: the processing class's chat template for a message
        list, its tokenizer (else ours) for text; the last max_prompt_length kept."""
        if is_conversational(prompt):
            if self.processing_class is None:
                raise ValueError(
                    "conversational prompts need processing_class (a tokenizer "
                    "with a chat template)"
                )
            ids = self.processing_class.apply_chat_template(
                [prompt],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **(self.args.chat_template_kwargs or {}),
            )["input_ids"][0]
        elif self.processing_class is not None:
            ids = self.processing_class(text=prompt)["input_ids"]
        else:
            ids = self.policy.tokenizer.encode(prompt)
        ids = list(ids)
        if self.args.max_prompt_length is not None:
            ids = ids[-self.args.max_prompt_length :]
        return ids

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained weights as a Hugging Face directory (config, safetensors, tokenizer),
        written beside what ``output_dir`` already holds (checkpoints, the ledger), each file
        whole."""
        weight = first_nonfinite_weight(self.policy.model)
        if weight is not None and not self.args.allow_nonfinite:
            raise NonFiniteError(
                f"save_model: weight {weight} is not finite; {ALLOW_NONFINITE} saves it"
            )
        with files_into(Path(output_dir or self.args.output_dir)) as staging:
            self._write_model(staging)

    def _write_model(self, directory: Path) -> None:
        if self.hf_model is not None:
            copy_weights_to(self.policy, self.hf_model)
            self.hf_model.save_pretrained(directory)
        else:
            self.policy.write_files(directory)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(directory)

    def _save_checkpoint(self) -> None:
        """OUTPUT_DIR/checkpoint-STEP: the model and trainer_state.json, swapped in whole."""
        directory = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        with replaced_directory(directory) as staging:
            self._write_model(staging)
            (staging / "trainer_state.json").write_text(
                json.dumps(asdict(self.state), indent=2) + "\n", encoding="utf-8"
            )
        self._callback("on_save")


def nan_mean(values: torch.Tensor) -> float:
    return float(values.nanmean())


def nan_std(values: torch.Tensor) -> float:
    """Bessel-corrected std of the non-NaN values (NaN with fewer than two), as TRL's nanstd."""
    valid = values[~values.isnan()]
    return float(valid.std()) if valid.numel() > 1 else float("nan")
