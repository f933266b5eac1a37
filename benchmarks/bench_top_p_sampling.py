"""One decode step's draw at B = 8 rows and V = 151,936 (Qwen3's vocabulary): the torch
reference (``sample_tokens_reference``: a full sort of every row) vs the fast sampler of the
device (CPU: the C++ ``sample_top_p_cpu``; CUDA: the Triton kernel), temperature 0.8, top_p 0.9
(the trainer's defaults).

Two kinds of logits: "flat" (N(0, 0.6^2), what a random-weight model at Qwen3-0.6B's widths
produces: the nucleus is ~70% of the vocabulary) and "peaked" (N(0, 5^2): a nucleus of a few
tokens, closer to a trained model's). Work is counted in rows drawn.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import mark
from rlvr_fast.engine.token_sampler import sample_tokens

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROWS, VOCAB = 8, 151_936
SCALES = {"flat": 0.6, "peaked": 5.0}
TEMPERATURE, TOP_P = 0.8, 0.9
FAST_BACKEND = "triton" if DEVICE.type == "cuda" else "cpp"


@pytest.mark.parametrize("role", ["eager", "fast"])
@pytest.mark.parametrize("kind", list(SCALES))
def test_top_p_sampling(benchmark, kind, role):
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, device=DEVICE, generator=generator) * SCALES[kind]
    seeds = torch.randint(0, 2**62, (ROWS,), device=DEVICE, generator=generator)
    positions = torch.randint(0, 4096, (ROWS,), device=DEVICE, generator=generator)
    backend = "torch" if role == "eager" else FAST_BACKEND

    def draw():
        tokens = sample_tokens(
            logits, seeds, positions, TEMPERATURE, TOP_P, greedy=False, backend=backend
        )
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return tokens

    mark(benchmark, f"top_p_sampling B={ROWS} V={VOCAB} {kind}", role, work=ROWS, unit="rows")
    benchmark.pedantic(draw, rounds=20, warmup_rounds=2)
