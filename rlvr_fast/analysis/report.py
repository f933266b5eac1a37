"""``rlvr-fast report``: the study's figures as PNG files (matplotlib, Agg) and a ``report.md``
that shows them beside the ``compare`` tables and each run's ``verify`` result.

Figures (one file each):
- ``base_lengths_NAME.png`` for every before-training eval NAME: the PASS 1 picture, response
  lengths of the base model split into short answers (``\\boxed`` within the first 30 characters,
  or no box) and derivations, each mode's share and accuracy in the legend (seed §3.1);
- ``accuracy.png`` (runs with evaluations): accuracy per arm and eval set, bars at the mean over
  seeds, two-level bootstrap 95% CI bars, one dot per seed;
- ``training_over_steps.png``: the ledger's training curves (reward, accuracy of the training
  groups, loss, grad norm, tokens and seconds per phase; ``rlvr_fast.analysis.training_figures``);
- ``eval_over_steps.png`` (runs evaluated during training, ``--eval-every``): accuracy per eval
  set at each evaluation;
- ``reward_over_steps.png``: per-step group reward mean and sigma_R, mean over seeds;
- ``length_over_steps.png``: rollout length and short-answer fraction per step;
- ``compute.png``: tokens and FLOPs per arm, stacked by phase (prefill, generation, backward)
  with padding and untrimmed decode on top;
- ``tree_pairs.png``: pair categories per arm (only when a tree arm is among the runs).
Over-step curves are 5-step moving averages of the mean over seeds, the raw means faint behind.
Everything is drawn in a private staging folder and moved into ``--out`` only once all of it was
drawn, so bad input leaves nothing behind; ``report.md`` is moved last.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from rlvr_fast.analysis.compare import BASE_LABEL, Comparison, compare_runs
from rlvr_fast.run.reader import Run, RunDirError, load_runs, question_lines
from rlvr_fast.analysis.tables import markdown
from rlvr_fast.analysis.training_figures import evaluation_figure, training_figure
from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.grading import passes_gate
from rlvr_fast.rollouts.pairs import PairCategory
from rlvr_fast.analysis.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, two_level_bootstrap_ci
from rlvr_fast.utils.files import (
    UnreadableFileError,
    atomic_path,
    is_temp_name,
    open_regular,
    write_text_atomic,
)
from rlvr_fast.utils.locks import LOCK_NAME, DirectoryLockedError, lock_directory

SMOOTHING_STEPS = 5
DPI = 120
REPORT_TITLE = "# rlvr_fast report"
GATE_CHARS = 30
LINE_STYLES = ("-", "--", ":", "-.")
PAIR_CATEGORY_ORDER = [category.value for category in PairCategory]
PHASE_COLOURS = {
    "prefill": "#4c72b0",
    "generation": "#55a868",
    "backward": "#c44e52",
    "padding": "#cccccc",
}


def write_report(
    paths: list[Path],
    out: Path,
    *,
    reference: str | None = None,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> list[Path]:
    """Read and compare the runs, draw every figure, then publish them and report.md into
    ``out``; returns the files written."""
    runs = load_runs(paths)
    comparison = compare_runs(runs, reference=reference, resamples=resamples, seed=seed)
    return publish_report(runs, comparison, out, resamples=resamples, seed=seed)


def publish_report(
    runs: list[Run],
    comparison: Comparison,
    out: Path,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> list[Path]:
    """The figures and report.md of runs already compared, into ``out`` (see
    ``open_report_directory``)."""
    verifications = [verify_run(run.path) for run in runs]
    open_report_directory(out)
    figures = draw_figures(runs, comparison, out, resamples, seed)
    write_text_atomic(out / "report.md", report_markdown(runs, comparison, figures, verifications))
    return [out / name for name, _ in figures] + [out / "report.md"]


class ReportError(ValueError):
    """An output directory the report may not write into."""


def open_report_directory(out: Path) -> None:
    """Make ``out`` (or take an empty one, or one that holds a report of ours: report.md with
    our title, PNG figures, our lock and temp files) and hold its lock; anything else is
    refused, since the report replaces report.md and the figures' names there."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out}: exists and is not a directory")
    if out.is_dir() and not holds_only_a_report(out):
        raise ReportError(
            f"{out}: not empty and not a report directory (no report.md of rlvr_fast's, or "
            "files a report does not write); choose a new or empty --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    try:
        lock_directory(out)
    except DirectoryLockedError as err:
        raise ReportError(str(err)) from None


def holds_only_a_report(out: Path) -> bool:
    names = [entry.name for entry in out.iterdir()]
    if set(names) <= {LOCK_NAME}:
        return True
    if "report.md" not in names or (out / "report.md").is_symlink():
        return False
    try:
        with open_regular(out / "report.md", 64 << 20, "report") as file:
            if file.readline().rstrip(b"\n") != REPORT_TITLE.encode():
                return False
    except UnreadableFileError:
        return False
    return all(
        name in ("report.md", LOCK_NAME) or name.endswith(".png") or is_temp_name(name)
        for name in names
    )


def draw_figures(
    runs: list[Run], comparison: Comparison, directory: Path, resamples: int, seed: int
) -> list[tuple[str, str]]:
    """(file name, caption) of every figure drawn into ``directory``."""
    by_arm: dict[str, list[Run]] = {}
    for run in runs:
        by_arm.setdefault(run.arm, []).append(run)
    figures = []
    first_before = next((run for run in runs if run.eval_files(before=True)), None)
    if first_before is not None:
        for name, items in first_before.evals(before=True).items():
            figures.append(
                save(
                    base_lengths_figure(name, items, first_before.config),
                    directory,
                    f"base_lengths_{name}.png",
                    f"Base model on {name} before training: response lengths by mode",
                )
            )
    if comparison.eval_sets:
        figures.append(
            save(
                accuracy_figure(comparison, resamples, seed),
                directory,
                "accuracy.png",
                "Accuracy per arm after training (mean over seeds, two-level 95% CI)",
            )
        )
    figures.append(
        save(
            training_figure(by_arm),
            directory,
            "training_over_steps.png",
            "Training curves from the ledger: reward, accuracy, loss, grad norm, tokens, seconds",
        )
    )
    evaluations = evaluation_figure(by_arm)
    if evaluations is not None:
        figures.append(
            save(
                evaluations,
                directory,
                "eval_over_steps.png",
                "Held-out accuracy at each evaluation during training (--eval-every)",
            )
        )
    figures.append(
        save(
            reward_figure(by_arm),
            directory,
            "reward_over_steps.png",
            "Group reward mean and sigma_R per training step",
        )
    )
    figures.append(
        save(
            length_figure(by_arm),
            directory,
            "length_over_steps.png",
            "Rollout length and short-answer fraction per training step",
        )
    )
    figures.append(
        save(
            compute_figure(comparison),
            directory,
            "compute.png",
            "Training tokens and FLOPs per arm, by phase",
        )
    )
    categories = pair_categories(by_arm)
    if any(name != PairCategory.FLAT for counts in categories.values() for name in counts):
        figures.append(
            save(
                tree_pairs_figure(categories),
                directory,
                "tree_pairs.png",
                "Tree pair categories per arm (mean pairs per run)",
            )
        )
    return figures


def save(figure: Figure, directory: Path, name: str, caption: str) -> tuple[str, str]:
    """Figures are drawn through matplotlib's object API: no pyplot state, and savefig renders
    with the Agg canvas whatever backend the environment asks for."""
    with atomic_path(directory / name) as temp:
        figure.savefig(temp, dpi=DPI, format="png")
    return name, caption


# ------------------------------------------------------------------ figures


def base_lengths_figure(name: str, items: list[dict], config: dict) -> Figure:
    """Histogram of response lengths (tokens) split by the 30-character derivation gate."""
    figure = Figure(figsize=(8.5, 4.5), layout="tight")
    axes = figure.subplots()
    lengths = np.array([item["length"] for item in items])
    derivation = np.array([bool(item["derivation"]) for item in items])
    correct = np.array([bool(item["correct"]) for item in items])
    bins = np.histogram_bin_edges(lengths, bins=min(40, max(5, len(set(lengths.tolist())))))
    for mask, label, colour in (
        (
            ~derivation,
            f"short answers (< {GATE_CHARS} chars before "
            r"\boxed, or no box)",
            "#dd8452",
        ),
        (derivation, "derivations", "#4c72b0"),
    ):
        share = mask.mean()
        accuracy = correct[mask].mean() if mask.any() else float("nan")
        axes.hist(
            lengths[mask],
            bins=bins,
            alpha=0.75,
            color=colour,
            label=f"{label}: {share:.1%} of responses, {accuracy:.1%} correct",
        )
    axes.set_title(
        f"Base model on {name} before training: {correct.mean():.1%} correct\n"
        f"({len(items)} items, greedy, {config.get('eval_max_new_tokens')}-token cap)"
    )
    axes.set_xlabel("response length (tokens)")
    axes.set_ylabel("responses")
    axes.legend(fontsize=8)
    return figure


def accuracy_figure(comparison: Comparison, resamples: int, seed: int) -> Figure:
    names = list(comparison.eval_sets)
    figure = Figure(
        figsize=(max(6, 1.2 * len(comparison.arms) + 3) * len(names), 4.5), layout="tight"
    )
    axes_row = figure.subplots(1, len(names), squeeze=False)
    for axes, name in zip(axes_row[0], names):
        shown = [arm for arm in comparison.rows if name in arm.grades]
        for x, arm in enumerate(shown):
            matrix = np.stack([arm.grades[name][s].correct for s in arm.seeds])
            mean = 100 * matrix.mean(axis=1).mean()
            low, high = (
                100 * v for v in two_level_bootstrap_ci(matrix, resamples=resamples, seed=seed)
            )
            colour = "#999999" if arm.arm == BASE_LABEL else f"C{x % 10}"
            axes.bar(x, mean, color=colour, alpha=0.8)
            axes.errorbar(
                x,
                mean,
                yerr=[[max(0.0, mean - low)], [max(0.0, high - mean)]],
                color="black",
                capsize=5,
            )
            axes.scatter(
                [x] * len(arm.seeds), 100 * matrix.mean(axis=1), color="black", s=12, zorder=3
            )
            axes.annotate(
                f"{mean:.1f}%",
                (x, high),
                textcoords="offset points",
                xytext=(0, 4),
                ha="center",
                fontsize=8,
            )
        axes.set_xticks(range(len(shown)), [arm.arm for arm in shown], fontsize=8, rotation=15)
        axes.set_ylabel("accuracy (%)")
        axes.set_ylim(0, 100)
        axes.set_title(
            f"{name} ({comparison.eval_sets[name]} items): mean over seeds,\n"
            f"95% CI (seeds x items bootstrap), dots = seeds",
            fontsize=10,
        )
    return figure


def reward_figure(by_arm: dict[str, list[Run]]) -> Figure:
    figure = Figure(figsize=(11, 4), layout="tight")
    mean_axes, sigma_axes = figure.subplots(1, 2)
    for index, (arm, runs) in enumerate(by_arm.items()):
        # A multi-question step shows the mean over its questions' groups.
        rewards = per_step(
            runs,
            lambda line: float(np.mean([r for q in question_lines(line) for r in q["rewards"]])),
        )
        sigmas = per_step(
            runs, lambda line: float(np.mean([q["sigma_r"] for q in question_lines(line)]))
        )
        plot_over_steps(mean_axes, rewards, arm, index)
        plot_over_steps(sigma_axes, sigmas, arm, index)
    mean_axes.set(
        title="Group reward mean per step",
        xlabel="training step",
        ylabel="mean reward (fraction correct)",
        ylim=(-0.02, 1.02),
    )
    sigma_axes.set(
        title="Group reward std σ_R per step",
        xlabel="training step",
        ylabel="σ_R (0 = homogeneous group)",
        ylim=(-0.02, 0.6),
    )
    mean_axes.legend(fontsize=8)
    return figure


def length_figure(by_arm: dict[str, list[Run]]) -> Figure:
    figure = Figure(figsize=(11, 4), layout="tight")
    length_axes, short_axes = figure.subplots(1, 2)
    for index, (arm, runs) in enumerate(by_arm.items()):
        lengths = per_step(
            runs,
            lambda line: float(np.mean([n for q in question_lines(line) for n in q["lengths"]])),
            rollouts=True,
        )
        short = per_step(
            runs,
            lambda line: float(
                np.mean(
                    [
                        not passes_gate(text, GATE_CHARS)
                        for q in question_lines(line)
                        for text in q["texts"]
                    ]
                )
            ),
            rollouts=True,
        )
        plot_over_steps(length_axes, lengths, arm, index)
        plot_over_steps(short_axes, 100 * short, arm, index)
    length_axes.set(
        title="Mean rollout length per step", xlabel="training step", ylabel="tokens per rollout"
    )
    short_axes.set(
        title=f"Short answers (< {GATE_CHARS} chars before \\boxed, or no box)",
        xlabel="training step",
        ylabel="rollouts (%)",
        ylim=(-2, 102),
    )
    length_axes.legend(fontsize=8)
    return figure


def per_step(runs: list[Run], value, rollouts: bool = False) -> np.ndarray:
    """[steps] mean over the runs of value(line), over the steps every run has."""
    lines = [run.rollouts if rollouts else run.ledger for run in runs]
    steps = min(len(run_lines) for run_lines in lines)
    if steps == 0:
        raise RunDirError(f"{runs[0].path}: no steps recorded")
    try:
        return np.mean([[value(line) for line in run_lines[:steps]] for run_lines in lines], axis=0)
    except (KeyError, TypeError) as err:
        raise RunDirError(f"{runs[0].arm}: unreadable step line ({err})") from None


def plot_over_steps(axes, values: np.ndarray, label: str, index: int) -> None:
    """Raw per-step values faint, their moving average bold; arms differ in colour and dash so
    arms whose curves coincide stay visible."""
    colour, dash = f"C{index % 10}", LINE_STYLES[index % len(LINE_STYLES)]
    steps = np.arange(len(values))
    axes.plot(steps, values, color=colour, alpha=0.25, linewidth=1)
    window = min(SMOOTHING_STEPS, len(values))
    smoothed = np.convolve(values, np.ones(window) / window, mode="valid")
    axes.plot(
        steps[window - 1 :],
        smoothed,
        color=colour,
        linestyle=dash,
        linewidth=2,
        label=f"{label} ({window}-step mean)",
    )


def compute_figure(comparison: Comparison) -> Figure:
    """Stacked per arm: prefill, generation and backward tokens, and the Full FLOPs they cost
    (2 P per forward token, 6 P per backward token), with what PadFull adds (padded prefill and
    untrimmed decode) on top."""
    arms = comparison.arms
    figure = Figure(figsize=(max(10, 2.2 * len(arms) + 4), 4.5), layout="tight")
    token_axes, flop_axes = figure.subplots(1, 2)
    x = np.arange(len(arms))
    tokens = {
        phase: np.array([arm.mean_total(key) for arm in arms])
        for phase, key in (("prefill", "pref"), ("generation", "gen"), ("backward", "bwd_full"))
    }
    tokens["padding"] = np.array(
        [
            arm.mean_total("pad_pref")
            + arm.mean_total("untrim_gen")
            - arm.mean_total("pref")
            - arm.mean_total("gen")
            for arm in arms
        ]
    )
    params = np.array([arm.mean_total("params") for arm in arms])
    flops = {
        phase: (6 if phase == "backward" else 2) * count * params for phase, count in tokens.items()
    }
    stack(token_axes, x, {phase: count / 1e3 for phase, count in tokens.items()}, "k")
    stack(flop_axes, x, {phase: count / 1e12 for phase, count in flops.items()}, "TFLOPs")
    token_axes.set(title="Training tokens per run (mean over seeds)", ylabel="tokens (thousands)")
    flop_axes.set(title="Training FLOPs per run (Full, PadFull's extra on top)", ylabel="TFLOPs")
    for axes in (token_axes, flop_axes):
        axes.set_xticks(x, [arm.arm for arm in arms], fontsize=8, rotation=15)
        axes.set_ylim(0, 1.35 * axes.get_ylim()[1])
    token_axes.legend(
        ["prefill (pref)", "generation (gen)", "backward (bwd_full)", "padding + untrimmed decode"],
        fontsize=8,
        ncol=2,
        loc="upper left",
    )
    return figure


def stack(axes, x: np.ndarray, parts: dict[str, np.ndarray], unit: str) -> None:
    bottom = np.zeros(len(x))
    for phase, values in parts.items():
        axes.bar(
            x,
            values,
            bottom=bottom,
            color=PHASE_COLOURS[phase],
            hatch="//" if phase == "padding" else None,
        )
        bottom += values
    for xi, total in zip(x, bottom):
        axes.annotate(
            f"{total:.3g} {unit}",
            (xi, total),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            fontsize=8,
        )


def pair_categories(by_arm: dict[str, list[Run]]) -> dict[str, dict[str, float]]:
    """arm -> category -> mean number of pairs per run."""
    result = {}
    for arm, runs in by_arm.items():
        counts: dict[str, float] = {}
        for run in runs:
            for line in run.ledger:
                for pair in (p for q in question_lines(line) for p in q.get("pairs", [])):
                    counts[pair[6]] = counts.get(pair[6], 0) + 1 / len(runs)
        result[arm] = counts
    return result


def tree_pairs_figure(categories: dict[str, dict[str, float]]) -> Figure:
    seen = {name for counts in categories.values() for name in counts}
    names = [name for name in PAIR_CATEGORY_ORDER if name in seen] + sorted(
        seen - set(PAIR_CATEGORY_ORDER)
    )
    arms = list(categories)
    figure = Figure(figsize=(max(7, 1.6 * len(arms) + 3), 4.5), layout="tight")
    axes = figure.subplots()
    bottom = np.zeros(len(arms))
    for index, name in enumerate(names):
        values = np.array([categories[arm].get(name, 0.0) for arm in arms])
        axes.bar(range(len(arms)), values, bottom=bottom, label=name, color=f"C{index % 10}")
        bottom += values
    axes.set_xticks(range(len(arms)), arms, fontsize=8, rotation=15)
    axes.set(title="Rollout pairs by category (mean per run)", ylabel="pairs per run")
    axes.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    return figure


# ------------------------------------------------------------------ report.md


def report_markdown(
    runs: list[Run], comparison: Comparison, figures: list[tuple[str, str]], verifications
) -> str:
    arms = ", ".join(
        f"{arm.arm} ({len(arm.seeds)} seed{'s' if len(arm.seeds) > 1 else ''})"
        for arm in comparison.arms
    )
    passed = sum(v.ok for v in verifications)
    lines = [
        REPORT_TITLE,
        "",
        f"{len(runs)} runs: {arms}. "
        + (
            "Eval sets: "
            + ", ".join(f"{n} ({k} items)" for n, k in comparison.eval_sets.items())
            + f", greedy at a {comparison.eval_cap}-token cap."
            if comparison.eval_sets
            else "No evaluations saved: the figures and tables are the ledgers'."
        )
        + (
            f" Differences are arm minus {comparison.reference}, paired by seed and item."
            if comparison.reference
            else ""
        ),
        "",
        f"`rlvr-fast verify`: {passed} of {len(verifications)} runs PASS"
        + (
            ""
            if passed == len(verifications)
            else " (FAIL: " + ", ".join(str(v.path) for v in verifications if not v.ok) + ")"
        )
        + ".",
        "",
        "## Tables",
        "",
        markdown(comparison).rstrip(),
        "",
        "Accuracy: mean ± SD over seeds (per-seed values in %). AllCap: responses that hit the "
        "eval cap; IncTrunc: those graded incorrect. Tokens and TFLOPs: ledger totals per run, "
        "mean over seeds; seconds summed over the steps' phases. CIs: 4,000-resample percentile "
        "bootstrap, two-level over seeds then items, and pooled over (seed, item) pairs.",
        "",
        "## Figures",
        "",
    ]
    for name, caption in figures:
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    lines += ["## Runs", ""] + [f"- `{run.path}`: {run.arm}, seed {run.seed}" for run in runs]
    return "\n".join(lines) + "\n"
