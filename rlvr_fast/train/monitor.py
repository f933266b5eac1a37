"""What a run shows and keeps while it trains, none of which changes what it trains (so none of
it is a ``TrainConfig`` setting, nor part of the resume signature; a resume may change any of
it):
- each step's figures (``rlvr_fast.ledger.metrics``) on the progress bar's postfix, and one
  printed line of them every ``log_every`` steps (0, the default: none; the bar already carries
  them in a terminal, and a script's log stays quiet unless asked);
- the same figures, and every evaluation's, as scalars of the ``report_to`` loggers
  (``rlvr_fast.run.loggers``: TensorBoard, W&B);
- an evaluation of the eval sets every ``eval_every`` steps (evals/step-N/, one line of
  eval_steps.jsonl each, a printed line) and a Hugging Face checkpoint every ``save_every``
  steps (checkpoint-N/), the newest ``save_total_limit`` of them kept (``RunRecorder``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from rlvr_fast.ledger.metrics import bar_postfix, log_line, step_metrics
from rlvr_fast.run.loggers import Logger, open_loggers
from rlvr_fast.train import distributed

# An evaluation's figures, as loggers get them (eval/SET/NAME).
EVAL_FIGURES = ("accuracy", "cap_hits", "truncated_incorrect", "short_guess_fraction")


@dataclass(frozen=True)
class Monitoring:
    """How a run reports while it trains (module docstring); 0 turns a cadence off."""

    log_every: int = 0
    report_to: tuple[str, ...] = ()
    eval_every: int = 0
    save_every: int = 0
    save_total_limit: int | None = None

    def __post_init__(self) -> None:
        for name in ("log_every", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                option = "--" + name.replace("_", "-")
                raise ValueError(f"{option} must be >= 0, got {getattr(self, name)}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"--save-total-limit must be >= 1, got {self.save_total_limit}")
        if self.save_total_limit is not None and not self.save_every:
            raise ValueError("--save-total-limit limits the checkpoints of --save-every N: give N")

    def due(self, every: int, steps_run: int) -> bool:
        return bool(every) and steps_run % every == 0


class TrainingMonitor:
    def __init__(self, monitoring: Monitoring, trainer) -> None:
        """The monitoring of ``trainer``'s run (an ``RLVRTrainer``: its evaluator, recorder and
        weights); rank 0 prints."""
        self.monitoring, self.trainer = monitoring, trainer
        self.steps, self.shows = trainer.config.steps, distributed.is_main()
        self.loggers: list[Logger] = []

    def open_loggers(self, root: Path, config: dict, start_step: int) -> None:
        """The --report-to loggers of the run in ``root`` (on the rank that writes it)."""
        self.loggers = open_loggers(self.monitoring.report_to, root, root.name, config, start_step)

    def step_done(self, steps_run: int, record: dict, bar: tqdm) -> dict[str, float]:
        """Show the figures of the step that made ``steps_run`` steps (its ledger ``record``)."""
        metrics = step_metrics(record)
        if not bar.disable:
            bar.set_postfix(bar_postfix(metrics), refresh=False)
        if self.shows and self.monitoring.due(self.monitoring.log_every, steps_run):
            tqdm.write(log_line(steps_run, self.steps, metrics))
        self.log({f"train/{name}": value for name, value in metrics.items()}, steps_run)
        return metrics

    def during_training(self, steps_run: int) -> None:
        """After ``steps_run`` steps: the evaluation of --eval-every and the Hugging Face
        checkpoint of --save-every, when due (every rank takes part: a sharded run gathers the
        weights, a data-parallel one shares the evaluation)."""
        trainer, monitoring = self.trainer, self.monitoring
        evaluating = trainer.eval_data and steps_run < self.steps
        if evaluating and monitoring.due(monitoring.eval_every, steps_run):
            summaries = trainer.evaluator.run(f"step-{steps_run}")
            self.evaluated(steps_run, summaries, printed=True)
        if trainer.layout is not None and monitoring.due(monitoring.save_every, steps_run):
            weights = trainer.saved_weights()
            if trainer.recorder is not None:
                trainer.recorder.save_hf_checkpoint(
                    trainer.policy, steps_run, weights, keep=monitoring.save_total_limit
                )

    def evaluated(self, steps_run: int, summaries: dict[str, dict], *, printed=False) -> None:
        """An evaluation after ``steps_run`` steps: to the loggers, to eval_steps.jsonl (with
        --eval-every) and, when ``printed`` (an evaluation during training; the run's summary
        prints the others), one line."""
        if self.trainer.recorder is not None and self.monitoring.eval_every:
            self.trainer.recorder.write_eval_steps(steps_run, summaries)
        values = {
            f"eval/{name}/{figure}": float(summary[figure])
            for name, summary in summaries.items()
            for figure in EVAL_FIGURES
            if figure in summary
        }
        self.log(values, steps_run)
        if printed and self.shows:
            results = ", ".join(
                f"{name} accuracy {summary['accuracy']:.1%}" for name, summary in summaries.items()
            )
            tqdm.write(f"step {steps_run}/{self.steps}: {results}")

    def log(self, values: dict[str, float], steps_run: int) -> None:
        for logger in self.loggers:
            logger.scalars(values, steps_run)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []
