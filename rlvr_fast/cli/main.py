"""``rlvr-fast``: train an arm, evaluate a model, and read runs back from the command line.

    rlvr-fast train --arm ra_flat --model tiny --steps 50 --eval test=synthetic:test:200 --out runs/x
    rlvr-fast train --arm baseline --model PATH --train-data math_train.json \\
        --eval math500=math500_test.json --seed 42 --out runs/baseline_s42
    rlvr-fast train ... --out runs/x --resume          # continue after a kill
    rlvr-fast train --nproc 2 --set questions_per_step=4 ...  # 2 data-parallel ranks (torchrun)
    torchrun --nproc_per_node 8 -m rlvr_fast.cli.main train --device cuda ...  # or torchrun itself
    rlvr-fast eval runs/x --eval test=synthetic:test:200
    rlvr-fast verify runs/x runs/y                     # re-derive ledgers and grades; exit 1 on FAIL
    rlvr-fast compare runs/* --reference baseline --format md|csv|json
    rlvr-fast report runs/* --out reports/x            # figures + report.md
    rlvr-fast sweep --arms baseline,ra_flat --seeds 42,101,7 --out sweeps/x [train options]
    rlvr-fast shapley-report runs/x                    # the Parallel-Shapley falsifier diagnostic
    rlvr-fast train --arm midpoint_ra_mst --active-steps 35 --steps 90 ...  # train to 35 active steps
    rlvr-fast select-data --model tiny --data synthetic:train:400 --k 8 --out zpd.json

Data arguments are a JSON/JSONL path or ``synthetic:SPLIT[:N]`` (the embedded arithmetic task).
Bad input exits with status 2 and one line on stderr naming the file, field or value, before
anything is written; an interrupted command exits with 130 and leaves nothing half-written.
A rank of a distributed run whose process group fails (another rank died or stopped
answering) exits with status 3 and one line on stderr (``rlvr_fast.train.distributed``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rlvr_fast.train import distributed
from rlvr_fast.analysis.compare import compare_paths
from rlvr_fast.analysis.tables import FORMATS, render
from rlvr_fast.analysis.verify import verify_paths
from rlvr_fast.train.arms import ARMS
from rlvr_fast.data.problems import MAX_PROBLEMS, DataError, load_problems, synthetic_problems
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.utils.files import write_json_atomic, write_text_atomic
from rlvr_fast.models.policy import load_policy
from rlvr_fast.run.directory import check_eval_name
from rlvr_fast.rollouts.selection import PassRange, SelectionSettings, select_data
from rlvr_fast.analysis.shapley_report import shapley_report
from rlvr_fast.rollouts.limits import MAX_BATCH, MAX_NEW_TOKENS
from rlvr_fast.train.trainer import RLVRTrainer, TrainConfig

# Every error a user's input can cause is a ValueError naming the input (DataError,
# ConfigError, CheckpointError, TokenizerError, StateFileError, RunDirectoryError, ...), or an
# OSError naming the file.
USER_ERRORS = (ValueError, OSError)
# Settings with their own option: --set may not give them a second value.
OPTION_SETTINGS = {"steps": "--steps", "seed": "--seed", "arm": "--arm"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line like every other error here."""

    def error(self, message: str):
        self.exit(2, f"rlvr-fast: error: {message.splitlines()[0]} (see {self.prog} --help)\n")


def load_data(spec: str, *, limit: int | None = None):
    """A path, or synthetic:SPLIT[:N] (N defaults to ``limit`` or 200; a ``limit`` above the
    size limit loads that many, which the trainer cycles through)."""
    if spec.startswith("synthetic:"):
        parts = spec.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdecimal()):
            raise ValueError(f"bad data spec {spec!r} (expected synthetic:SPLIT[:N])")
        count = int(parts[2]) if len(parts) == 3 else min(limit or 200, MAX_PROBLEMS)
        try:
            problems = synthetic_problems(parts[1], count)
        except ValueError as err:
            raise DataError(f"{spec}: {err}") from None
    else:
        problems = load_problems(spec, limit=limit)
    if not problems:
        raise DataError(f"{spec}: no problems")
    return problems


def parse_eval_sets(specs: list[str]) -> dict[str, list]:
    sets = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        if not sep or not name or not source:
            raise ValueError(f"--eval wants NAME=PATH or NAME=synthetic:SPLIT[:N], got {spec!r}")
        if name in sets:
            raise ValueError(f"--eval name {name!r} given twice")
        sets[check_eval_name(name)] = load_data(source)
    return sets


def parse_overrides(pairs: list[str]) -> dict:
    """--set key=value; values are read as JSON where they parse (1e-4, true, null, [0.9, 0.95])."""
    overrides = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set wants key=value, got {pair!r}")
        if key in OPTION_SETTINGS:
            raise ValueError(f"--set {key}: {key} is chosen with {OPTION_SETTINGS[key]}")
        try:
            overrides[key] = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            overrides[key] = raw
    return overrides


def parse_device(text: str) -> torch.device:
    """cpu or cuda[:N], the latter only where that GPU exists."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text!r}: expected cpu or cuda[:N]")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"--device {text}: {count} CUDA device(s) available")
    return device


def positive(what: str, value: int, most: int) -> int:
    if not 1 <= value <= most:
        raise ValueError(f"{what} must be in [1, {most:,}], got {value}")
    return value


DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="auto",
        help="weights and KV cache: auto = bf16 on CUDA (the study's), fp32 on CPU",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="decode eagerly on CUDA instead of replaying CUDA graphs",
    )


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="run as N data-parallel ranks on this host (torchrun); a step's "
        "questions_per_step questions are split over them",
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=distributed.DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="with several ranks: fail, instead of waiting, "
        "when another rank has not answered a collective within SECONDS",
    )


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """The options ``train`` and ``sweep`` share: model, data, steps, overrides, device."""
    parser.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face directory")
    parser.add_argument(
        "--train-data",
        default="synthetic:train",
        help="JSON/JSONL problems or synthetic:SPLIT[:N]; the first --steps are used",
    )
    parser.add_argument("--eval", action="append", default=[], metavar="NAME=DATA")
    parser.add_argument(
        "--steps",
        type=int,
        default=50,
        help="steps to train (with --active-steps: the most steps to train)",
    )
    parser.add_argument(
        "--active-steps", type=int, metavar="N", help="stop once N steps have run a backward pass"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any TrainConfig field, e.g. --set lr=1e-4",
    )
    parser.add_argument(
        "--untie",
        action="store_true",
        help="give a tied LM head its own weights (the study's P counts it)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_device_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="rlvr-fast", description="Fast GRPO for RLVR on math.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train one arm")
    train.add_argument("--arm", required=True, help=f"one of: {', '.join(ARMS)}")
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--out", type=Path, required=True, help="run directory")
    train.add_argument("--resume", action="store_true", help="continue the run in --out")
    train.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="write a Chrome trace of the first STEPS steps to OUT/trace.json",
    )
    add_training_options(train)
    add_launch_arguments(train)

    ev = commands.add_parser("eval", help="greedy evaluation of a model or a run directory")
    ev.add_argument("model", help="'tiny', a Hugging Face directory, or a run directory")
    ev.add_argument("--eval", action="append", required=True, metavar="NAME=DATA")
    ev.add_argument("--max-new-tokens", type=int, default=2048)
    ev.add_argument(
        "--max-batch", type=int, default=256, help="sequences decoded at once (continuous batching)"
    )
    add_device_arguments(ev)
    add_launch_arguments(ev)
    ev.add_argument("--out", type=Path, help="write NAME.jsonl and summary.json here")

    runs_help = "run directories, or directories holding them (a sweep's runs/)"
    verify = commands.add_parser("verify", help="re-derive run directories' ledgers and grades")
    verify.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help=runs_help)
    compare = commands.add_parser("compare", help="the study's tables over arms x seeds")
    compare.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help=runs_help)
    compare.add_argument(
        "--reference",
        metavar="ARM",
        help="arm the paired differences are taken against (default: the first)",
    )
    compare.add_argument("--format", choices=FORMATS, default="md")
    report = commands.add_parser("report", help="figures and report.md for run directories")
    report.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help=runs_help)
    report.add_argument("--out", type=Path, required=True, help="directory for report.md + PNGs")
    report.add_argument("--reference", metavar="ARM")
    sweep = commands.add_parser("sweep", help="train arms x seeds, then compare and report")
    sweep.add_argument(
        "--arms",
        required=True,
        help="comma-separated arms, the first is the reference of the paired differences",
    )
    sweep.add_argument("--seeds", default="42,101,7", help="comma-separated seeds")
    sweep.add_argument(
        "--out",
        type=Path,
        required=True,
        help="sweep directory: runs/, compare.{md,csv,json}, report/",
    )
    add_training_options(sweep)
    shapley = commands.add_parser(
        "shapley-report",
        help="falsifier diagnostic of a parallel-path run: Spearman(phi, "
        "masked-path drop in r_out), sum phi vs r_out and U(P), MC standard error; table + PNG",
    )
    shapley.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    shapley.add_argument("--out", type=Path, help="default RUN_DIR/shapley_report")
    shapley.add_argument("--max-steps", type=int, help="sample this many steps (default: all)")
    shapley.add_argument("--seed", type=int, default=0, help="step sample, bootstrap, MC draws")
    shapley.add_argument("--resamples", type=int, default=4000, help="bootstrap resamples")
    shapley.add_argument("--device", default="cpu", help="for regenerating summaries")
    select = commands.add_parser(
        "select-data",
        help="estimate each question's pass rate with K samples and keep those "
        "in a range (default 0 < pass < 1), stratified by subject and level, with their rates",
    )
    select.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face directory")
    select.add_argument("--data", required=True, help="JSON/JSONL problems or synthetic:SPLIT[:N]")
    select.add_argument("--k", type=int, default=8, help="samples per question (G)")
    select.add_argument(
        "--out",
        type=Path,
        required=True,
        help="selected problems with their pass rates (.json or .jsonl); "
        "OUT.progress.jsonl holds the rates measured so far, to resume",
    )
    select.add_argument("--min-pass", type=float, help="keep pass rates >= this (default: > 0)")
    select.add_argument("--max-pass", type=float, help="keep pass rates <= this (default: < 1)")
    select.add_argument("--limit", type=int, help="keep at most this many (a stratified prefix)")
    select.add_argument(
        "--gate-min-chars", type=int, help="grade with the derivation gate, as gated arms reward"
    )
    select.add_argument("--max-new-tokens", type=int, default=512)
    select.add_argument("--temperature", type=float, default=0.8)
    select.add_argument("--top-p", type=float, default=0.9)
    select.add_argument(
        "--batch-questions",
        type=int,
        default=16,
        help="questions sampled in one engine batch (and saved together)",
    )
    select.add_argument("--seed", type=int, default=42)
    select.add_argument(
        "--max-batch", type=int, default=256, help="sequences decoded at once (continuous batching)"
    )
    select.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_arguments(select)
    return parser


def comma_list(text: str, kind, what: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{what} wants a comma-separated list, got {text!r}") from None


def training_overrides(args) -> dict:
    """--set pairs, and --no-cuda-graphs and --active-steps as the TrainConfig fields they set."""
    overrides = parse_overrides(args.set)
    if args.no_cuda_graphs:
        overrides["cuda_graphs"] = False
    if args.active_steps is not None:
        overrides["active_steps"] = args.active_steps
    return overrides


def run_train(args) -> dict:
    overrides = training_overrides(args)
    config = TrainConfig.from_arm(args.arm, steps=args.steps, seed=args.seed, **overrides)
    if args.profile < 0:
        raise ValueError(f"--profile must be >= 0, got {args.profile}")
    device = parse_device(args.device)
    train_data = load_data(args.train_data, limit=config.questions_needed)
    eval_sets = parse_eval_sets(args.eval)
    device = distributed.init(str(device), args.dist_timeout)
    policy = load_policy(args.model, device=device, dtype=DTYPES[args.dtype], untie=args.untie)
    trainer = RLVRTrainer(
        policy,
        config,
        train_data,
        eval_sets,
        out_dir=args.out,
        resume=args.resume,
        progress=not args.quiet,
        profile_steps=args.profile,
    )
    summary = trainer.train()
    if distributed.is_main():
        print_train_table(summary)
    distributed.shutdown()
    return summary


def print_train_table(summary: dict) -> None:
    totals = summary["totals_this_run"]
    print(f"\narm {summary['arm']}, {summary['steps']} steps")
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
    print("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))


def run_eval(args) -> dict:
    model_path = Path(args.model)
    if (model_path / "final" / "config.json").is_file():
        model_path = model_path / "final"
    max_new_tokens = positive("--max-new-tokens", args.max_new_tokens, MAX_NEW_TOKENS)
    max_batch = positive("--max-batch", args.max_batch, MAX_BATCH)
    device = parse_device(args.device)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ValueError(f"{args.out}: exists and is not a directory")
    eval_sets = parse_eval_sets(args.eval)
    device = distributed.init(str(device), args.dist_timeout)
    policy = load_policy(
        args.model if args.model == "tiny" else model_path, device=device, dtype=DTYPES[args.dtype]
    )
    engine = RolloutEngine.for_policy(
        policy, max_batch=max_batch, cuda_graphs=not args.no_cuda_graphs
    )
    # On several ranks each decodes its share of a set; rank 0 prints and writes the whole.
    main_rank = distributed.is_main()
    summaries = {}
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
        if not main_rank:
            continue
        print(
            f"{name}: {summaries[name]['correct']}/{summaries[name]['items']} = "
            f"{summaries[name]['accuracy']:.1%}, cap hits {summaries[name]['cap_hits']}"
        )
        if args.out:
            write_text_atomic(
                args.out / f"{name}.jsonl",
                "".join(json.dumps(i.to_json()) + "\n" for i in result.items),
            )
    if args.out and main_rank:
        write_json_atomic(args.out / "summary.json", summaries)
    distributed.shutdown()
    return summaries


def run_verify(args) -> bool:
    lines, ok = verify_paths(args.runs)
    print("\n".join(lines))
    return ok


def run_compare(args) -> None:
    comparison = compare_paths(args.runs, reference=args.reference)
    sys.stdout.write(render(comparison, args.format))


def run_report(args) -> None:
    # matplotlib loads only for the commands that draw.
    from rlvr_fast.analysis.report import write_report

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
    tables = sweep(
        plan,
        args.out,
        train_data,
        eval_sets,
        lambda: load_policy(args.model, device=device, dtype=DTYPES[args.dtype], untie=args.untie),
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
    )
    print(result.describe())
    return result.counts()


def without_nproc(argv: list[str]) -> list[str]:
    """The command line each rank runs: ``argv`` without --nproc N."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handlers = {
        "train": run_train,
        "eval": run_eval,
        "compare": run_compare,
        "report": run_report,
        "sweep": run_sweep,
        "shapley-report": run_shapley_report,
        "select-data": run_select_data,
    }
    try:
        if args.command == "verify":
            return 0 if run_verify(args) else 1
        if getattr(args, "nproc", 1) != 1:
            return distributed.launch(without_nproc(argv), args.nproc)
        handlers[args.command](args)
    except USER_ERRORS as err:
        print(f"rlvr-fast: error: {error_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlvr-fast: interrupted", file=sys.stderr)
        return 130
    except distributed.ProcessGroupError as err:
        print(f"rlvr-fast: error: {err}", file=sys.stderr)
        return 3
    return 0


def error_line(err: Exception) -> str:
    """One line: the message's first line; an OSError's file and reason."""
    if isinstance(err, OSError) and err.strerror:
        where = err.filename if err.filename is not None else type(err).__name__
        return f"{where}: {err.strerror}"
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
