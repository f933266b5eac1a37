"""``GRPOTrainer``'s saving and resuming (``save_model``, transformers' ``checkpoint-N``) and the
rest of the ``Trainer`` surface scripts call (``evaluate``, ``log_metrics``, ``save_state``,
``push_to_hub``, ...), a mixin over the state ``rlvr_fast.trl_compat.trainer.GRPOTrainer`` holds."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from rlvr_fast.train import distributed
from rlvr_fast.train.nonfinite import NonFiniteError, first_nonfinite_weight
from rlvr_fast.trl_compat import checkpoints
from rlvr_fast.trl_compat.evaluation import evaluate_dataset
from rlvr_fast.trl_compat.model_io import requested_dtype, synced_transformers_model
from rlvr_fast.trl_compat.peft_model import copy_adapters_into, write_adapter_config
from rlvr_fast.run.checkpoint import SHARDS_KEY
from rlvr_fast.utils.files import files_into, new_temp_directory, publish_staged_directory
from rlvr_fast.trl_compat.run_files import (
    card_model_name,
    model_card,
    record_stateful_callbacks,
    write_training_args,
)
from rlvr_fast.trl_compat.run_setup import eval_datasets
from rlvr_fast.trl_compat.trl_checkpoint import is_trl_checkpoint, resume_from_trl_checkpoint

ALLOW_NONFINITE = "GRPOConfig(allow_nonfinite=True)"
# _sync_model's default: take the trainer's saved weights itself.
GATHER = object()


class SavingAndSurface:
    """Mixed into ``GRPOTrainer``: reads its args, state, policy, trainer and callbacks."""

    # ------------------------------------------------------------------ saving and resuming
    def _sync_model(self, weights=GATHER) -> None:
        """Give ``self.model`` (a transformers model) the policy's weights: ``weights``, the
        trainer's saved weights taken already, or (``GATHER``) taken here (sharded, a collective:
        every rank calls it)."""
        # A bf16-mixed run's model is its fp32 masters (what the Trainer saves of a bf16 run),
        # in the dtype model_init_kwargs asks for when it names one.
        weights = self.trainer.saved_weights() if weights is GATHER else weights
        if self.peft_model is not None:  # the caller's PeftModel: its adapter's tensors
            copy_adapters_into(self.peft_model, self.policy.adapters, weights)
            return
        if self.policy.adapters is not None:
            weights = None  # the merged decoder's: the frozen base has no fp32 masters
        dtype = requested_dtype(self.args)
        if weights is not None and dtype is not None:
            weights = {name: t.to(dtype) for name, t in weights.items()}
        self.model = synced_transformers_model(self.policy, self.model, weights)
        self.callback_handler.model = self.model

    def _writes(self) -> bool:
        """Whether this rank takes part in a save: rank 0, which writes, and every rank of a
        sharded run, which gathers."""
        return distributed.is_main() or self.trainer.sharded is not None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trained model as a Hugging Face directory (config, safetensors, tokenizer),
        written beside what ``output_dir`` already holds (checkpoints, the ledger), each file
        whole (sharded: every rank gathers, rank 0 writes; every rank must call it)."""
        if not self._writes():
            return
        weight = first_nonfinite_weight(self.policy.model)
        if weight is not None and not self.args.allow_nonfinite:
            raise NonFiniteError(
                f"save_model: weight {weight} is not finite; {ALLOW_NONFINITE} saves it"
            )
        weights = self.trainer.saved_weights()
        if not distributed.is_main():
            return
        with files_into(Path(output_dir or self.args.output_dir)) as staging:
            self._write_model(staging, weights)

    def _write_model(self, directory: Path, weights) -> None:
        """The model's files, or with LoRA peft's adapter files (as TRL saves a PeftModel: a
        caller's PeftModel saves itself); the processing class's and training_args.bin beside
        them (``weights``: the saved weights, gathered by every rank of a sharded run)."""
        self._sync_model(weights)
        adapters = self.policy.adapters
        if self.peft_model is not None:
            self.peft_model.save_pretrained(directory)
        elif adapters is None:
            self.model.save_pretrained(directory)
        else:
            base = str(self.model_dir or self.model.config._name_or_path)
            adapters.write_files(directory, base, weights)
            write_adapter_config(self.peft_config, adapters, base, directory)
        self.processing_class.save_pretrained(directory)
        write_training_args(self.args, directory)

    def _save_checkpoint(self) -> None:
        """checkpoint-N, written by rank 0 (sharded: every rank first writes its shards of the
        weights, the optimizer's moments, the Polyak sums and the RNG states in DCP, nothing
        gathered, into a temp folder beside, which rank 0 moves into the checkpoint, and gathers
        the model's weights one tensor at a time for its Hugging Face files; the checkpoint
        resumes on any number of ranks)."""
        if not self._writes():
            return
        write_state, state, holder = None, None, None
        step, world = self.state.global_step, distributed.world_size()
        output_dir = Path(self.args.output_dir)
        try:
            if not self.args.save_only_model:
                if self.trainer.sharded is not None:
                    state, holder = self._sharded_state(output_dir, step, world)
                else:
                    state = self.trainer.checkpointer.state(step, world)

                def write_state(path: Path) -> None:
                    if holder is not None:  # (the shards into the checkpoint, beside the file)
                        name = state[SHARDS_KEY]["directory"]
                        publish_staged_directory(holder / name, path.parent / name)
                    self.trainer.checkpointer.save(path, step, world, state)

            weights = self.trainer.saved_weights()
            if not distributed.is_main():
                return
            # As TRL: the model card in output_dir, then the checkpoint.
            self.create_model_card(model_name=card_model_name(self.args))
            record_stateful_callbacks(self.state, self.control, self.callback_handler.callbacks)
            written = checkpoints.write_checkpoint(
                output_dir,
                self.state.global_step,
                lambda directory: self._write_model(directory, weights),
                write_state,
                self.state,
                self._checkpoints_written,
            )
        finally:
            if holder is not None and distributed.is_main():
                shutil.rmtree(holder, ignore_errors=True)
        self._checkpoints_written = checkpoints.rotate(
            output_dir, self.args.save_total_limit, [*self._checkpoints_written, written.name]
        )

    def _sharded_state(self, output_dir: Path, step: int, world: int) -> tuple[dict, Path]:
        """A sharded run's checkpoint state (every rank calls this): each rank's shards written
        in DCP into a temp folder beside checkpoint-``step`` (rank 0's, named to all), and the
        state naming them."""
        holder = None
        if distributed.is_main():
            output_dir.mkdir(parents=True, exist_ok=True)
            holder = str(new_temp_directory(output_dir / f"{checkpoints.PREFIX}{step}"))
        holder = Path(distributed.all_gather(holder)[0])
        checkpointer = self.trainer.checkpointer
        return checkpointer.state(step, world, sharded=True, shards_at=holder / "state"), holder

    def _resume(self, checkpoint: Path) -> None:
        """Continue from ``checkpoint``: the trainer state, every component's state, and the
        schedule stepped to the checkpoint's step."""
        from transformers import TrainerState

        if self.args.ledger:
            raise ValueError(
                "resume_from_checkpoint: a run with ledger=True resumes through its ledger "
                "directory (rlvr-fast train --resume), not from checkpoint-N"
            )
        saved = TrainerState.load_from_json(str(checkpoint / checkpoints.TRAINER_STATE))
        if is_trl_checkpoint(checkpoint):
            # TRL's files: its weights, optimizer, schedule and RNG (trl_checkpoint).
            resume_from_trl_checkpoint(self, checkpoint)
        else:
            self._resume_rlvr_fast(checkpoint, saved.global_step)
        for name in ("global_step", "epoch", "log_history", "num_input_tokens_seen", "total_flos"):
            setattr(self.state, name, getattr(saved, name))

    def _resume_rlvr_fast(self, checkpoint: Path, trainer_step: int) -> None:
        """A checkpoint of ours: its files checked against its manifest, every component's
        state loaded, the schedule stepped to its step."""
        checkpoints.check_manifest(checkpoint)
        # Those of them in this output_dir are the run's to rotate (a checkpoint given from
        # elsewhere brings none).
        if checkpoint.parent.resolve() == Path(self.args.output_dir).resolve():
            self._checkpoints_written = checkpoints.checkpoints_written(checkpoint)
        step = self.trainer.load_checkpoint(checkpoint / checkpoints.STATE_FILE)
        if step != trainer_step:
            raise ValueError(
                f"{checkpoint}: state of step {step}, trainer state of step {trainer_step}"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):
                self.lr_scheduler.step()

    # ------------------------------------------------------------------ the Trainer surface
    def log(self, logs: dict, start_time: float | None = None) -> None:
        """transformers' ``Trainer.log``: epoch and step added, appended to log_history, handed
        to the callbacks (which print and report it); the completions table after it."""
        logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)
        if self.completions_log is not None and distributed.is_main():
            self.completions_log.flush(self.state.global_step)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Evaluate every eval dataset (``rlvr_fast.trl_compat.evaluation``), log and return the
        metrics (a dict of eval datasets adds their names to the prefix, as transformers)."""
        if eval_dataset is not None:
            rows = eval_datasets(eval_dataset, self.args.remove_unused_columns)
            tasks = {k: (self._task(v, self.task.gate_min_chars), len(v)) for k, v in rows.items()}
        else:
            tasks = self.eval_tasks
        if not tasks:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        metrics = {}
        for name, (task, rows) in tasks.items():
            prefix = metric_key_prefix if name == "" else f"{metric_key_prefix}_{name}"
            metrics.update(evaluate_dataset(self, task, rows, prefix, self.state.global_step))
        self.log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(
            self.args, self.state, self.control, metrics=metrics
        )
        return metrics

    def is_world_process_zero(self) -> bool:
        return distributed.is_main()

    def is_local_process_zero(self) -> bool:
        return distributed.is_main()

    def log_metrics(self, split: str, metrics: dict) -> None:
        from transformers.trainer_pt_utils import log_metrics

        log_metrics(self, split, metrics)

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        from transformers.trainer_pt_utils import save_metrics

        save_metrics(self, split, metrics, combined)

    def save_state(self) -> None:
        from transformers.trainer_pt_utils import save_state

        save_state(self)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **kwargs) -> None:
        """A README.md model card in output_dir (``rlvr_fast.trl_compat.run_files``), as TRL
        writes at every checkpoint."""
        if not distributed.is_main():
            return
        path = Path(self.args.output_dir) / "README.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(model_card(self, model_name, dataset_name, tags), encoding="utf-8")

    def push_to_hub(self, *args, **kwargs):
        raise RuntimeError(
            "push_to_hub: rlvr_fast never contacts the Hub; save_model(DIR) writes a Hugging "
            "Face directory to upload with huggingface_hub"
        )

    def end(self) -> None:
        """TRL's ``trainer.end()``: finish the trackers and destroy the process group."""
        self.accelerator.end_training()
