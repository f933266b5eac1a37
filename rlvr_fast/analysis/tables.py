"""A ``Comparison`` written out: Markdown in the study's layout (Table 1: arms; Table 2: paired
contrasts), or the same numbers as CSV or JSON records for other tools.

Markdown cells follow the study: accuracy "46.07% ± 2.39% (44.4 / 45.0 / 48.8)" (mean ± SD over
seeds, then each seed in %), "14.80% (74/500)" for a single seed; AllCap
"52.7 (53/47/58) / 51.7" (mean cap hits, per seed, then mean IncTrunc); tokens in thousands
"gen [untrim] / pref [pad] / bwd_out / bwd_full"; compute "Out / Full / PadFull TFLOPs (s)";
differences in percentage points with 95% CIs.
"""

from __future__ import annotations

import csv
import io
import json

from rlvr_fast.analysis.compare import BASE_LABEL, ArmSummary, Comparison, Contrast
from rlvr_fast.analysis.stats import mean_sd

FORMATS = ("md", "csv", "json")
METRIC_LABELS = {"accuracy": "accuracy", "cap_hits": "AllCap"}


def render(comparison: Comparison, fmt: str) -> str:
    if fmt == "md":
        return markdown(comparison)
    records = arm_records(comparison) + contrast_records(comparison)
    if fmt == "json":
        return (
            json.dumps(
                {
                    "eval_sets": comparison.eval_sets,
                    "eval_cap": comparison.eval_cap,
                    "reference": comparison.reference,
                    "records": records,
                },
                indent=2,
            )
            + "\n"
        )
    if fmt == "csv":
        return to_csv(records)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


# ------------------------------------------------------------------ Markdown


def markdown(comparison: Comparison) -> str:
    parts = [arms_table(comparison)]
    if comparison.contrasts:
        parts.append(contrasts_table(comparison))
    return "\n\n".join(parts) + "\n"


def arms_table(comparison: Comparison) -> str:
    seed_orders = {tuple(arm.seeds) for arm in comparison.arms}
    shared = seed_orders.pop() if len(seed_orders) == 1 else None
    seeds_label = " / ".join(map(str, shared)) if shared else "per seed"
    cap = comparison.eval_cap
    header = [f"Arm (seeds = {', '.join(map(str, shared))})" if shared else "Arm (seeds)"]
    for name, items in comparison.eval_sets.items():
        header += [
            f"{name} ({items}) Mean ± SD ({seeds_label})",
            f"{name} AllCap{cap} ({seeds_label}) / IncTrunc",
        ]
    header += [
        "Tokens k (gen [untrim] / pref [pad] / bwd_out / bwd_full)",
        "Compute (Out / Full / PadFull TFLOPs, step s)",
    ]
    rows = []
    for arm in comparison.rows:
        label = (
            arm.arm
            if shared or arm.arm == BASE_LABEL
            else (f"{arm.arm} ({' / '.join(map(str, arm.seeds))})")
        )
        row = [label]
        for name, items in comparison.eval_sets.items():
            row += [accuracy_cell(arm, name, items), cap_cell(arm, name)]
        row += [tokens_cell(arm), compute_cell(arm)]
        rows.append(row)
    return table(header, rows)


def accuracy_cell(arm: ArmSummary, eval_set: str, items: int) -> str:
    if eval_set not in arm.grades:
        return "—"
    accuracies = arm.per_seed(eval_set, lambda g: g.accuracy)
    if len(accuracies) == 1:
        correct = int(round(accuracies[0] * items))
        return f"{100 * accuracies[0]:.2f}% ({correct}/{items})"
    return mean_sd_cell([100 * a for a in accuracies], "%")


def mean_sd_cell(values: list[float], unit: str = "") -> str:
    """'46.07% ± 2.39% (44.4 / 45.0 / 48.8)': the study's mean ± SD (per seed) form."""
    mean, sd = mean_sd(values)
    return f"{mean:.2f}{unit} ± {sd:.2f}{unit} (" + " / ".join(f"{v:.1f}" for v in values) + ")"


def cap_cell(arm: ArmSummary, eval_set: str) -> str:
    if eval_set not in arm.grades:
        return "—"
    caps = arm.per_seed(eval_set, lambda g: g.cap_hits)
    truncated = arm.per_seed(eval_set, lambda g: g.incorrect_truncated)
    return (
        f"{sum(caps) / len(caps):.1f} ({'/'.join(map(str, caps))}) / "
        f"{sum(truncated) / len(truncated):.1f}"
    )


def tokens_cell(arm: ArmSummary) -> str:
    if not arm.totals:
        return "—"
    k = {
        key: arm.mean_total(key) / 1e3
        for key in ("gen", "untrim_gen", "pref", "pad_pref", "bwd_out", "bwd_full")
    }
    return (
        f"{k['gen']:.1f} [{k['untrim_gen']:.1f}] / {k['pref']:.1f} [{k['pad_pref']:.1f}] / "
        f"{k['bwd_out']:.1f} / {k['bwd_full']:.1f}k"
    )


def compute_cell(arm: ArmSummary) -> str:
    if not arm.totals:
        return "—"
    tflops = [arm.mean_total(key) / 1e12 for key in ("flops_out", "flops_full", "flops_pad_full")]
    return " / ".join(tflops_text(t) for t in tflops) + f" ({arm.mean_total('seconds'):.0f}s)"


def tflops_text(value: float) -> str:
    """One decimal at the study's scale (hundreds of TFLOPs), four significant digits below 10
    so the embedded model's fractions of a TFLOP stay readable."""
    return f"{value:.1f}" if value >= 10 else f"{value:.4g}"


def contrasts_table(comparison: Comparison) -> str:
    header = [
        "Contrast (arm vs. reference)",
        "Benchmark (N)",
        "Per-Seed Diffs (pp)",
        "Mean Diff",
        "Two-Level Seed × Item 95% CI",
        "Pooled Item 95% CI",
    ]
    rows = []
    for contrast in comparison.contrasts:
        metric = METRIC_LABELS[contrast.metric]
        if contrast.metric == "cap_hits":
            metric += str(comparison.eval_cap)
        seeds = " / ".join(map(str, contrast.seeds))
        per_seed = " / ".join(f"{100 * d:+.2f}" for d in contrast.per_seed)
        two_level = (
            ci_text(contrast.two_level_ci)
            if contrast.two_level_ci
            else f"— ({contrast.gains} gains / {contrast.losses} losses)"
        )
        rows.append(
            [
                f"{contrast.arm} vs. {contrast.reference}: {metric}",
                f"{contrast.eval_set} ({comparison.eval_sets[contrast.eval_set]})",
                f"{per_seed} ({seeds})",
                f"{100 * contrast.mean:+.2f} pp",
                two_level,
                ci_text(contrast.pooled_ci),
            ]
        )
    return table(header, rows)


def ci_text(interval: tuple[float, float]) -> str:
    return f"[{100 * interval[0]:+.2f}, {100 * interval[1]:+.2f}] pp"


def table(header: list[str], rows: list[list[str]]) -> str:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, align] + rows)


# ------------------------------------------------------------------ records (CSV, JSON)


def arm_records(comparison: Comparison) -> list[dict]:
    """One record per arm and eval set: rates as fractions, counts, ledger means over seeds."""
    records = []
    for arm in comparison.rows:
        totals = (
            {key: arm.mean_total(key) for key in next(iter(arm.totals.values()))}
            if arm.totals
            else {}
        )
        for name in arm.grades:
            accuracies = arm.per_seed(name, lambda g: g.accuracy)
            mean, sd = mean_sd(accuracies)
            records.append(
                {
                    "table": "arms",
                    "arm": arm.arm,
                    "eval_set": name,
                    "items": comparison.eval_sets[name],
                    "seeds": arm.seeds,
                    "accuracy_mean": mean,
                    "accuracy_sd": sd,
                    "accuracy_per_seed": accuracies,
                    "cap_hits_per_seed": arm.per_seed(name, lambda g: g.cap_hits),
                    "incorrect_truncated_per_seed": arm.per_seed(
                        name, lambda g: g.incorrect_truncated
                    ),
                    **{f"mean_{key}": value for key, value in totals.items()},
                }
            )
    return records


def contrast_records(comparison: Comparison) -> list[dict]:
    return [contrast_record(c, comparison.eval_sets[c.eval_set]) for c in comparison.contrasts]


def contrast_record(contrast: Contrast, items: int) -> dict:
    two_level = contrast.two_level_ci or (None, None)
    return {
        "table": "contrasts",
        "arm": contrast.arm,
        "reference": contrast.reference,
        "eval_set": contrast.eval_set,
        "items": items,
        "metric": contrast.metric,
        "seeds": contrast.seeds,
        "diff_per_seed": contrast.per_seed,
        "diff_mean": contrast.mean,
        "two_level_ci_low": two_level[0],
        "two_level_ci_high": two_level[1],
        "pooled_ci_low": contrast.pooled_ci[0],
        "pooled_ci_high": contrast.pooled_ci[1],
        "item_gains": contrast.gains,
        "item_losses": contrast.losses,
    }


def to_csv(records: list[dict]) -> str:
    """Both tables in one CSV (the ``table`` column tells them apart); lists joined with ';'."""
    columns = list(dict.fromkeys(key for record in records for key in record))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow(
            {k: ";".join(map(str, v)) if isinstance(v, list) else v for k, v in record.items()}
        )
    return out.getvalue()
