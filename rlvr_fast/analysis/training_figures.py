"""``rlvr-fast report``'s training curves, read from the ledgers alone (any run has them,
evaluated or not): ``training_over_steps.png``, six panels over the training steps, each arm the
mean over its seeds of the figures of ``rlvr_fast.ledger.metrics``:
- the training groups' reward mean and accuracy (the fraction of completions rewarded 1);
- the loss and the gradient norm (steps without a backward pass have none: gaps, and the moving
  average over the steps that have one);
- tokens per step, generated (gen) and trained on (bwd_full), and seconds per step by phase.
Curves are moving averages (``SMOOTHING_STEPS``) with the raw values faint behind, as the
report's other over-step figures. Runs evaluated during training (``--eval-every``) add
``eval_over_steps.png``: each eval set's accuracy at every evaluation (before training at step
0, during, after), each arm the mean over its seeds that have it."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rlvr_fast.ledger.metrics import step_metrics
from rlvr_fast.run.reader import Run, RunDirError

SMOOTHING_STEPS = 5
LINE_STYLES = ("-", "--", ":", "-.")
# Seconds per phase: one colour per phase (the arms differ in dash).
PHASE_COLOURS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd", "#937860")
PHASE_NAMES = {"reward": "grading (reward)"}


def training_figure(by_arm: dict[str, list[Run]]) -> Figure:
    figure = Figure(figsize=(14, 7.5), layout="constrained")
    panels = figure.subplots(2, 3)
    (reward, accuracy, loss), (grad_norm, tokens, seconds) = panels
    phases: list[str] = []
    for index, (arm, runs) in enumerate(by_arm.items()):
        metrics = run_metrics(runs)
        colour, dash = f"C{index % 10}", LINE_STYLES[index % len(LINE_STYLES)]
        for axes, name in ((reward, "reward"), (accuracy, "accuracy")):
            plot_curve(axes, mean_over_seeds(metrics, name), colour, dash, arm)
        for axes, name in ((loss, "loss"), (grad_norm, "grad_norm")):
            plot_curve(axes, mean_over_seeds(metrics, name), colour, dash, arm)
        plot_curve(tokens, mean_over_seeds(metrics, "tokens/gen"), colour, "-", f"{arm}: gen")
        plot_curve(
            tokens, mean_over_seeds(metrics, "tokens/bwd_full"), colour, ":", f"{arm}: bwd_full"
        )
        for phase in dict.fromkeys(k for m in metrics[0] for k in m if k.startswith("seconds/")):
            name = phase.removeprefix("seconds/")
            if name not in phases:
                phases.append(name)
            phase_colour = PHASE_COLOURS[phases.index(name) % len(PHASE_COLOURS)]
            label = PHASE_NAMES.get(name, name) + (f" ({arm})" if len(by_arm) > 1 else "")
            plot_curve(seconds, mean_over_seeds(metrics, phase), phase_colour, dash, label)
    reward.set(title="Training groups: reward mean", ylabel="mean reward", ylim=(-0.02, 1.02))
    accuracy.set(
        title="Training groups: accuracy",
        ylabel="completions rewarded 1 (fraction)",
        ylim=(-0.02, 1.02),
    )
    loss.set(title="Loss (steps with a backward pass)", ylabel="loss")
    grad_norm.set(title="Gradient norm before clipping", ylabel="grad norm")
    tokens.set(title="Tokens per step", ylabel="tokens")
    seconds.set(title="Seconds per step, by phase", ylabel="seconds")
    for axes in panels.flat:
        axes.set_xlabel("training step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
    for axes in (reward, tokens, seconds):
        axes.legend(fontsize=8)
    return figure


def run_metrics(runs: list[Run]) -> list[list[dict[str, float]]]:
    """Each run's figures per step, over the steps every run of the arm has."""
    try:
        per_run = [[step_metrics(line) for line in run.ledger] for run in runs]
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        raise RunDirError(f"{runs[0].path / 'ledger.jsonl'}: unreadable line ({err})") from None
    steps = min(len(metrics) for metrics in per_run)
    if steps == 0:
        raise RunDirError(f"{runs[0].path}: no steps recorded")
    return [metrics[:steps] for metrics in per_run]


def mean_over_seeds(metrics: list[list[dict[str, float]]], name: str) -> np.ndarray:
    """[steps] the mean over the runs of figure ``name`` (NaN where no run has it)."""
    values = np.array([[m.get(name, np.nan) for m in run] for run in metrics], dtype=np.float64)
    counts = (~np.isnan(values)).sum(axis=0)
    sums = np.nansum(values, axis=0)
    return np.divide(sums, counts, out=np.full(values.shape[1], np.nan), where=counts > 0)


def plot_curve(axes, values: np.ndarray, colour: str, dash: str, label: str) -> None:
    """The raw values faint (points where the steps with a value are apart) and their moving
    average over the steps that have one, bold."""
    steps = np.arange(1, len(values) + 1)
    present = ~np.isnan(values)
    if not present.any():
        return
    axes.plot(steps, values, color=colour, alpha=0.25, linewidth=1, marker=".", markersize=3)
    window = min(SMOOTHING_STEPS, int(present.sum()))
    kernel = np.ones(window)
    sums = np.convolve(np.where(present, values, 0.0), kernel, mode="full")[: len(values)]
    counts = np.convolve(present.astype(np.float64), kernel, mode="full")[: len(values)]
    smoothed = np.divide(sums, counts, out=np.full(len(values), np.nan), where=counts > 0)
    smoothed[: window - 1] = np.nan
    axes.plot(steps, smoothed, color=colour, linestyle=dash, linewidth=2, label=label)


def evaluation_figure(by_arm: dict[str, list[Run]]) -> Figure | None:
    """Accuracy per eval set over the steps evaluated (None: no run has eval_steps.jsonl)."""
    curves: dict[str, dict[str, dict[int, list[float]]]] = {}  # set -> arm -> step -> values
    for arm, runs in by_arm.items():
        for run in runs:
            for line in run.eval_steps:
                for name, summary in line["sets"].items():
                    points = curves.setdefault(name, {}).setdefault(arm, {})
                    points.setdefault(line["step"], []).append(100 * summary["accuracy"])
    if not curves:
        return None
    figure = Figure(figsize=(6 * len(curves), 4.5), layout="constrained")
    for axes, (name, arms) in zip(
        figure.subplots(1, len(curves), squeeze=False)[0], curves.items()
    ):
        for index, arm in enumerate(by_arm):
            points = arms.get(arm)
            if not points:
                continue
            steps = sorted(points)
            means = [sum(points[s]) / len(points[s]) for s in steps]
            axes.plot(
                steps,
                means,
                color=f"C{index % 10}",
                linestyle=LINE_STYLES[index % len(LINE_STYLES)],
                marker="o",
                label=arm,
            )
        axes.set(
            title=f"{name}: accuracy during training",
            xlabel="training step",
            ylabel="accuracy (%)",
            ylim=(0, 100),
        )
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    return figure
