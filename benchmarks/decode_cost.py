"""What one graph-replayed decode step costs, counted on the meta device (no GPU, no weights).

    python -m benchmarks.decode_cost --config qwen3-0.6b --batch 64

builds the model at the config's shape on the meta device in bf16, a paged KV cache beside it,
and runs the step the CUDA graphs capture (``DecodeGraphs._step``: the decoder pass on the
static buffers, then the sampled draw) under a dispatch mode that records every operator. On the
meta device every op resolves its backend as on CUDA (``rlvr_fast.ops.backends``), so our fused
ops appear as the ``rlvr_fast::`` custom ops that each launch one Triton kernel. Counted:
- kernels per decode step: operators that launch a kernel on CUDA, i.e. every recorded op but
  views (``OpOverload.is_view``, ``_unsafe_view``) and bare allocations (``empty*``), whose
  memory comes from the graph's pool with no launch. The step runs under ``no_grad`` rather than
  inference mode, where composite ops (``linear``, ``to``) would reach the mode undecomposed
  and not as the kernels they launch;
- sampler full-vocab passes: ops of the draw alone (``sample_tokens`` as the step calls it) that
  read or write a tensor of at least B x V elements.
A per-op table follows (calls per step; calls touching a [B, V] tensor), then the sampler's
figures with TRL's options on: top_k and min_p (the same three passes) and the repetition
penalty over a ``--context``-token history (a float32 copy of the logits, then a gather and a
scatter of [B, context] elements of the copy: three more ops touching a [B, V] tensor, of
which the copy alone reads and writes all of it).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import rlvr_fast
from rlvr_fast.engine.cuda_graphs import DecodeGraphs
from rlvr_fast.engine.kv_storage import PagedKVStorage
from rlvr_fast.engine.token_sampler import sample_tokens
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM

CONFIGS = {
    "qwen3-0.6b": Path(rlvr_fast.__file__).parent / "assets" / "configs" / "qwen3-0.6b-base.json",
    "tiny": Path(rlvr_fast.__file__).parent / "assets" / "tiny" / "config.json",
}
# Allocations (on CUDA the caching allocator, inside a graph its private pool, hands out memory
# without a kernel) and ``_unsafe_view``, a reshape that schema marks as no view.
NO_LAUNCH = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::_unsafe_view"}


@dataclass
class OpCounts:
    """Per operator name: calls, and calls with a tensor of >= ``wide`` elements."""

    wide: int
    calls: Counter = field(default_factory=Counter)
    wide_calls: Counter = field(default_factory=Counter)

    @property
    def kernels(self) -> int:
        return sum(self.calls.values())

    @property
    def wide_passes(self) -> int:
        return sum(self.wide_calls.values())


class CountKernels(TorchDispatchMode):
    """Records every launching operator that runs inside it into ``counts``."""

    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if not func.is_view and name not in NO_LAUNCH:
            self.counts.calls[name] += 1
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if any(t.numel() >= self.counts.wide for t in tensors):
                self.counts.wide_calls[name] += 1
        return out


def load_config(name: str) -> ModelConfig:
    path = CONFIGS.get(name, Path(name))
    return ModelConfig.from_hf_dict(json.loads(path.read_text()))


def meta_decode_graphs(config: ModelConfig, batch: int, context: int, block_size: int = 16):
    """The decode graphs' step owner at ``config``'s shape on the meta device, its buffers set
    for ``batch`` rows of ``context`` tokens."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    width = -(-context // block_size) + 1
    storage = PagedKVStorage(
        config, batch * width, block_size, dtype=torch.bfloat16, device=torch.device("meta")
    )
    graphs = DecodeGraphs(model, storage, "triton", max_batch=batch, table_width=width)
    return graphs


@torch.no_grad()
def decode_step_cost(config: ModelConfig, batch: int, context: int = 512) -> OpCounts:
    """Ops of one sampled decode step (``DecodeGraphs._step``) at ``batch`` rows."""
    graphs = meta_decode_graphs(config, batch, context)
    counts = OpCounts(wide=batch * config.vocab_size)
    graphs._step(batch, greedy=False)  # the capture's warm-up (it caches RoPE's frequencies)
    with CountKernels(counts):
        graphs._step(batch, greedy=False)
    return counts


@torch.no_grad()
def sampler_cost(config: ModelConfig, batch: int, context: int = 0, **options) -> OpCounts:
    """Ops of the draw alone, called as ``DecodeGraphs._step`` calls it; ``options``: the
    sampler's top_k, min_p (0-d device tensors, as the graphs hold them) or
    repetition_penalty (with a history of ``context`` tokens a row)."""
    with torch.device("meta"):
        logits = torch.empty(batch, config.vocab_size, dtype=torch.bfloat16)
        seeds = torch.empty(batch, dtype=torch.long)
        positions = torch.empty(batch, dtype=torch.long)
        temperature, top_p = torch.empty(()), torch.empty(())
        for name in ("top_k", "min_p"):
            if name in options:
                options[name] = torch.full((), float(options[name]))
        if options.get("repetition_penalty", 1) != 1:
            options["history"] = torch.empty(batch, context, dtype=torch.long)
    counts = OpCounts(wide=batch * config.vocab_size)
    with CountKernels(counts):
        sample_tokens(logits, seeds, positions, temperature, top_p, greedy=False, **options)
    return counts


def table(step: OpCounts, sampler: OpCounts) -> list[str]:
    lines = [f"{'operator':<44} {'per step':>9} {'sampler':>8} {'[B, V]':>7}"]
    for name, calls in step.calls.most_common():
        lines.append(
            f"{name:<44} {calls:>9} {sampler.calls.get(name, 0):>8} "
            f"{sampler.wide_calls.get(name, 0):>7}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b", help="qwen3-0.6b, tiny or a path")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="tokens cached per row")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    step = decode_step_cost(config, args.batch, args.context)
    sampler = sampler_cost(config, args.batch)
    print(f"{args.config}, batch {args.batch}, bf16, meta device")
    print("\n".join(table(step, sampler)))
    print(f"kernels per decode step: {step.kernels}")
    print(f"sampler kernels: {sampler.kernels}")
    print(f"sampler full-vocab passes: {sampler.wide_passes}")
    filtered = sampler_cost(config, args.batch, top_k=50, min_p=0.05)
    print(f"with top_k and min_p: {filtered.kernels} kernels, {filtered.wide_passes} passes")
    penalized = sampler_cost(config, args.batch, args.context, repetition_penalty=1.1)
    print(
        f"with repetition_penalty ({args.context}-token history): {penalized.kernels} kernels, "
        f"{penalized.wide_passes} ops on [B, V] ({', '.join(sorted(penalized.wide_calls))}), "
        "decoded eagerly (no CUDA graph)"
    )


if __name__ == "__main__":
    main()
