"""``rlvr-fast verify``: re-derive a run's ledger and grades from what its directory holds, in the
spirit of the study's verify_supplement.py. Checks per run directory:

  config      config.json holds a valid TrainConfig, the trainable parameter count P, the package
              versions (rlvr_fast and torch at least) and the git commit
  steps       ledger.jsonl and rollouts.jsonl hold exactly one line per step, 0 .. n-1, and all
              config.steps of them once the run is finished (summary.json written), or, with
              active_steps, up to the step that made that many active steps
  re-derived  each step's ledger line rebuilt from its rollouts line and config.json through the
              ledger's own constructors: rewards re-graded from the texts (derivation gate
              included; a run whose config.json says its rewards are recorded, a TRL script's
              reward functions, keeps the ledger's), sigma_R, homogeneous / active / optimizer step by the arm's rules, flat
              or tree by the warmup rule, pair tuples and categories, gen, pref, pad_pref,
              untrim_gen, leaf, bwd_out, bwd_full, |p^(k)|, stage2_gen and the Out / Full /
              PadFull FLOPs at P; on parallel-path steps the path and summary grades, r_out
              and (deterministic credits) phi and the returns; on multi-question steps each
              question's sub-record that way, then the step's totals, zero-variance count and
              stepping; every one must equal the recorded value
  laws        every recorded line satisfies the ledger's conservation laws
              (``ledger.check_conservation``), which also bound what only the engine knows
              (decode rows, prefill tokens run, KV blocks)
  entropy     (an entropy bonus) each step's entropy_coef: the run's, or the adaptive control's
              coefficients re-run on the recorded policy_term_entropy of each step
  claims      the figures beyond the steps' re-derivation (``rlvr_fast.analysis.claims``): the
              config against its signature, no non-finite loss or grad_norm unless allowed,
              fp16-mixed's loss-scale law, summary.json's totals, no unknown ledger keys
  evals       every saved eval item re-graded from its response text (extracted answer, grade,
              derivation gate, a cap hit only at the cap), the Polyak average's too;
              summary.json's counts agree
Not re-derived: token lengths from texts (decoding then encoding is not the identity), timings,
losses and gradient norms (checked finite only), the engine's executed counts (bounded by the
laws only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path


from rlvr_fast.analysis import claims
from rlvr_fast.run.provenance import REWARDS_KEY, REWARDS_RECORDED
from rlvr_fast.run.reader import Run, RunDirError, find_run_dirs
from rlvr_fast.grading import extract_boxed, grade_many, passes_gate
from rlvr_fast.ledger.laws import check_conservation
from rlvr_fast.ledger.records import LedgerError, MultiQuestionRecord, read_record
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.kinds import step_kind
from rlvr_fast.train.policy import entropy_coefficients
from rlvr_fast.train.steps import rederive_step

# Ledger fields that follow from rollouts.jsonl and config.json are each record's
# (``LedgerRecord.derived_fields``); the rest (timings, loss, gradient norm and the engine's
# executed counts, ``EngineCounters``) are only bounded, by the conservation laws.
# Written only when set (reused, trained): a line has them iff its re-derivation does.
OPTIONAL_FIELDS = ("reused", "trained")
REQUIRED_VERSIONS = ("rlvr_fast", "torch")
SHOWN_FAILURES = 10


@dataclass
class Check:
    name: str
    detail: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass
class RunVerification:
    path: Path
    checks: list[Check]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def lines(self) -> list[str]:
        """PASS / FAIL lines, the first SHOWN_FAILURES mismatches of each failed check below it."""
        lines = [f"{self.path}: {'PASS' if self.ok else 'FAIL'} ({self.seconds:.2f} s)"]
        for check in self.checks:
            if check.ok:
                lines.append(f"  PASS {check.name}: {check.detail}")
                continue
            lines.append(f"  FAIL {check.name}: {len(check.failures)} problem(s)")
            lines += [f"    {failure}" for failure in check.failures[:SHOWN_FAILURES]]
            if len(check.failures) > SHOWN_FAILURES:
                lines.append(f"    ... and {len(check.failures) - SHOWN_FAILURES} more")
        return lines


def verify_paths(paths: list[Path]) -> tuple[list[str], bool]:
    """Every run under ``paths`` (run directories or directories of them): the PASS / FAIL
    lines of each, a closing count, and whether all passed."""
    results = [verify_run(path) for path in find_run_dirs(paths)]
    lines = [line for result in results for line in result.lines()]
    failed = [str(result.path) for result in results if not result.ok]
    lines.append(
        f"verify: {len(results) - len(failed)} of {len(results)} runs PASS in "
        f"{sum(r.seconds for r in results):.2f} s"
        + (f"; FAIL: {', '.join(failed)}" if failed else "")
    )
    return lines, not failed


class UnverifiedRunError(ValueError):
    """A run that ``compare``, ``report`` or ``sweep`` would read fails verify (or was recorded
    under other package versions than the rest); the one line names it and the first failure."""


def verified_runs(paths: list[Path], *, allow_unverified: bool = False) -> list[str]:
    """Verify every run under ``paths`` before its figures are pooled: a run that fails, or
    whose recorded rlvr_fast / torch versions differ from the first run's, is refused
    (``UnverifiedRunError``) unless ``allow_unverified``; then returns one warning line per
    such run, for the caller to print."""
    found = find_run_dirs(paths)
    warnings, first_versions = [], None
    for path in found:
        result = verify_run(path)
        problems = [f"{c.name}: {c.failures[0]}" for c in result.checks if not c.ok]
        versions = recorded_versions(path)
        if first_versions is None:
            first_versions = (path, versions)
        elif versions != first_versions[1]:
            problems.append(
                f"recorded with {format_versions(versions)}, {first_versions[0]} with "
                f"{format_versions(first_versions[1])}"
            )
        if not problems:
            continue
        line = f"{path}: fails verify ({problems[0]})"
        if not allow_unverified:
            raise UnverifiedRunError(
                f"{line}; see rlvr-fast verify {path}, or pass --allow-unverified to include "
                "it, marked"
            )
        warnings.append(f"rlvr-fast: warning: included unverified: {line}")
    return warnings


def recorded_versions(path: Path) -> dict:
    try:
        versions = Run.open(path).meta.get("versions")
    except RunDirError:
        return {}
    versions = versions if isinstance(versions, dict) else {}
    return {name: versions.get(name) for name in REQUIRED_VERSIONS}


def format_versions(versions: dict) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def verify_run(path: Path) -> RunVerification:
    """All checks of one run directory; one whose config.json cannot be read (a FIFO, a list,
    invalid JSON) fails its config check."""
    started = time.perf_counter()
    try:
        run = Run.open(path)
    except RunDirError as err:
        return RunVerification(path, [Check("config", failures=[str(err)])], 0.0)
    config_check, config = check_config(run)
    checks = [config_check]
    if config is not None:
        params = run.meta["trainable_parameters"]
        checks += [
            _guarded("steps", check_steps, run, config),
            _guarded("re-derived", check_rederived, run, config, params),
            _guarded("laws", check_laws, run),
            _guarded("claims", check_claims, run, config),
            _guarded("evals", check_evals, run, config),
        ]
        if config.entropy_bonus:
            checks.append(_guarded("entropy", check_entropy_coefficients, run, config))
    return RunVerification(path, checks, time.perf_counter() - started)


# What a check may raise on a hand-edited line (a field of the wrong type or shape).
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, AssertionError)


def _guarded(name: str, check, *args) -> Check:
    """A file that does not parse, or a line of the wrong shape, fails the check that reads it,
    not the whole command."""
    try:
        return check(*args)
    except RunDirError as err:
        return Check(name, failures=[str(err)])
    except MALFORMED as err:
        return Check(name, failures=[f"cannot check ({_describe(err)})"])


def check_config(run: Run) -> tuple[Check, TrainConfig | None]:
    check = Check("config")
    try:
        config = TrainConfig(**run.config)
    except (TypeError, ValueError) as err:
        check.failures.append(f"config.json: not a valid TrainConfig ({err})")
        return check, None
    params = run.meta.get("trainable_parameters")
    if not isinstance(params, int) or isinstance(params, bool) or params < 1:
        check.failures.append(f"config.json: trainable_parameters is {params!r}, not a count")
    versions = run.meta.get("versions")
    versions = versions if isinstance(versions, dict) else {}
    check.failures += [
        f"config.json: version of {name} not recorded"
        for name in REQUIRED_VERSIONS
        if name not in versions
    ]
    if "git_commit" not in run.meta:
        check.failures.append("config.json: git_commit not recorded")
    if check.failures:
        return check, None
    commit = run.meta["git_commit"]
    check.detail = (
        f"arm {config.arm}, seed {config.seed}, {config.steps} steps, P = {params:,}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; commit {commit[:12] if commit else 'none (not a git checkout)'}"
    )
    return check, config


def check_steps(run: Run, config: TrainConfig) -> Check:
    check = Check("steps")
    for name, lines in (("ledger.jsonl", run.ledger), ("rollouts.jsonl", run.rollouts)):
        steps = [line.get("step") for line in lines]
        expected = list(range(len(lines)))
        if steps != expected:
            index = next(i for i, (a, b) in enumerate(zip(steps, expected)) if a != b)
            check.failures.append(
                f"{name} line {index + 1}: step {steps[index]!r}, expected "
                f"{expected[index]} (one line per step, in order)"
            )
    if len(run.ledger) != len(run.rollouts):
        check.failures.append(
            f"ledger.jsonl has {len(run.ledger)} lines, rollouts.jsonl {len(run.rollouts)}"
        )
    if run.finished and len(run.ledger) != finished_length(run.ledger, config):
        target = (
            f" or the step of active step {config.active_steps}"
            if config.active_steps is not None
            else ""
        )
        check.failures.append(
            f"finished run: ledger.jsonl has {len(run.ledger)} lines for "
            f"{config.steps} steps{target}"
        )
    if not run.finished:
        check.failures.append(
            f"unfinished run: {len(run.ledger)} of {config.steps} steps, no summary.json"
        )
    check.detail = f"one ledger and one rollouts line for each of {len(run.ledger)} steps"
    return check


def finished_length(ledger: list[dict], config: TrainConfig) -> int:
    """The lines a finished run's ledger holds: config.steps, or with active_steps the step
    whose backward pass made that many, if one did."""
    if config.active_steps is not None:
        active = 0
        for index, line in enumerate(ledger):
            active += bool(line.get("active"))
            if active == config.active_steps:
                return index + 1
    return config.steps


def check_rederived(run: Run, config: TrainConfig, params: int) -> Check:
    check = Check("re-derived")
    active_steps = 0
    graded = 0
    kind = step_kind(config.sampler)
    regrade = run.meta.get(REWARDS_KEY) != REWARDS_RECORDED
    for recorded, rollout in zip(run.ledger, run.rollouts):
        step = recorded.get("step")
        try:
            expected = rederive_step(
                kind, rollout, recorded, config, params, active_steps, regrade=regrade
            )
        except (KeyError, TypeError, ValueError) as err:
            check.failures.append(f"step {step}: cannot re-derive ({_describe(err)})")
            continue
        active_steps += expected.active
        questions = expected.questions if isinstance(expected, MultiQuestionRecord) else [expected]
        graded += sum(len(q.rewards) for q in questions)
        check.failures += field_mismatches(
            step, recorded, expected.to_json(), expected.derived_fields()
        )
    tflops = [
        sum(line.get(key, 0) for line in run.ledger) / 1e12
        for key in ("flops_out", "flops_full", "flops_pad_full")
    ]
    check.detail = (
        f"{len(run.ledger)} steps equal their re-derivation ({graded} rewards "
        f"{'re-graded' if regrade else 'as recorded: the task grades with its own functions'}); Out / Full / PadFull = "
        + " / ".join(f"{t:.4g}" for t in tflops)
        + " TFLOPs"
    )
    return check


def field_mismatches(
    step, recorded: dict, expected: dict, names: tuple[str, ...], prefix: str = ""
) -> list[str]:
    """One line per derived field whose recorded value differs: step, field (with the first
    differing index of a list, or the differing fields of a section), recorded and re-derived
    value."""
    mismatches = []
    for name in names:
        if name in OPTIONAL_FIELDS and name not in recorded and name not in expected:
            continue
        if name not in recorded:
            mismatches.append(
                f"step {step} {prefix}{name}: not recorded, re-derived {expected[name]!r}"
            )
            continue
        have, want = recorded[name], expected.get(name)
        if have == want:
            continue
        if isinstance(have, dict) and isinstance(want, dict):
            mismatches += field_mismatches(step, have, want, tuple(want), f"{prefix}{name}.")
            continue
        if isinstance(have, list) and isinstance(want, list) and len(have) == len(want):
            index = next(i for i, (a, b) in enumerate(zip(have, want)) if a != b)
            name, have, want = f"{name}[{index}]", have[index], want[index]
            if isinstance(have, dict) and isinstance(want, dict):
                mismatches += field_mismatches(step, have, want, tuple(want), f"{prefix}{name}.")
                continue
        mismatches.append(f"step {step} {prefix}{name}: recorded {have!r}, re-derived {want!r}")
    return mismatches


def check_entropy_coefficients(run: Run, config: TrainConfig) -> Check:
    """Each step's entropy_coef: the run's, or under use_adaptive_entropy TRL's control re-run
    on the entropies the steps recorded (``policy_term_entropy``)."""
    check = Check("entropy")
    policies = [line.get("policy") or {} for line in run.ledger]
    if config.use_adaptive_entropy:
        missing = [i for i, p in enumerate(policies) if "policy_term_entropy" not in p]
        if missing:
            check.failures.append(f"step {missing[0]}: policy_term_entropy not recorded")
            return check
        expected = entropy_coefficients(config, [p["policy_term_entropy"] for p in policies])
    else:
        expected = [config.entropy_coef] * len(policies)
    for step, (policy, want) in enumerate(zip(policies, expected)):
        if policy.get("entropy_coef") != want:
            check.failures.append(
                f"step {step} policy.entropy_coef: recorded {policy.get('entropy_coef')!r}, "
                f"re-derived {want!r}"
            )
    check.detail = f"{len(policies)} steps' entropy_coef re-derived"
    return check


def check_laws(run: Run) -> Check:
    check = Check("laws")
    categories: dict[str, int] = {}
    for line in run.ledger:
        try:
            record = read_record(line)
            check_conservation(record)
        except (TypeError, LedgerError) as err:
            check.failures.append(f"step {line.get('step')}: {_describe(err)}")
            continue
        questions = record.questions if isinstance(record, MultiQuestionRecord) else [record]
        for pair in (pair for question in questions for pair in question.pairs):
            categories[pair[6]] = categories.get(pair[6], 0) + 1
    check.detail = f"{len(run.ledger)} lines conserve tokens; pairs: " + ", ".join(
        f"{n} {c}" for c, n in sorted(categories.items())
    )
    return check


def check_claims(run: Run, config: TrainConfig) -> Check:
    check = Check("claims")
    check.failures = [
        *claims.signature_failures(run),
        *claims.nonfinite_failures(run, config),
        *claims.loss_scale_failures(run, run.meta.get("precision")),
        *claims.totals_failures(run),
        *claims.unknown_key_failures(run),
    ]
    check.detail = (
        "signature, finite loss and grad_norm, loss-scale law, summary totals, known keys "
        "(engine counts: bounded by the laws only)"
    )
    return check


def check_evals(run: Run, config: TrainConfig) -> Check:
    check = Check("evals")
    cap = config.eval_max_new_tokens
    counted = []
    summary = run.summary or {}
    for before, polyak, summary_key in (
        (True, False, "eval_before"),
        (False, False, "eval_after"),
        (False, True, "eval_polyak"),
    ):
        evals = run.evals(before, polyak=polyak)
        label = "evals/before/" if before else "evals/polyak/" if polyak else "evals/"
        for name, items in evals.items():
            where = f"{label}{name}.jsonl"
            check.failures += eval_file_mismatches(where, items, cap)
            counted.append(f"{where} {len(items)}")
            if name in summary.get(summary_key, {}):
                check.failures += summary_mismatches(
                    f"summary.json {summary_key}.{name}", summary[summary_key][name], items
                )
        check.failures += [
            f"summary.json {summary_key}.{name}: no {label}{name}.jsonl"
            for name in summary.get(summary_key, {})
            if name not in evals
        ]
    check.failures += step_eval_mismatches(run, cap, counted)
    check.detail = (
        "items re-graded from their responses: " + ", ".join(counted)
        if counted
        else "no evaluations saved"
    )
    return check


def step_eval_mismatches(run: Run, cap: int, counted: list[str]) -> list[str]:
    """The evaluations during training (--eval-every): each evals/step-N/NAME.jsonl re-graded,
    and its line of eval_steps.jsonl recounted from it."""
    mismatches = []
    for line in run.eval_steps:
        step, sets = line.get("step"), line.get("sets")
        if not isinstance(step, int) or not isinstance(sets, dict):
            mismatches.append(f"eval_steps.jsonl: a line without its step and sets: {line}")
            continue
        for name, items in run.step_evals(step).items():
            where = f"evals/step-{step}/{name}.jsonl"
            mismatches += eval_file_mismatches(where, items, cap)
            counted.append(f"{where} {len(items)}")
            if name not in sets or not isinstance(sets[name], dict):
                mismatches.append(f"eval_steps.jsonl step {step}: no summary of {where}")
            else:
                where = f"eval_steps.jsonl step {step} {name}"
                mismatches += summary_mismatches(where, sets[name], items)
    return mismatches


def eval_file_mismatches(where: str, items: list[dict], cap: int) -> list[str]:
    """Every item of one eval file re-graded the way ``evaluate`` grades: the last box of the
    response, graded in one batch against the item's answer."""
    try:
        responses = [item["response"] for item in items]
        answers = [item["answer"] for item in items]
        extracted = [extract_boxed(response) for response in responses]
    except (KeyError, TypeError) as err:
        return [f"{where}: cannot re-grade ({_describe(err)})"]
    mismatches = []
    for number, (item, response, answer, correct) in enumerate(
        zip(items, responses, extracted, grade_many(extracted, answers)), start=1
    ):
        derived = {"extracted": answer, "correct": correct, "derivation": passes_gate(response)}
        mismatches += item_mismatches(f"{where}:{number}", item, derived, cap)
    return mismatches


def item_mismatches(where: str, item: dict, derived: dict, cap: int) -> list[str]:
    try:
        recorded = {name: item[name] for name in derived}
        length, cap_hit = item["length"], item["cap_hit"]
    except KeyError as err:
        return [f"{where}: cannot re-grade ({_describe(err)})"]
    item_id = item.get("id")
    mismatches = [
        f"{where} item {item_id} {name}: recorded {recorded[name]!r}, re-graded {value!r}"
        for name, value in derived.items()
        if recorded[name] != value
    ]
    if not 0 <= length <= cap or (cap_hit and length != cap):
        mismatches.append(
            f"{where} item {item_id} length: recorded {length} with cap_hit "
            f"{cap_hit}, the cap is {cap}"
        )
    return mismatches


def summary_mismatches(where: str, summary: dict, items: list[dict]) -> list[str]:
    recount = {
        "items": len(items),
        "correct": sum(bool(i.get("correct")) for i in items),
        "cap_hits": sum(bool(i.get("cap_hit")) for i in items),
    }
    recount["accuracy"] = recount["correct"] / len(items) if items else None
    return [
        f"{where}.{name}: recorded {summary.get(name)!r}, recounted {value!r}"
        for name, value in recount.items()
        if summary.get(name) != value
    ]


def _describe(err: Exception) -> str:
    if isinstance(err, KeyError):
        return f"missing field {err.args[0]!r}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__
