"""``rlvr-fast``: train an arm, evaluate a model, and read runs back from the command line.

    rlvr-fast train --arm ra_flat --model tiny --steps 50 --eval test=synthetic:test:200 --out runs/x
    rlvr-fast train --arm baseline --model PATH --train-data math_train.json \\
        --eval math500=math500_test.json --seed 42 --out runs/baseline_s42
    rlvr-fast train ... --out runs/x --resume          # continue after a kill
    rlvr-fast train --nproc 2 --set questions_per_step=4 ...  # 2 data-parallel ranks (torchrun)
    torchrun --nproc_per_node 8 -m rlvr_fast.cli train --device cuda ...  # or torchrun itself
    rlvr-fast eval runs/x --eval test=synthetic:test:200
    rlvr-fast verify runs/x runs/y                     # re-derive ledgers and grades; exit 1 on FAIL
    rlvr-fast compare runs/* --reference baseline --format md|csv|json  # verified runs only
    rlvr-fast report runs/* --out reports/x            # figures + report.md
    rlvr-fast sweep --arms baseline,ra_flat --seeds 42,101,7 --out sweeps/x [train options]
    rlvr-fast shapley-report runs/x                    # the Parallel-Shapley falsifier diagnostic
    rlvr-fast train --arm midpoint_ra_mst --active-steps 35 --steps 90 ...  # train to 35 active steps
    rlvr-fast select-data --model tiny --data synthetic:train:400 --k 8 --out zpd.json
    rlvr-fast plan --model DIR --device-memory 24GB --group-size 8  # the memory plan; exit 2

Data arguments are a JSON/JSONL path or ``synthetic:SPLIT[:N]`` (the embedded arithmetic task).
Bad input exits with status 2 and one line on stderr naming the file, field or value, before
anything is written; an interrupted command exits with 130 and leaves nothing half-written; one
whose standard output is closed early (a pipe into ``head``) exits with 141, silently.
A rank of a distributed run whose process group fails (another rank died or stopped
answering) exits with status 3 and one line on stderr (``rlvr_fast.train.distributed``), as
does a writer whose lock file was removed or replaced while it ran (``rlvr_fast.utils.locks``):
it writes nothing more, since another process may be writing there.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path
from rlvr_fast.cli.commands import (
    eval_inputs,
    run_compare,
    run_eval,
    run_report,
    run_select_data,
    run_shapley_report,
    run_sweep,
    run_train,
    run_verify,
    train_inputs,
)
from rlvr_fast.cli.config_file import apply_config_file, config_path, resolved_config_yaml
from rlvr_fast.cli.options import (
    USER_ERRORS,
    ArgumentParser,
    add_config_arguments,
    add_device_arguments,
    add_launch_arguments,
    add_monitoring_arguments,
    add_training_options,
)


from rlvr_fast import __version__
from rlvr_fast.analysis.tables import FORMATS
from rlvr_fast.train import distributed
from rlvr_fast.train.arms import ARMS
from rlvr_fast.cli.plan import PLAN_DESCRIPTION, add_plan_arguments, run_plan
from rlvr_fast.utils.locks import LockLostError


def build_parser(config: Path | None = None) -> argparse.ArgumentParser:
    """The ``rlvr-fast`` parser; ``config``: a ``train --config`` file whose options and settings
    are the train command's defaults."""
    parser = ArgumentParser(prog="rlvr-fast", description="Fast GRPO for RLVR on math.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_command(commands, config)
    add_eval_command(commands)
    add_reading_commands(commands)
    add_study_commands(commands)
    plan = commands.add_parser(
        "plan", help="size a run to a device's memory", description=PLAN_DESCRIPTION
    )
    add_plan_arguments(plan)
    return parser


def add_train_command(commands, config: Path | None) -> None:
    train = commands.add_parser(
        "train",
        help="train one arm",
        description="Train one arm on a model and write a run directory. Options may come from "
        "a --config FILE (YAML; --print-config writes one); --set KEY=VALUE gives any setting "
        "(--help-settings lists them by section).",
    )
    train.add_argument("--arm", required=True, help=f"one of: {', '.join(ARMS)}")
    train.add_argument(
        "--seed", type=int, default=42, help="seed of every rollout draw and of the run's order"
    )
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
    add_monitoring_arguments(train)
    add_config_arguments(train)
    if config is not None:
        apply_config_file(train, config)


def add_eval_command(commands) -> None:
    ev = commands.add_parser("eval", help="greedy evaluation of a model or a run directory")
    ev.add_argument("model", help="'tiny', a Hugging Face directory, or a run directory")
    ev.add_argument(
        "--eval",
        action="append",
        required=True,
        metavar="NAME=DATA",
        help="a set to evaluate: a JSON/JSONL path or synthetic:SPLIT[:N] (repeatable)",
    )
    ev.add_argument("--max-new-tokens", type=int, default=2048, help="cap on each response")
    ev.add_argument(
        "--max-batch", type=int, default=256, help="sequences decoded at once (continuous batching)"
    )
    add_device_arguments(ev)
    add_launch_arguments(ev)
    ev.add_argument("--out", type=Path, help="write NAME.jsonl and summary.json here")


def add_reading_commands(commands) -> None:
    """verify, compare, report: run directories read back."""
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
    compare.add_argument("--format", choices=FORMATS, default="md", help="table format")
    unverified_help = (
        "include runs that fail verify (or were recorded under other package versions), "
        "with a warning line each; by default they are refused"
    )
    compare.add_argument("--allow-unverified", action="store_true", help=unverified_help)
    report = commands.add_parser("report", help="figures and report.md for run directories")
    report.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help=runs_help)
    report.add_argument("--out", type=Path, required=True, help="directory for report.md + PNGs")
    report.add_argument(
        "--reference",
        metavar="ARM",
        help="arm the paired differences are taken against (default: the first)",
    )
    report.add_argument("--allow-unverified", action="store_true", help=unverified_help)


def add_study_commands(commands) -> None:
    """sweep, shapley-report and select-data: the study's grids, diagnostic and data."""
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
    shapley.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a run of a parallel-path arm"
    )
    shapley.add_argument("--out", type=Path, help="default RUN_DIR/shapley_report")
    shapley.add_argument("--max-steps", type=int, help="sample this many steps (default: all)")
    shapley.add_argument("--seed", type=int, default=0, help="step sample, bootstrap, MC draws")
    shapley.add_argument("--resamples", type=int, default=4000, help="bootstrap resamples")
    shapley.add_argument(
        "--device", default="auto", help="for regenerating summaries: auto, cpu or cuda[:N]"
    )
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
        "OUT.rates.jsonl holds the rates measured so far, to resume",
    )
    select.add_argument("--min-pass", type=float, help="keep pass rates >= this (default: > 0)")
    select.add_argument("--max-pass", type=float, help="keep pass rates <= this (default: < 1)")
    select.add_argument("--limit", type=int, help="keep at most this many (a stratified prefix)")
    select.add_argument(
        "--gate-min-chars", type=int, help="grade with the derivation gate, as gated arms reward"
    )
    select.add_argument("--max-new-tokens", type=int, default=512, help="cap on each sample")
    select.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    select.add_argument("--top-p", type=float, default=0.9, help="nucleus of the top-p rule")
    select.add_argument(
        "--batch-questions",
        type=int,
        default=16,
        help="questions sampled in one engine batch (and saved together)",
    )
    select.add_argument("--seed", type=int, default=42, help="seed of the samples")
    select.add_argument(
        "--max-batch", type=int, default=256, help="sequences decoded at once (continuous batching)"
    )
    select.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_arguments(select)


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
    try:
        args = build_parser(config_path(argv)).parse_args(argv)
    except USER_ERRORS as err:
        print(f"rlvr-fast: error: {error_line(err)}", file=sys.stderr)
        return 2
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
        if args.command == "train" and args.print_config:
            print(resolved_config_yaml(args, train_inputs(args)[0]), end="")
            status = 0
        elif args.command == "verify":
            status = 0 if run_verify(args) else 1
        elif args.command == "plan":
            status = run_plan(args)
        elif getattr(args, "nproc", 1) != 1:
            # Bad arguments fail here, once, not in each of N ranks after they started.
            {"train": train_inputs, "eval": eval_inputs}[args.command](args)
            status = distributed.launch(without_nproc(argv), args.nproc)
        else:
            handlers[args.command](args)
            status = 0
        sys.stdout.flush()  # a closed pipe fails here, inside these handlers, not at exit
    except BrokenPipeError:
        # The reader of stdout went away (``rlvr-fast verify ... | head``): exit as a process
        # killed by SIGPIPE would, quietly, and keep Python's flush at exit from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except USER_ERRORS as err:
        print(f"rlvr-fast: error: {error_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # A second Ctrl-C while the interpreter exits (atexit: lock files, grading workers)
        # would print a traceback after this line.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("rlvr-fast: interrupted", file=sys.stderr)
        return 130
    except (distributed.ProcessGroupError, LockLostError) as err:
        print(f"rlvr-fast: error: {err}", file=sys.stderr)
        return 3
    except (MemoryError, RuntimeError) as err:
        line = out_of_memory_line(err)
        if line is None:
            raise
        print(f"rlvr-fast: error: {line}", file=sys.stderr)
        return 2
    return status


def error_line(err: Exception) -> str:
    """One line: the message's first line; an OSError's file and reason."""
    if isinstance(err, OSError) and err.strerror:
        where = err.filename if err.filename is not None else type(err).__name__
        return f"{where}: {err.strerror}"
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


# What torch's CPU and CUDA allocators say when an allocation fails (a RuntimeError each).
ALLOCATOR_FAILURE = re.compile(
    r"DefaultCPUAllocator: can't allocate memory: you tried to allocate \d+ bytes"
    r"|CUDA out of memory\. Tried to allocate [^.(]*"
)


def out_of_memory_line(err: BaseException) -> str | None:
    """One line for an allocation that failed (Python's MemoryError, or torch's allocator),
    naming the settings that size the work; None for any other error."""
    failure = ALLOCATOR_FAILURE.search(str(err))
    if isinstance(err, MemoryError):
        what = "out of memory"
    elif failure is not None:
        what = failure.group(0).strip()
    else:
        return None
    return (
        f"{what}; the run's work does not fit this machine: lower group_size, max_batch, "
        "max_new_tokens or questions_per_step (--set KEY=VALUE)"
    )
