"""Each command's work after its arguments are parsed: load, hand over, print."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rlvr_fast.cli.options import (
    DTYPES,
    comma_list,
    load_data,
    parse_device,
    parse_eval_sets,
    positive,
    training_overrides,
)


from rlvr_fast.analysis.compare import compare_paths
from rlvr_fast.analysis.shapley_report import shapley_report
from rlvr_fast.analysis.tables import render
from rlvr_fast.analysis.verify import verified_runs, verify_paths
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.models.policy import load_policy
from rlvr_fast.rollouts.evaluation import encode_prompts
from rlvr_fast.rollouts.limits import MAX_BATCH, MAX_NEW_TOKENS
from rlvr_fast.rollouts.selection import PassRange, SelectionSettings, select_data
from rlvr_fast.run.eval_output import EvalOutput
from rlvr_fast.run.directory import read_run_meta
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.run.loggers import parse_report_to
from rlvr_fast.train import distributed
from rlvr_fast.ledger.metrics import step_metrics
from rlvr_fast.run.reader import read_jsonl
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.monitor import Monitoring
from rlvr_fast.train.precision import load_dtype, resolve_precision
from rlvr_fast.train.trainer import RLVRTrainer


def train_inputs(args):
    """What ``train`` checks before anything runs (``--nproc`` checks it before starting a
    rank): the settings, the monitoring, the device and the data."""
    overrides = training_overrides(args)
    config = TrainConfig.from_arm(args.arm, steps=args.steps, seed=args.seed, **overrides)
    if args.profile < 0:
        raise ValueError(f"--profile must be >= 0, got {args.profile}")
    device = parse_device(args.device)
    train_data = load_data(args.train_data, limit=config.questions_needed)
    monitoring(args)  # checked here: --nproc checks before starting a rank
    return config, device, train_data, parse_eval_sets(args.eval)


def run_train(args) -> dict:
    started = time.perf_counter()
    config, device, train_data, eval_sets = train_inputs(args)
    device = distributed.init(str(device), args.dist_timeout)
    dtype = load_dtype(resolve_precision(config.precision, device))
    policy = load_policy(args.model, device=device, dtype=dtype, untie=args.untie)
    trainer = RLVRTrainer(
        policy,
        config,
        train_data,
        eval_sets,
        out_dir=args.out,
        resume=args.resume,
        progress=not args.quiet,
        profile_steps=args.profile,
        monitoring=monitoring(args),
    )
    summary = trainer.train()
    if distributed.is_main():
        print_train_table(summary, args.out, time.perf_counter() - started)
    distributed.shutdown()
    return summary


def print_train_table(summary: dict, run_dir: Path, wall_seconds: float) -> None:
    """The end of a run: its figures first (reward over the training steps, from its ledger;
    held-out accuracy before -> after), where it is and how long it took, then the token and
    FLOP accounting."""
    totals = summary["totals_this_run"]
    print(f"\narm {summary['arm']}, {summary['steps']} steps")
    print(f"  {reward_line(RunLayout(run_dir).ledger)}")
    print_evaluations(summary)
    print(f"  run directory {run_dir}, wall time {wall_seconds:.0f} s")
    print(
        "  tokens: "
        + ", ".join(
            f"{k} {int(totals.get(k, 0)):,}"
            for k in ("gen", "pref", "pad_pref", "untrim_gen", "bwd_out", "bwd_full")
        )
    )
    print(
        f"  executed: prefill {int(totals.get('prefill_run', 0)):,} tokens, decode "
        f"{int(totals.get('decode_rows', 0)):,} rows, {int(totals.get('block_copies', 0)):,} "
        f"block copies (the seed's pref / untrim_gen above)"
    )
    print(
        "  TFLOPs: "
        + ", ".join(
            f"{label} {totals.get(k, 0) / 1e12:.4f}"
            for label, k in (
                ("Out", "flops_out"),
                ("Full", "flops_full"),
                ("PadFull", "flops_pad_full"),
            )
        )
    )
    phases = {k.removeprefix("seconds_"): v for k, v in totals.items() if k.startswith("seconds_")}
    print(
        "  seconds per phase: "
        + ", ".join(f"{PHASE_LABELS.get(k, k)} {v:.1f}" for k, v in phases.items())
    )


# What the summary calls a phase whose ledger name says what it serves, not what it does.
PHASE_LABELS = {"reward": "grading"}


def reward_line(ledger: Path) -> str:
    """The training groups' reward at the start and the end of the run (the mean of its first
    and last steps, up to 10 each) and how many steps ran a backward pass."""
    metrics = [step_metrics(line) for line in read_jsonl(ledger)]
    rewards = [m["reward"] for m in metrics if "reward" in m]
    active = sum(int(m["active"]) for m in metrics)
    if not rewards:
        return f"no rewards recorded; {active} of {len(metrics)} steps ran a backward pass"
    window = max(1, min(10, len(rewards) // 2))
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    return (
        f"reward {first:.3f} -> {last:.3f} (mean of the first and last {window} steps), "
        f"{active} of {len(metrics)} steps ran a backward pass"
    )


def print_evaluations(summary: dict) -> None:
    """Held-out accuracy before -> after (and of the Polyak average)."""
    for name, after in summary.get("eval_after", {}).items():
        before = summary.get("eval_before", {}).get(name)
        if before:
            print(
                f"  {name}: accuracy {before['accuracy']:.1%} -> {after['accuracy']:.1%}, "
                f"short answers {before['short_guess_fraction']:.1%} -> "
                f"{after['short_guess_fraction']:.1%}, cap hits {before['cap_hits']} -> "
                f"{after['cap_hits']}"
            )
        else:
            print(
                f"  {name}: accuracy {after['accuracy']:.1%}, short answers "
                f"{after['short_guess_fraction']:.1%}, cap hits {after['cap_hits']}"
            )
    if "polyak" in summary:
        polyak = summary["polyak"]
        window = (
            f"steps {polyak['first_step']}..{summary['steps']}"
            if polyak["steps_averaged"]
            else "no steps (the run ended first)"
        )
        print(f"  Polyak average of {window}, saved as final_polyak/")
        for name, result in summary.get("eval_polyak", {}).items():
            print(
                f"  {name} (Polyak average): accuracy {result['accuracy']:.1%}, short answers "
                f"{result['short_guess_fraction']:.1%}, cap hits {result['cap_hits']}"
            )


def monitoring(args) -> Monitoring:
    """--log-every, --report-to, --eval-every, --save-every and --save-total-limit."""
    if args.eval_every and not args.eval:
        raise ValueError("--eval-every N evaluates the --eval sets: give at least one")
    return Monitoring(
        log_every=args.log_every,
        report_to=parse_report_to(args.report_to),
        eval_every=args.eval_every,
        save_every=args.save_every,
        save_total_limit=args.save_total_limit,
    )


def eval_inputs(args):
    """What ``eval`` checks before anything runs (``--nproc`` checks it before starting a
    rank): the model path, the limits, the device, the output directory and the eval sets."""
    model_path = Path(args.model)
    # A run directory evaluates its final model, which a running (or stopped) run has not yet.
    if (RunLayout(model_path).model() / "config.json").is_file():
        model_path = RunLayout(model_path).model()
    elif read_run_meta(model_path) is not None:
        raise ValueError(
            f"{model_path}: a run that has not finished (no {RunLayout(model_path).model().name}/ "
            "yet): it is still running, or was stopped (train --resume finishes it)"
        )
    max_new_tokens = positive("--max-new-tokens", args.max_new_tokens, MAX_NEW_TOKENS)
    max_batch = positive("--max-batch", args.max_batch, MAX_BATCH)
    device = parse_device(args.device)
    out = EvalOutput(args.out) if args.out is not None else None
    if out is not None:
        out.check()
    eval_sets = parse_eval_sets(args.eval)
    return model_path, max_new_tokens, max_batch, device, out, eval_sets


def run_eval(args) -> dict:
    model_path, max_new_tokens, max_batch, device, out, eval_sets = eval_inputs(args)
    device = distributed.init(str(device), args.dist_timeout)
    # On several ranks each decodes its share of a set; rank 0 prints and writes the whole.
    main_rank = distributed.is_main()
    policy = load_policy(
        args.model if args.model == "tiny" else model_path, device=device, dtype=DTYPES[args.dtype]
    )
    # Every set's prompts fit the model before any set is decoded or anything written.
    for problems in eval_sets.values():
        encode_prompts(policy, problems, max_new_tokens)
    if out is not None and main_rank:
        out.open()
    engine = RolloutEngine.for_policy(
        policy, max_batch=max_batch, cuda_graphs=not args.no_cuda_graphs
    )
    summaries, items = {}, {}
    for name, problems in eval_sets.items():
        result = distributed.evaluate_sharded(
            policy,
            problems,
            max_new_tokens=max_new_tokens,
            desc=f"eval {name}",
            engine=engine,
            progress=main_rank,
        )
        summaries[name] = result.summary()
        items[name] = [item.to_json() for item in result.items]
        if main_rank:
            print(
                f"{name}: {summaries[name]['correct']}/{summaries[name]['items']} = "
                f"{summaries[name]['accuracy']:.1%}, cap hits {summaries[name]['cap_hits']}"
            )
    if out is not None and main_rank:
        out.write(items, summaries)
    distributed.shutdown()
    return summaries


def run_verify(args) -> bool:
    lines, ok = verify_paths(args.runs)
    print("\n".join(lines))
    return ok


def check_verified(args) -> None:
    """compare and report pool only runs that pass verify (``--allow-unverified``: include the
    others, with a warning line each on stderr)."""
    for line in verified_runs(args.runs, allow_unverified=args.allow_unverified):
        print(line, file=sys.stderr)


def run_compare(args) -> None:
    check_verified(args)
    comparison = compare_paths(args.runs, reference=args.reference)
    sys.stdout.write(render(comparison, args.format))


def run_report(args) -> None:
    # matplotlib loads only for the commands that draw.
    from rlvr_fast.analysis.report import write_report

    check_verified(args)
    for path in write_report(args.runs, args.out, reference=args.reference):
        print(path)


def run_sweep(args) -> None:
    from rlvr_fast.analysis.sweep import plan_sweep, run_sweep as sweep

    plan = plan_sweep(
        comma_list(args.arms, str, "--arms"),
        comma_list(args.seeds, int, "--seeds"),
        args.out,
        steps=args.steps,
        **training_overrides(args),
    )
    train_data = load_data(args.train_data, limit=max(run.config.questions_needed for run in plan))
    eval_sets = parse_eval_sets(args.eval)
    device = parse_device(args.device)
    distributed.select_device(device)
    dtype = load_dtype(resolve_precision(plan[0].config.precision, device))
    tables = sweep(
        plan,
        args.out,
        train_data,
        eval_sets,
        lambda: load_policy(args.model, device=device, dtype=dtype, untie=args.untie),
        progress=not args.quiet,
    )
    print(tables, end="")
    print(f"compare tables: {args.out / 'compare.md'}; report: {args.out / 'report' / 'report.md'}")


def run_shapley_report(args) -> dict:
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.resamples < 1:
        raise ValueError(f"--resamples must be >= 1, got {args.resamples}")
    report = shapley_report(
        args.run_dir,
        out_dir=args.out,
        max_steps=args.max_steps,
        seed=args.seed,
        resamples=args.resamples,
        device=parse_device(args.device),
    )
    print(report["table"], end="")
    return report


def run_select_data(args) -> dict:
    settings = SelectionSettings(
        model=args.model,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        gate_min_chars=args.gate_min_chars,
        seed=args.seed,
    )
    pass_range = PassRange(args.min_pass, args.max_pass)
    if args.batch_questions < 1:
        raise ValueError(f"--batch-questions must be >= 1, got {args.batch_questions}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    max_batch = positive("--max-batch", args.max_batch, MAX_BATCH)
    device = parse_device(args.device)
    problems = load_data(args.data)
    policy = load_policy(args.model, device=device, dtype=DTYPES[args.dtype])
    engine = RolloutEngine.for_policy(
        policy, max_batch=max_batch, cuda_graphs=not args.no_cuda_graphs
    )
    result = select_data(
        policy,
        engine,
        problems,
        settings,
        pass_range,
        args.out,
        limit=args.limit,
        batch_questions=args.batch_questions,
        progress=not args.quiet,
        data_path=None if args.data.startswith("synthetic:") else Path(args.data),
    )
    print(result.describe())
    return result.counts()
