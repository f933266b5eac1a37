"""The attention prologue of a paged pass (per-head q/k RMSNorm, RoPE, the KV store) in one op:
the Triton kernel (under TRITON_INTERPRET=1 on the CPU) and the C++ path against the decoder's
torch ops, in fp32 and bf16, with and without the q/k norm (Qwen3; Qwen2 / Llama), over odd head
counts and scattered slots. Cache slots nobody writes stay NaN.

bf16 under the interpreter: see tests/ops/test_add_rms_norm.py (it truncates where the GPU
rounds to nearest)."""

from __future__ import annotations

import pytest
import torch

from devices import CUDA, DEVICE, on_device
from rlvr_fast.kernels.qk_norm_rope import apply_rope, qk_norm_rope_store_reference, split_heads
from rlvr_fast.ops.qk_norm_rope import qk_norm_rope_store
from rlvr_fast.ops.rms_norm import rms_norm

BACKENDS = ["triton"] if CUDA else ["triton", "cpp"]
# (tokens, q heads, KV heads, head dim)
SHAPES = [(1, 2, 1, 8), (5, 6, 2, 32), (3, 16, 8, 128)]
SLOTS = 40


def make(tokens, q_heads, kv_heads, head_dim, dtype, norm, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=generator) * 2
    weights = [torch.randn(head_dim, generator=generator) for _ in range(2)] if norm else [None] * 2
    angles = torch.randn(tokens, head_dim // 2, generator=generator) * 10
    cos = torch.cat((angles, angles), -1).cos()
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    slots = torch.randperm(SLOTS, generator=generator)[:tokens]
    to = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return to(qkv), *map(to, weights), to(cos), to(sin), slots.to(DEVICE)


def run(backend, qkv, q_weight, k_weight, cos, sin, slots, q_heads, kv_heads, head_dim):
    cache = torch.full((2, SLOTS, kv_heads, head_dim), float("nan"), dtype=qkv.dtype, device=DEVICE)
    fn = qk_norm_rope_store_reference if backend == "torch" else qk_norm_rope_store
    extra = {} if backend == "torch" else {"backend": backend}
    q, k = fn(qkv, q_weight, k_weight, 1e-6, cos, sin, cache[0], cache[1], slots, q_heads, **extra)
    return q, k, cache


def unfused_cpu_path(qkv, q_weight, k_weight, cos, sin, q_heads, kv_heads, head_dim):
    """What the decoder ran on the CPU before the fusion: the C++ norm with one weight row per
    head, then RoPE in torch ops."""
    qk, _ = split_heads(qkv, q_heads, kv_heads, head_dim)
    if q_weight is not None:
        weight = torch.cat((q_weight.expand(q_heads, -1), k_weight.expand(kv_heads, -1)))
        with torch.inference_mode():
            qk = rms_norm(qk, weight, 1e-6, backend="cpp")
    qk = apply_rope(qk, cos[:, None], sin[:, None])
    return qk[:, :q_heads], qk[:, q_heads:]


@on_device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("norm", [True, False])
def test_fp32_matches_the_decoder_ops(backend, tokens, q_heads, kv_heads, head_dim, norm):
    inputs = make(tokens, q_heads, kv_heads, head_dim, torch.float32, norm)
    heads = (q_heads, kv_heads, head_dim)
    want = run("torch", *inputs, *heads)
    with torch.inference_mode():
        got = run(backend, *inputs, *heads)
    written = inputs[-1]
    if backend == "cpp":
        before = unfused_cpu_path(*inputs[:5], *heads)
        assert all(map(torch.equal, got[:2], before)), "bit for bit the unfused CPU path"
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2][:, written], want[2][:, written], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2][1, written], inputs[0].view(tokens, -1, head_dim)[:, -kv_heads:])
    others = torch.ones(SLOTS, dtype=torch.bool, device=DEVICE)
    others[written] = False
    assert got[2][:, others].isnan().all(), "no slot but the tokens' own is written"


@on_device
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", SHAPES)
def test_triton_bf16_within_the_rule(tokens, q_heads, kv_heads, head_dim):
    inputs = make(tokens, q_heads, kv_heads, head_dim, torch.bfloat16, True, seed=1)
    heads = (q_heads, kv_heads, head_dim)
    exact = run("torch", *[t.double() for t in inputs[:-1]], inputs[-1], *heads)
    eager = run("torch", *inputs, *heads)
    got = run("triton", *inputs, *heads)
    for a, b, want in zip(got[:2], eager[:2], exact[:2]):
        error_a, error_b = (float((t.double() - want).abs().max()) for t in (a, b))
        assert error_a <= 2 * error_b + 2.0**-7 * float(want.abs().max())


def test_cpp_refuses_a_slot_outside_the_cache():
    from rlvr_fast._C import qk_norm_rope_store_cpu

    qkv, qw, kw, cos, sin, _ = make(2, 2, 1, 8, torch.float32, True)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        qk_norm_rope_store_cpu(
            qkv, qw, kw, 1e-6, cos, sin, cache[0], cache[1], torch.tensor([1, 9]), 2
        )
