"""What the commands share: the data, eval-set, override and device arguments, and the one-line
error parser."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rlvr_fast.data.problems import MAX_PROBLEMS, DataError, load_problems
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.run.directory import check_eval_name
from rlvr_fast.train import distributed
from rlvr_fast.train.precision import (
    COMPUTE_DTYPES,
    PRECISION_ALIASES,
    PRECISIONS,
    canonical_precision,
)
from rlvr_fast.train.sharding import SHARDINGS


# Every error a user's input can cause is a ValueError naming the input (DataError,
# ConfigError, CheckpointError, TokenizerError, StateFileError, RunDirectoryError, ...), or an
# OSError naming the file.
USER_ERRORS = (ValueError, OSError)


# Settings with their own option: --set may not give them a second value.
OPTION_SETTINGS = {
    "steps": "--steps",
    "seed": "--seed",
    "arm": "--arm",
    "precision": "--precision",
    "shard": "--shard",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, where it has one worth showing (not None, an
    off flag or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in action.help:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line like every other error here, and every
    option's default in --help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

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
    """cpu or cuda[:N], the latter only where that GPU exists; auto: cuda where torch sees a GPU,
    else cpu."""
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text!r}: expected auto, cpu or cuda[:N]")
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
# What --dtype means for training when --precision is not given: the dtype the model computes
# and the engine decodes in; bf16 keeps fp32 masters unless bf16-true is asked for by name.
DTYPE_PRECISIONS = {"bf16": "bf16-mixed", "fp32": "fp32"}


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when torch sees a GPU, else cpu), cpu or cuda[:N]; several ranks on "
        "cuda take cuda:LOCAL_RANK each",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="auto",
        help="weights and KV cache: auto = bf16 on CUDA, fp32 on CPU; in train and sweep "
        "bf16 means --precision bf16-mixed and fp32 --precision fp32",
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


def add_monitoring_arguments(parser: argparse.ArgumentParser) -> None:
    """How ``train`` reports while it trains (``rlvr_fast.train.monitor``): nothing here changes
    what it trains, so a resume may change any of it."""
    parser.add_argument(
        "--log-every",
        type=int,
        default=0,
        metavar="N",
        help="print one line of the step's figures (reward, accuracy, loss, grad norm, KL, "
        "entropy, clip fraction when on) every N steps (default 0: none; the progress bar "
        "shows the latest step's)",
    )
    parser.add_argument(
        "--report-to",
        default="none",
        metavar="LOGGERS",
        help="none, or a comma-separated list of tensorboard (OUT/tensorboard/) and wandb "
        "(OUT/wandb/, offline without a login): every step's figures and every evaluation "
        "as scalars, tagged train/NAME and eval/SET/NAME as TRL's are",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate the --eval sets every N steps too (OUT/evals/step-N/, a line of "
        "OUT/eval_steps.jsonl and of output each; default 0: before and after training only)",
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="save a Hugging Face checkpoint every N steps as OUT/checkpoint-N/ (what "
        "transformers and rlvr-fast eval load; default 0: final/ only)",
    )
    parser.add_argument(
        "--save-total-limit",
        type=int,
        metavar="K",
        help="keep the newest K of the run's checkpoint-N/ directories, deleting its older ones "
        "(default: keep all)",
    )


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """The options ``train`` and ``sweep`` share: model, data, steps, overrides, device."""
    parser.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face directory")
    parser.add_argument(
        "--train-data",
        default="synthetic:train",
        help="JSON/JSONL problems or synthetic:SPLIT[:N]; the first --steps are used",
    )
    parser.add_argument(
        "--eval",
        action="append",
        default=[],
        metavar="NAME=DATA",
        help="a held-out set, evaluated greedily before the first step and after the last "
        "(repeatable; DATA as --train-data)",
    )
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
    parser.add_argument(
        "--precision",
        choices=(*PRECISIONS, *PRECISION_ALIASES),
        help="fp32; bf16-mixed (bf16 compute, fp32 master weights, gradients and moments; "
        "the default on CUDA); fp16-mixed (the same in fp16 with a dynamic loss scale); "
        "bf16-true (the study's bf16 weights stepped directly). Lightning's names are aliases: "
        + ", ".join(f"{alias} = {name}" for alias, name in PRECISION_ALIASES.items())
        + ". Default: bf16-mixed on CUDA, fp32 elsewhere; --dtype bf16 alone means bf16-mixed",
    )
    parser.add_argument(
        "--shard",
        choices=SHARDINGS,
        help="fsdp: shard weights, gradients and optimizer state over the --nproc ranks "
        "(FSDP2); the rollout engine keeps a full copy, gathered from the shards after each step",
    )
    add_device_arguments(parser)


class SettingsHelp(argparse.Action):
    """``--help-settings``: every setting by section, then exit (as --help does)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from rlvr_fast.cli.reference import settings_text

        sys.stdout.write(settings_text())
        parser.exit(0)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config, --print-config and --help-settings (``rlvr_fast.cli.config_file``)."""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a YAML file of options (their names with _) and settings, as --print-config "
        "writes it; options on the command line override it, --set its settings",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved options and every setting as YAML for --config, and exit "
        "without training",
    )
    parser.add_argument(
        "--help-settings",
        action=SettingsHelp,
        help="list every setting (--set KEY=VALUE) by section with its type, default and help",
    )


def comma_list(text: str, kind, what: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{what} wants a comma-separated list, got {text!r}") from None


def training_overrides(args) -> dict:
    """A --config file's settings, --set pairs over them, and --no-cuda-graphs, --active-steps, --precision and --dtype as the
    TrainConfig fields they set."""
    overrides = {**getattr(args, "config_settings", {}), **parse_overrides(args.set)}
    if args.no_cuda_graphs:
        overrides["cuda_graphs"] = False
    if args.active_steps is not None:
        overrides["active_steps"] = args.active_steps
    if args.shard is not None:
        overrides["shard"] = args.shard
    precision = training_precision(args.precision, args.dtype)
    if precision is not None:
        overrides["precision"] = precision
    return overrides


def training_precision(precision: str | None, dtype: str) -> str | None:
    """--precision, or the one --dtype implies; None (the device's default) when neither is
    given. A --dtype other than the precision's compute dtype is refused."""
    if precision is not None:
        precision = canonical_precision(precision)
    if dtype == "auto":
        return precision
    if precision is None:
        return DTYPE_PRECISIONS[dtype]
    if COMPUTE_DTYPES[precision] != DTYPES[dtype]:
        raise ValueError(f"--dtype {dtype} contradicts --precision {precision}")
    return precision
