"""The falsifier diagnostic of the Parallel-Shapley review: ``rlvr-fast shapley-report RUN_DIR``.

Reads a parallel-path run's ``rollouts.jsonl`` and ``config.json``. For the sampled steps (all,
or ``max_steps`` drawn with ``seed``), for every response and path j:

    delta_j = r_out(all K paths) - r_out(the K - 1 paths without j)

the drop in the outcome reward when path j is masked and the response re-aggregated: re-voted
(vote aggregator: ``MajorityVote`` on the stored answers and grades), or the summary regenerated
from the K - 1 paths by the run's final policy with the run's sampling settings and the
response's summary seed (r_out(all) is regenerated the same way, so both sides come from one
policy and one sampling stream). delta_j is the review's Delta r_out,j with the sign flipped, so
that a phi which tracks contribution correlates *positively* with it.

Reported (``report.json``, ``report.md``, ``scatter.png`` in ``RUN_DIR/shapley_report``):

- Spearman(phi_j, delta_j) over every (response, path), with a 95% percentile bootstrap CI that
  resamples responses (their K paths together) with replacement (``resamples``, 4,000);
- mean |sum_j phi_j - r_out| (the reviewers' mismatch: Shapley values add up to U(P) - U(∅),
  not to r_out), mean |sum_j phi_j - (U(P) - U(∅))| (0 for Shapley, not for LOO or
  independent), mean |U(P) - r_out| and Pearson(U(P), r_out);
- the Monte-Carlo standard error of phi at the run's M (at M = 5, the paper's, for runs that
  computed phi exactly): the standard deviation of the M-ordering estimate around the exact phi
  over ``mc_repeats`` draws, from each response's stored utility table (or its outcome utility
  rebuilt from the stored answers), averaged over paths; runs with Monte-Carlo credit also
  report the mean standard error their ledger recorded.

The bootstrap CI is a local function (a shared statistics module may replace it).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlvr_fast.run.layout import RunLayout
from rlvr_fast.run.reader import RunDirError, read_json, read_jsonl
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.utils.files import atomic_path, write_json_atomic, write_text_atomic
from rlvr_fast.grading import final_answer, grade_many
from rlvr_fast.rollouts.parallel import summarise, summary_context
from rlvr_fast.credit.paths import outcome_utility
from rlvr_fast.models.policy import load_policy
from rlvr_fast.credit.shapley import MajorityVote, TableUtility, shapley_exact, shapley_monte_carlo

PAPER_PERMUTATIONS = 5


@dataclass
class ResponsePoints:
    """One response of one step: per path phi and delta; its r_out, U(P) and U(∅)."""

    step: int
    phi: list[float]
    delta: list[float]
    r_out: float
    utility_full: float
    utility_empty: float


def load_parallel_steps(run_dir: Path) -> tuple[dict, list[dict]]:
    """The run's config and its parallel-path rollout lines."""
    config_path, rollouts_path = RunLayout(run_dir).config, RunLayout(run_dir).rollouts
    for path in (config_path, rollouts_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (is {run_dir} a run directory?)")
    meta = read_json(config_path)
    config = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config, dict):
        raise RunDirError(f"{config_path}: no 'config' object")
    lines = read_jsonl(rollouts_path)
    # A step of several questions lists each question's line (with its step) under "questions".
    steps = [q for line in lines for q in line.get("questions", [line]) if "parallel" in q]
    if not steps:
        raise ValueError(f"{rollouts_path}: no parallel-path steps (arm {config.get('arm')!r})")
    return config, steps


def vote_deltas(answers: list, correct: list[bool]) -> list[float]:
    """r_out(all) - r_out(without j) of a vote-aggregated response, per path j."""
    vote = MajorityVote(answers, correct)
    everyone = (1 << len(answers)) - 1
    return [vote.value(everyone) - vote.value(everyone & ~(1 << j)) for j in range(len(answers))]


def response_points(step: dict, deltas: list[list[float]]) -> list[ResponsePoints]:
    details = step["parallel"]
    k = details["paths_per_response"]
    return [
        ResponsePoints(
            step["step"],
            details["phi"][r * k : (r + 1) * k],
            deltas[r],
            details["r_out"][r],
            details["utility_full"][r],
            details["utility_empty"][r],
        )
        for r in range(len(deltas))
    ]


def step_vote_deltas(step: dict) -> list[list[float]]:
    details = step["parallel"]
    k = details["paths_per_response"]
    answers, correct = details["path_answers"], details["path_correct"]
    return [
        vote_deltas(answers[r * k : (r + 1) * k], correct[r * k : (r + 1) * k])
        for r in range(len(answers) // k)
    ]


class SummaryRegenerator:
    """Regenerates a step's summaries from all K paths and from each K - 1, with the run's final
    policy and sampling settings, and each response's summary seed."""

    def __init__(self, run_dir: Path, config: dict, device: str) -> None:
        model_dir = RunLayout(run_dir).model()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{model_dir}: no final model (the summary diagnostic "
                f"regenerates summaries with it)"
            )
        self.policy = load_policy(model_dir, device=device)
        self.engine = RolloutEngine.for_policy(self.policy)
        self.params = SamplingParams(
            config["max_new_tokens"], config["temperature"], config["top_p"]
        )

    def deltas(self, step: dict) -> list[list[float]]:
        details, tokenizer = step["parallel"], self.policy.tokenizer
        k = details["paths_per_response"]
        prompt = tokenizer.encode(render_prompt(details["question"]))
        out = []
        for r, seed in enumerate(details["summary_seeds"]):
            paths = details["path_ids"][r * k : (r + 1) * k]
            variants = [paths] + [paths[:j] + paths[j + 1 :] for j in range(k)]
            contexts = [
                summary_context(v, tokenizer.encode, tokenizer.eos_token_ids) for v in variants
            ]
            source = self.engine.add(prompt)
            try:
                seqs = summarise(self.engine, source, contexts, [seed] * len(contexts), self.params)
            finally:
                self.engine.free(source)
            texts = tokenizer.decode_batch([seq.completion for seq in seqs])
            grades = grade_many([final_answer(t) for t in texts], [details["gold"]] * len(texts))
            out.append([float(grades[0]) - float(g) for g in grades[1:]])
        return out


def rankdata(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their average rank."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    sorted_values = values[order]
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_values[end] != sorted_values[start]:
            ranks[order[start:end]] = (start + end + 1) / 2
            start = end
    return ranks


def spearman(x, y) -> float:
    """Spearman's rank correlation; NaN when either side is constant."""
    rx, ry = rankdata(np.asarray(x, dtype=float)), rankdata(np.asarray(y, dtype=float))
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def bootstrap_spearman(
    responses: list[ResponsePoints], resamples: int, seed: int
) -> tuple[float, float]:
    """95% percentile CI of Spearman(phi, delta), resampling responses with replacement;
    resamples where a side is constant are left out (NaN when all are)."""
    rng = np.random.default_rng(seed)
    phi = [np.asarray(r.phi) for r in responses]
    delta = [np.asarray(r.delta) for r in responses]
    values = []
    for _ in range(resamples):
        pick = rng.integers(0, len(responses), len(responses))
        value = spearman(
            np.concatenate([phi[i] for i in pick]), np.concatenate([delta[i] for i in pick])
        )
        if not math.isnan(value):
            values.append(value)
    if not values:
        return math.nan, math.nan
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


def mc_standard_error(
    step: dict,
    config: dict,
    permutations: int,
    antithetic: bool,
    repeats: int,
    generator: torch.Generator,
) -> list[float]:
    """Per path of the step: the standard deviation of the ``permutations``-ordering estimate
    around the exact phi over ``repeats`` draws (module docstring); empty when the step's
    utility can be neither replayed from a stored table nor rebuilt from its answers."""
    details = step["parallel"]
    k = details["paths_per_response"]
    tables = details.get("utility_tables") or [None] * (len(details["path_answers"]) // k)
    errors = []
    for r, table in enumerate(tables):
        if table is not None:
            utility = TableUtility(table)
        elif config["path_utility"] != "judge":
            part = slice(r * k, (r + 1) * k)
            utility = outcome_utility(
                config["path_utility"], details["path_answers"][part], details["path_correct"][part]
            )
        else:
            return []
        exact = shapley_exact(utility, k).phi
        draws = np.stack(
            [
                shapley_monte_carlo(
                    utility,
                    k,
                    permutations=permutations,
                    generator=generator,
                    antithetic=antithetic,
                ).phi
                for _ in range(repeats)
            ]
        )
        errors += np.sqrt(((draws - exact) ** 2).mean(axis=0)).tolist()
    return errors


def build_report(
    run_dir: Path,
    *,
    max_steps: int | None = None,
    seed: int = 0,
    resamples: int = 4000,
    mc_repeats: int = 200,
    device: str = "cpu",
) -> tuple[dict, list[ResponsePoints]]:
    config, steps = load_parallel_steps(run_dir)
    if max_steps is not None and max_steps < len(steps):
        steps = sorted(random.Random(seed).sample(steps, max_steps), key=lambda s: s["step"])
    regenerator = (
        SummaryRegenerator(run_dir, config, device) if config["aggregator"] == "summary" else None
    )
    responses = []
    for step in steps:
        deltas = regenerator.deltas(step) if regenerator else step_vote_deltas(step)
        responses += response_points(step, deltas)
    phi = [x for r in responses for x in r.phi]
    delta = [x for r in responses for x in r.delta]
    sums = [sum(r.phi) for r in responses]
    full = np.array([r.utility_full for r in responses])
    r_out = np.array([r.r_out for r in responses])
    exact = config["shapley_permutations"] == 0 or config["path_credit"] != "shapley"
    permutations = PAPER_PERMUTATIONS if exact else config["shapley_permutations"]
    antithetic = not exact and config["shapley_antithetic"]
    generator = torch.Generator().manual_seed(seed)
    mc_errors = [
        e
        for step in steps
        for e in mc_standard_error(step, config, permutations, antithetic, mc_repeats, generator)
    ]
    low, high = bootstrap_spearman(responses, resamples, seed)
    report = {
        "run": str(run_dir),
        "arm": config["arm"],
        "aggregator": config["aggregator"],
        "path_utility": config["path_utility"],
        "path_credit": config["path_credit"],
        "paths_per_response": config["num_paths"],
        "steps": len(steps),
        "responses": len(responses),
        "paths": len(phi),
        "spearman_phi_delta": spearman(phi, delta),
        "spearman_ci95": [None if math.isnan(low) else low, None if math.isnan(high) else high],
        "bootstrap_resamples": resamples,
        "mean_abs_sum_phi_minus_r_out": float(np.mean(np.abs(np.array(sums) - r_out))),
        "mean_abs_sum_phi_minus_utility": float(
            np.mean(
                np.abs(np.array(sums) - (full - np.array([r.utility_empty for r in responses])))
            )
        ),
        "mean_abs_utility_minus_r_out": float(np.mean(np.abs(full - r_out))),
        "pearson_utility_r_out": (
            float(np.corrcoef(full, r_out)[0, 1])
            if full.std() > 0 and r_out.std() > 0
            else math.nan
        ),
        "mean_r_out": float(r_out.mean()),
        "mean_utility_full": float(full.mean()),
        "mc_permutations": permutations,
        "mc_antithetic": antithetic,
        "mc_standard_error": float(np.mean(mc_errors)) if mc_errors else math.nan,
        "mc_repeats": mc_repeats,
        "ledger_mean_phi_se": (
            float(np.mean([x for s in steps for x in s["parallel"]["phi_se"]]))
            if not exact
            else None
        ),
    }
    return {
        key: None if isinstance(value, float) and math.isnan(value) else value
        for key, value in report.items()
    }, responses


def number(value: float | None) -> str:
    return "undefined" if value is None else f"{value:.4f}"


def format_table(report: dict) -> str:
    low, high = report["spearman_ci95"]
    rows = [
        ("run", report["run"]),
        ("arm", report["arm"]),
        (
            "aggregator / utility / credit",
            f"{report['aggregator']} / {report['path_utility']} / {report['path_credit']}",
        ),
        (
            "steps / responses / paths",
            f"{report['steps']} / {report['responses']} / {report['paths']}",
        ),
        (
            "Spearman(phi_j, delta_j) [95% CI]",
            f"{number(report['spearman_phi_delta'])} [{number(low)}, {number(high)}] "
            f"({report['bootstrap_resamples']} response resamples)",
        ),
        ("mean abs(sum phi - r_out)", number(report["mean_abs_sum_phi_minus_r_out"])),
        ("mean abs(sum phi - (U(P) - U(empty)))", number(report["mean_abs_sum_phi_minus_utility"])),
        ("mean abs(U(P) - r_out)", number(report["mean_abs_utility_minus_r_out"])),
        ("Pearson(U(P), r_out)", number(report["pearson_utility_r_out"])),
        (
            "mean r_out / mean U(P)",
            f"{number(report['mean_r_out'])} / {number(report['mean_utility_full'])}",
        ),
        (
            f"MC standard error of Shapley phi at M = {report['mc_permutations']}",
            f"{number(report['mc_standard_error'])} ({report['mc_repeats']} draws per response"
            f"{', antithetic' if report['mc_antithetic'] else ''})",
        ),
    ]
    if report["ledger_mean_phi_se"] is not None:
        rows.append(("ledger mean standard error of phi", number(report["ledger_mean_phi_se"])))
    lines = ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def write_scatter(responses: list[ResponsePoints], path: Path, title: str) -> None:
    """phi_j against delta_j, one marker per distinct point, labelled with its number of paths
    (the credit takes few values, so most points are shared)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[tuple[float, float], int] = {}
    for r in responses:
        for phi, delta in zip(r.phi, r.delta):
            key = (round(phi, 6), round(delta, 6))
            points[key] = points.get(key, 0) + 1
    figure, axes = plt.subplots(figsize=(5.5, 4.5), dpi=120)
    xs, ys = zip(*points)
    axes.scatter(
        xs, ys, s=[20 * math.sqrt(c) for c in points.values()], alpha=0.5, edgecolors="none"
    )
    for (x, y), count in points.items():
        axes.annotate(str(count), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    axes.axhline(0, color="grey", linewidth=0.5)
    axes.axvline(0, color="grey", linewidth=0.5)
    axes.set_xlabel("phi_j (path credit)")
    axes.set_ylabel("delta_j = r_out(all) - r_out(without j)")
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    try:
        with atomic_path(path) as temp:
            figure.savefig(temp, format="png")
    finally:
        plt.close(figure)


def shapley_report(run_dir: Path, *, out_dir: Path | None = None, **settings) -> dict:
    """Build the report of ``run_dir`` and write report.json, report.md and scatter.png to
    ``out_dir`` (default RUN_DIR/shapley_report); returns the report (undefined figures None)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: not a run directory")
    report, responses = build_report(run_dir, **settings)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "shapley_report"
    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_table(report)
    write_json_atomic(out_dir / "report.json", report)
    write_text_atomic(out_dir / "report.md", table)
    write_scatter(
        responses,
        out_dir / "scatter.png",
        f"{report['arm']}: Spearman {number(report['spearman_phi_delta'])}, "
        f"{report['paths']} paths",
    )
    report["table"] = table
    return report
