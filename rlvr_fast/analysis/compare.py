"""``rlvr-fast compare``: the study's tables (seed §5.2-§5.3) over run directories grouped by arm
and seed.

Per arm and eval set: accuracy over seeds (mean ± SD and the per-seed values), AllCap (responses
that hit the eval token cap) and IncTrunc (those of them graded incorrect); per arm: ledger token
totals, Out / Full / PadFull TFLOPs and the step-summed seconds, each a mean over seeds. Per
non-reference arm, eval set and metric (accuracy, and the cap-hit rate where either arm hit the
cap): paired per-seed differences against the reference arm, their mean, a two-level (seed x
question) bootstrap 95% CI and a pooled-item bootstrap 95% CI (``rlvr_fast.analysis.stats``). Items are paired by id, so every run must
have graded the same eval sets on the same items at the same cap; anything else is refused.
Before-training evaluations, where runs saved them, give the "base model (0 updates)" row. Runs
without evaluations (none of them has any) compare on their ledgers' totals alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlvr_fast.run.reader import SIGNATURE_FIELDS, Run, RunDirError, load_runs
from rlvr_fast.ledger.records import FLOP_FIELDS
from rlvr_fast.analysis.stats import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    bootstrap_mean_ci,
    mean_sd,
    paired_differences,
    two_level_bootstrap_ci,
)

BASE_LABEL = "base model (0 updates)"
TOKEN_FIELDS = ("gen", "untrim_gen", "pref", "pad_pref", "bwd_out", "bwd_full")
METRICS = ("accuracy", "cap_hits")


class CompareError(ValueError):
    """Runs that cannot be compared (mixed eval sets, unequal item lists, duplicate seeds)."""


@dataclass
class EvalGrades:
    """One run's grades on one eval set, in the eval set's canonical item order."""

    correct: np.ndarray  # [N] 0/1
    cap_hit: np.ndarray  # [N] 0/1

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())

    @property
    def cap_hits(self) -> int:
        return int(self.cap_hit.sum())

    @property
    def incorrect_truncated(self) -> int:
        return int((self.cap_hit * (1 - self.correct)).sum())

    def metric(self, name: str) -> np.ndarray:
        return self.correct if name == "accuracy" else self.cap_hit


@dataclass
class ArmSummary:
    """One arm over its seeds: per-seed grades per eval set and per-seed ledger totals."""

    arm: str
    seeds: list[int]
    grades: dict[str, dict[int, EvalGrades]]  # eval set -> seed -> grades
    totals: dict[int, dict[str, float]] = field(default_factory=dict)  # seed -> totals

    def per_seed(self, eval_set: str, value) -> list[float]:
        return [value(self.grades[eval_set][seed]) for seed in self.seeds]

    def mean_total(self, key: str) -> float:
        return mean_sd([self.totals[seed][key] for seed in self.seeds])[0]


@dataclass
class Contrast:
    """Arm minus reference on one eval set and metric, paired by seed and item; in points of
    the metric's rate (accuracy or cap-hit fraction), x 100 for pp."""

    arm: str
    reference: str
    eval_set: str
    metric: str
    seeds: list[int]
    per_seed: list[float]
    mean: float
    two_level_ci: tuple[float, float] | None  # None with one seed
    pooled_ci: tuple[float, float]
    gains: int
    losses: int


@dataclass
class Comparison:
    eval_sets: dict[str, int]  # name -> items
    eval_cap: int
    arms: list[ArmSummary]
    base: ArmSummary | None
    reference: str | None
    contrasts: list[Contrast]

    @property
    def rows(self) -> list[ArmSummary]:
        """The base model (when runs saved before-training evaluations), then the arms."""
        return ([self.base] if self.base else []) + self.arms


def compare_paths(
    paths: list[Path],
    *,
    reference: str | None = None,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Comparison:
    try:
        runs = load_runs(paths)
        return compare_runs(runs, reference=reference, resamples=resamples, seed=seed)
    except RunDirError as err:
        raise CompareError(str(err)) from None


def compare_runs(
    runs: list[Run],
    *,
    reference: str | None = None,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Comparison:
    """The tables over ``runs``; ``reference`` defaults to the first run's arm."""
    by_arm = group_by_arm(runs)
    reference = reference or next(iter(by_arm))
    if reference not in by_arm:
        raise CompareError(
            f"--reference {reference!r} is not among the arms compared ({', '.join(by_arm)})"
        )
    item_ids = eval_item_ids(runs)
    eval_cap = common_eval_cap(runs)
    arms = [summarise_arm(arm, seeds, item_ids, before=False) for arm, seeds in by_arm.items()]
    base = summarise_base(runs, item_ids)
    reference_arm = next(a for a in arms if a.arm == reference)
    contrasts = [
        paired_contrast(arm, reference_arm, name, metric, resamples, seed)
        for arm in arms
        if arm is not reference_arm
        for name in item_ids
        for metric in METRICS
        if metric == "accuracy" or any_cap_hit(arm, reference_arm, name)
    ]
    return Comparison(
        {name: len(ids) for name, ids in item_ids.items()},
        eval_cap,
        arms,
        base,
        reference if len(arms) > 1 else None,
        contrasts,
    )


def any_cap_hit(arm: ArmSummary, reference: ArmSummary, eval_set: str) -> bool:
    """Cap-hit contrasts are listed only where a response of either arm hit the cap."""
    return any(
        grades.cap_hits
        for summary in (arm, reference)
        for grades in summary.grades[eval_set].values()
    )


def group_by_arm(runs: list[Run]) -> dict[str, dict[int, Run]]:
    """arm -> seed -> run, arms and seeds in the order given. The runs of one arm must be
    finished and differ in their seed only, or they are not seeds of one arm."""
    by_arm: dict[str, dict[int, Run]] = {}
    for run in runs:
        if not run.finished:
            raise CompareError(f"{run.path}: unfinished run (no summary.json)")
        seeds = by_arm.setdefault(run.arm, {})
        if run.seed in seeds:
            raise CompareError(
                f"two runs of arm {run.arm} with seed {run.seed}: "
                f"{seeds[run.seed].path} and {run.path}"
            )
        if seeds:
            check_same_experiment(next(iter(seeds.values())), run)
        seeds[run.seed] = run
    return by_arm


def check_same_experiment(first: Run, run: Run) -> None:
    """Two runs of one arm are two seeds of one experiment only when everything but the seed
    is the same: the settings (config.json's config), and the starting model, the training and
    evaluation data, dtype and device (its signature's hashes)."""
    recorded = [
        (key, first.config.get(key), run.config.get(key))
        for key in sorted(set(first.config) | set(run.config))
        if key != "seed"
    ] + [(key, first.signature.get(key), run.signature.get(key)) for key in SIGNATURE_FIELDS]
    for key, a, b in recorded:
        if a != b:
            raise CompareError(
                f"runs of arm {run.arm} differ in {SIGNATURE_NAMES.get(key, key)} "
                f"({shown(a)} in {first.path}, {shown(b)} in {run.path}); "
                "only the seed may differ"
            )


SIGNATURE_NAMES = {
    "model_sha256": "the starting model (weights or tokenizer)",
    "train_data": "the training problems",
    "eval_data": "the evaluation sets",
}


def shown(value) -> str:
    """A value for an error line: hashes cut to 12 hex digits."""
    if isinstance(value, str) and len(value) == 64:
        return value[:12]
    if isinstance(value, dict) and "sha256" in value:
        return f"{value.get('problems')} problems, sha256 {str(value['sha256'])[:12]}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return repr(value)


def eval_item_ids(runs: list[Run]) -> dict[str, list[str]]:
    """Eval set -> item ids, the first run's order; every run (and every saved before-training
    evaluation) must have graded exactly these. None of them having evaluations is allowed (the
    tables then hold the ledgers' totals only); some of them is not."""
    first = runs[0]
    names = sorted(first.eval_files())
    item_ids = {name: _ids(first, name, before=False) for name in names}
    for run in runs:
        if sorted(run.eval_files()) != names:
            raise CompareError(
                f"mixed eval sets: {first.path} has {', '.join(names) or 'none'}; "
                f"{run.path} has {', '.join(sorted(run.eval_files())) or 'none'}"
            )
        for before in (False, True):
            for name in run.eval_files(before):
                ids = _ids(run, name, before)
                if name not in item_ids or sorted(ids) != sorted(item_ids[name]):
                    where = f"evals/{'before/' if before else ''}{name}.jsonl"
                    raise CompareError(
                        f"unequal item lists: {run.path / where} grades {len(ids)} items, "
                        f"{first.path / 'evals' / (name + '.jsonl')} "
                        f"{len(item_ids.get(name, []))}, not the same ids"
                    )
    return item_ids


def _ids(run: Run, name: str, before: bool) -> list[str]:
    items = run.evals(before)[name]
    try:
        ids = [item["id"] for item in items]
    except KeyError:
        raise CompareError(f"{run.path}: an item of eval set {name} has no id") from None
    if len(set(ids)) != len(ids):
        raise CompareError(f"{run.path}: eval set {name} grades an item twice")
    return ids


def common_eval_cap(runs: list[Run]) -> int:
    caps = {run.config.get("eval_max_new_tokens") for run in runs}
    if len(caps) != 1:
        raise CompareError(
            f"runs were evaluated at different token caps ({sorted(map(str, caps))}): "
            f"their AllCap counts do not compare"
        )
    return caps.pop()


def summarise_arm(
    arm: str, runs: dict[int, Run], item_ids: dict[str, list[str]], before: bool
) -> ArmSummary:
    grades = {
        name: {seed: eval_grades(run, name, ids, before) for seed, run in runs.items()}
        for name, ids in item_ids.items()
    }
    summary = ArmSummary(arm, list(runs), grades)
    if not before:
        summary.totals = {seed: ledger_totals(run) for seed, run in runs.items()}
    return summary


def summarise_base(runs: list[Run], item_ids: dict[str, list[str]]) -> ArmSummary | None:
    """The base model's row from the first run that saved before-training evaluations: greedy
    decoding of one base model grades every run's items the same."""
    run = next((run for run in runs if run.eval_files(before=True)), None)
    if run is None:
        return None
    names = {n: ids for n, ids in item_ids.items() if n in run.eval_files(before=True)}
    return summarise_arm(BASE_LABEL, {run.seed: run}, names, before=True)


def eval_grades(run: Run, name: str, ids: list[str], before: bool) -> EvalGrades:
    by_id = {item["id"]: item for item in run.evals(before)[name]}
    try:
        correct = [bool(by_id[i]["correct"]) for i in ids]
        cap_hit = [bool(by_id[i]["cap_hit"]) for i in ids]
    except KeyError as err:
        raise CompareError(f"{run.path}: eval set {name}: an item lacks {err.args[0]!r}") from None
    return EvalGrades(np.array(correct, dtype=np.float64), np.array(cap_hit, dtype=np.float64))


def ledger_totals(run: Run) -> dict[str, float]:
    """Token counts and FLOPs summed over the run's ledger, seconds summed over its steps' phases,
    P, and the number of steps and of steps with a backward pass."""
    lines = run.ledger
    if not lines:
        raise CompareError(f"{run.path}: empty ledger")
    try:
        totals = {
            key: float(sum(line[key] for line in lines)) for key in TOKEN_FIELDS + FLOP_FIELDS
        }
        totals["seconds"] = float(sum(sum(line["seconds"].values()) for line in lines))
        totals["params"] = float(lines[0]["params"])
        totals["steps"] = float(len(lines))
        totals["active_steps"] = float(sum(bool(line["active"]) for line in lines))
    except (KeyError, AttributeError, TypeError) as err:
        raise CompareError(f"{run.path / 'ledger.jsonl'}: unreadable line ({err})") from None
    return totals


def paired_contrast(
    arm: ArmSummary, reference: ArmSummary, eval_set: str, metric: str, resamples: int, seed: int
) -> Contrast:
    """Arm minus reference on the seeds both have; per-seed rates, item-level paired
    differences for the bootstrap."""
    rates = {s: float(arm.grades[eval_set][s].metric(metric).mean()) for s in arm.seeds}
    reference_rates = {
        s: float(reference.grades[eval_set][s].metric(metric).mean()) for s in reference.seeds
    }
    try:
        per_seed = paired_differences(rates, reference_rates)
    except ValueError as err:
        raise CompareError(f"arm {arm.arm} against reference {reference.arm}: {err}") from None
    seeds = list(per_seed)
    differences = np.stack(
        [
            arm.grades[eval_set][s].metric(metric) - reference.grades[eval_set][s].metric(metric)
            for s in seeds
        ]
    )
    two_level = (
        two_level_bootstrap_ci(differences, resamples=resamples, seed=seed)
        if len(seeds) > 1
        else None
    )
    pooled = bootstrap_mean_ci(differences.ravel(), resamples=resamples, seed=seed)
    return Contrast(
        arm.arm,
        reference.arm,
        eval_set,
        metric,
        seeds,
        list(per_seed.values()),
        mean_sd(list(per_seed.values()))[0],
        two_level,
        pooled,
        int((differences > 0).sum()),
        int((differences < 0).sum()),
    )
