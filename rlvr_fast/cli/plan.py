"""``rlvr-fast plan``: the memory plan of a run (``rlvr_fast.train.memory_plan``) as a table on
stdout, or one line naming the largest term and exit status 2 when it cannot fit.

    python -m rlvr_fast.cli.plan --model DIR|config.json --device-memory 24GiB [...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlvr_fast.cli.options import ArgumentParser
from rlvr_fast.models.config import ConfigError, ModelConfig
from rlvr_fast.models.lora import LoraSettings
from rlvr_fast.train.memory_plan import PlanError, RunShape, plan_memory
from rlvr_fast.train.memory_terms import ADAMW_STEPS, PRECISIONS
from rlvr_fast.train.sharding import SHARDINGS
from rlvr_fast.train.stepping import OPTIMIZERS
from rlvr_fast.utils.sizes import parse_size


PUBLISHED_CONFIGS = Path(__file__).parents[1] / "assets" / "configs"


def read_config(path: str) -> ModelConfig:
    """A checkpoint directory's config.json, a config.json itself, or by name one of the published
    configurations kept in the package (``qwen3-8b-base``: assets/configs/qwen3-8b-base.json)."""
    where = Path(path)
    if not where.exists() and (PUBLISHED_CONFIGS / f"{path}.json").is_file():
        where = PUBLISHED_CONFIGS / f"{path}.json"
    return ModelConfig.from_file(where / "config.json" if where.is_dir() else where)


PLAN_DESCRIPTION = "What a GRPO run holds on one device, term by term; exit 2 if it cannot fit."


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m rlvr_fast.cli.plan", description=PLAN_DESCRIPTION)
    add_plan_arguments(parser)
    return parser


def size_argument(text: str) -> int:
    """``parse_size`` for argparse, whose error then says why (not "invalid value")."""
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan's options (``rlvr-fast plan`` and ``python -m rlvr_fast.cli.plan``)."""
    defaults = RunShape()
    parser.add_argument(
        "--model",
        required=True,
        help="checkpoint directory, config.json, or a published config by name "
        f"({', '.join(sorted(p.stem for p in PUBLISHED_CONFIGS.glob('*.json')))})",
    )
    parser.add_argument("--device-memory", required=True, type=size_argument, help="e.g. 80GiB")
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default=defaults.precision,
        help="the run's training precision",
    )
    for name, help_text in (
        ("group_size", "rollouts per question (G)"),
        ("questions_per_step", "questions per step (Q)"),
        ("prompt_tokens", "the longest prompt's tokens"),
        ("max_new_tokens", "completion cap"),
        ("max_batch", "engine rows per pass"),
        ("kv_blocks", "KV cache blocks (default: sized from what is left)"),
        ("max_model_len", "the longest sequence the engine's graphs cover"),
        ("loss_chunk_tokens", "tokens per fused-loss chunk (default: about 2^25 logits)"),
    ):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(defaults, name), help=help_text)
    parser.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=defaults.kv_memory_fraction,
        help="share of what is left that the KV cache takes",
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each decoder layer"
    )
    parser.add_argument("--eager-loss", action="store_true", help="the eager reference loss")
    parser.add_argument("--untie", action="store_true", help="train a tied LM head on its own")
    parser.add_argument(
        "--no-cuda-graphs", action="store_true", help="no CUDA-graph pool (eager decode)"
    )
    parser.add_argument(
        "--adamw-step",
        choices=ADAMW_STEPS,
        default=defaults.adamw_step,
        help="torch's AdamW: foreach (its CUDA default), fused (adamw_fused), single-tensor",
    )
    parser.add_argument(
        "--optimizer", choices=OPTIMIZERS, default=defaults.optimizer, help="adamw or adafactor"
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks (with --shard: per rank)")
    parser.add_argument("--shard", choices=SHARDINGS, help="fsdp: one rank of a sharded run")
    parser.add_argument("--judge-model", help="a judge checkpoint directory or config.json")
    parser.add_argument("--lora-r", type=int, help="LoRA rank: adapters on a frozen model")
    parser.add_argument(
        "--lora-target-modules",
        default="q_proj,v_proj",
        help="LoRA's projections: comma-separated names, or all-linear",
    )


def main(argv: list[str] | None = None) -> int:
    return run_plan(build_parser().parse_args(argv))


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan's table (exit status 0), or one line naming why it cannot fit (2)."""
    try:
        run = RunShape(
            precision=args.precision,
            group_size=args.group_size,
            questions_per_step=args.questions_per_step,
            prompt_tokens=args.prompt_tokens,
            max_new_tokens=args.max_new_tokens,
            max_batch=args.max_batch,
            activation_checkpointing=args.activation_checkpointing,
            kv_memory_fraction=args.kv_memory_fraction,
            kv_blocks=args.kv_blocks,
            max_model_len=args.max_model_len,
            loss_chunk_tokens=args.loss_chunk_tokens,
            eager_loss=args.eager_loss,
            untied=args.untie,
            cuda_graphs=not args.no_cuda_graphs,
            lora=lora_argument(args),
            adamw_step=args.adamw_step,
            optimizer=args.optimizer,
            shard=args.shard,
            world_size=args.nproc,
        )
        judge = read_config(args.judge_model) if args.judge_model else None
        plan = plan_memory(read_config(args.model), args.device_memory, run, judge=judge)
        print(plan.check().render())
    except (PlanError, ConfigError, ValueError) as err:
        print(f"rlvr-fast plan: {err}", file=sys.stderr)
        return 2
    return 0


def lora_argument(args: argparse.Namespace) -> LoraSettings | None:
    if args.lora_r is None:
        return None
    targets = args.lora_target_modules
    names = targets if targets == "all-linear" else tuple(targets.split(","))
    return LoraSettings(rank=args.lora_r, targets=names)


if __name__ == "__main__":
    sys.exit(main())
