"""``sample_top_p``: the study's temperature + top-p draw (with top-k and min-p, off by default)
from per-sequence hashed streams, the sort-free Triton version
(``rlvr_fast.kernels.top_p_sampling``), one ``rlvr_fast::`` custom op per pass over the logits
(so a decode step counted on the meta device shows each)."""

from __future__ import annotations

import torch

from rlvr_fast.ops import launch
from rlvr_fast.kernels.top_p_sampling import (
    BINS,
    device_scalar,
    draw_triton,
    histogram_triton,
    row_stats_triton,
)


@torch.library.custom_op("rlvr_fast::sampler_row_stats", mutates_args=())
def row_stats_op(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    with launch.on_device(logits):
        return row_stats_triton(logits, temperature)


@row_stats_op.register_fake
def _(logits, temperature):
    return logits.new_empty((logits.shape[0], 2), dtype=torch.float32)


@torch.library.custom_op("rlvr_fast::sampler_histogram", mutates_args=())
def histogram_op(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    stats: torch.Tensor,
) -> torch.Tensor:
    with launch.on_device(logits):
        return histogram_triton(logits, temperature, top_p, top_k, min_p, stats)


@histogram_op.register_fake
def _(logits, temperature, top_p, top_k, min_p, stats):
    return logits.new_empty((logits.shape[0], BINS), dtype=torch.int32)


@torch.library.custom_op("rlvr_fast::sampler_draw", mutates_args=())
def draw_op(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    stats: torch.Tensor,
    counts: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    with launch.on_device(logits):
        return draw_triton(
            logits, temperature, top_p, top_k, min_p, stats, counts, seeds, positions
        )


@draw_op.register_fake
def _(logits, temperature, top_p, top_k, min_p, stats, counts, seeds, positions):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def sample_top_p(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature,
    top_p,
    top_k=0,
    min_p=0.0,
) -> torch.Tensor:
    """logits [B, V] (V < 2^20); seeds, positions [B] int64; temperature, top_p, top_k (0:
    off) and min_p (0: off) numbers or 0-d tensors -> token ids [B] int64, three passes over
    the logits (two with no filter or min-p alone)."""
    if logits.shape[1] >= 2**20:
        raise ValueError(f"sample_top_p: vocabularies up to 2^20 tokens, got {logits.shape[1]}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperature = device_scalar(temperature, logits.device)
    top_p = device_scalar(top_p, logits.device)
    top_k = device_scalar(top_k, logits.device)
    min_p = device_scalar(min_p, logits.device)
    stats = row_stats_op(logits, temperature)
    counts = histogram_op(logits, temperature, top_p, top_k, min_p, stats)
    return draw_op(logits, temperature, top_p, top_k, min_p, stats, counts, seeds, positions)
