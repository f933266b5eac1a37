"""What ``verify`` checks beyond the re-derivation of each step: the figures a run directory
claims that follow from the rest of it.

  signature   config.json's settings hash to the signature's settings_sha256, and the signature's
              arm, seed and steps are the config's (an edited lr or group_size is caught)
  finite      no loss or grad_norm is NaN or infinite unless the run allowed it
              (allow_nonfinite): the run would have stopped at that step
  loss scale  fp16-mixed: each optimizer step's recorded scale is the one GradScaler's law gives
              (2^16 at the start, halved after a skipped step, doubled after 2,000 clean steps in
              a row), re-run on the recorded skips; other precisions record none
  totals      summary.json's totals_this_run equal the sums of the ledger's last lines (the steps
              this process ran: all of them, or those after a resume)
  keys        every key of a ledger line is a field of its record (nothing unknown)
Not re-derivable here: the engine's executed counts (prefill_run, block_copies, peak_kv_blocks,
preemptions) depend on scheduling, so only the ledger's conservation laws bound them.
"""

from __future__ import annotations

import math

from rlvr_fast.engine.counters import SUMMED_COUNTERS
from rlvr_fast.ledger.records import FLOP_FIELDS, TOTALLED_FIELDS, read_record
from rlvr_fast.run.directory import RUN_KEY, settings_sha256
from rlvr_fast.run.reader import Run
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.loss_scale import LossScaler


def signature_failures(run: Run) -> list[str]:
    signature = run.meta.get(RUN_KEY)
    if not isinstance(signature, dict):
        return [f"config.json: no {RUN_KEY!r} signature"]
    failures = []
    if signature.get("settings_sha256") != settings_sha256(run.config):
        failures.append(
            "config.json: its settings do not hash to the signature's settings_sha256 "
            "(edited after the run was written)"
        )
    for key in ("arm", "seed", "steps"):
        if signature.get(key) != run.config.get(key):
            failures.append(
                f"config.json: signature {key} {signature.get(key)!r}, settings "
                f"{run.config.get(key)!r}"
            )
    return failures


def nonfinite_failures(run: Run, config: TrainConfig) -> list[str]:
    if config.allow_nonfinite:
        return []
    failures = []
    for line in run.ledger:
        for name in ("loss", "grad_norm"):
            value = line.get(name)
            if isinstance(value, float) and not math.isfinite(value):
                failures.append(
                    f"step {line.get('step')} {name}: {value!r}; the run stops at a non-finite "
                    "figure unless allow_nonfinite"
                )
    return failures


def loss_scale_failures(run: Run, precision: str | None) -> list[str]:
    scaler = LossScaler()
    failures = []
    for line in run.ledger:
        step, recorded = line.get("step"), line.get("loss_scale")
        if precision != "fp16-mixed" or not line.get("optimizer_step"):
            if recorded is not None:
                failures.append(f"step {step} loss_scale: recorded {recorded!r}, expected none")
            continue
        if not isinstance(recorded, dict) or not isinstance(recorded.get("skipped"), bool):
            failures.append(f"step {step} loss_scale: recorded {recorded!r}, not a scale and skip")
            continue
        if recorded.get("scale") != scaler.scale:
            failures.append(
                f"step {step} loss_scale.scale: recorded {recorded.get('scale')!r}, the law "
                f"gives {scaler.scale!r}"
            )
        scaler.update(not recorded["skipped"])
    return failures


def totals_failures(run: Run) -> list[str]:
    summary = run.summary
    if not run.finished or not isinstance(summary, dict):
        return []
    totals = summary.get("totals_this_run")
    if not isinstance(totals, dict):
        return ["summary.json: totals_this_run missing"]
    names = (*TOTALLED_FIELDS, *SUMMED_COUNTERS, *FLOP_FIELDS)
    lines = run.ledger[: summary.get("steps") if isinstance(summary.get("steps"), int) else None]
    for start in range(len(lines) + 1):
        if all(totals.get(name) == sum_of(lines[start:], name) for name in names):
            return []
    differing = next(name for name in names if totals.get(name) != sum_of(lines, name))
    return [
        f"summary.json totals_this_run.{differing}: {totals.get(differing)!r}, the ledger's "
        f"lines sum to {sum_of(lines, differing)!r} (nor does any run of its last lines match)"
    ]


def sum_of(lines: list[dict], name: str):
    total = 0
    for line in lines:
        total = total + line.get(name, 0)
    return total


def unknown_key_failures(run: Run) -> list[str]:
    failures = []
    for line in run.ledger:
        try:
            known = set(read_record(line).to_json())
        except (TypeError, ValueError, AttributeError, KeyError):
            continue  # the laws check reports a line that is not a record
        unknown = sorted(set(line) - known)
        if unknown:
            failures.append(f"step {line.get('step')}: unknown key(s) {', '.join(unknown)}")
    return failures
