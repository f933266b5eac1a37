"""Every Triton kernel compiled ahead of time for an H100 / H200 (sm_90) at Qwen3-0.6B's shapes,
without a GPU (``aot_sm90``): it builds to a binary with the bundled ptxas, spills no register,
and its PTX holds the roundings the kernel means (and the 16-byte memory accesses where the
layout allows them)."""

from __future__ import annotations

import pytest

from aot_sm90 import compile_for_sm90

VOCAB, BLOCK_V = 151_936, 4096
# Qwen3-0.6B: 16 query heads share 8 KV heads, head_dim 128, the engine's 16-token blocks.
GROUP, HEAD_DIM, BLOCK_SIZE = 2, 128, 16
# Qwen3-0.6B has 227 parameter tensors untied (8 per layer x 28, embeddings, final norm, head).
QWEN3_TENSORS = 227
# A float32 -> bf16 conversion that does not round to nearest (rz, rm, rp, rni ...).
NOT_NEAREST_BF16 = r"cvt\.(?!rn\.)[a-z0-9.]*bf16(x2)?\.f32"


def assert_builds_without_spills(compiled) -> None:
    assert compiled.cubin_bytes > 0
    assert compiled.spill_stores == compiled.spill_loads == 0, compiled


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("write_grad", [True, False])
def test_weighted_nll_row_kernel_compiles_for_sm90(dtype, write_grad):
    """A row of Qwen3's 151,936 logits in 4,096-wide tiles: read in 16-byte loads; the logit
    gradient written back in place with 16-byte stores, rounded to nearest in bf16."""
    pointers = dict(
        p_logits=f"*{dtype}",
        p_targets="*i64",
        p_weights="*fp32",
        p_losses="*fp32",
        p_logprobs="*fp32",
    )
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.weighted_nll",
        "_weighted_nll_rows_kernel",
        {**pointers, "stride_row": "i32", "V": "i32"},
        dict(BLOCK_V=BLOCK_V, NUM_TILES=-(-VOCAB // BLOCK_V), WRITE_GRAD=write_grad),
        divisible=(*pointers, "stride_row", "V"),
    )
    assert_builds_without_spills(compiled)
    assert compiled.count(r"ld\.global\.v4") > 0
    assert compiled.count(NOT_NEAREST_BF16) == 0
    rounded = compiled.count(r"cvt\.rn\.bf16(x2)?\.f32")
    assert (rounded > 0) == (dtype == "bf16" and write_grad)
    assert (compiled.count(r"st\.global\.v4") > 0) == write_grad


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("kernel", ["_policy_rows_stats_kernel", "_policy_rows_grad_kernel"])
def test_policy_loss_row_kernels_compile_for_sm90(dtype, kernel):
    """Pass 1 (log p, log-sum-exp, entropy) and pass 2 (the logit gradient, in place) over a
    row of Qwen3's 151,936 logits in 4,096-wide tiles: 16-byte loads; pass 2 stores in 16-byte
    writes, rounded to nearest in bf16."""
    pointers = dict(p_logits=f"*{dtype}", p_targets="*i64", p_lse="*fp32")
    if kernel == "_policy_rows_stats_kernel":
        pointers.update(p_logprobs="*fp32", p_entropy="*fp32")
    else:
        pointers.update(p_grad_logprobs="*fp32")
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.policy_loss",
        kernel,
        {**pointers, "stride_row": "i32", "V": "i32", "inv_temperature": "fp32"},
        dict(BLOCK_V=BLOCK_V, NUM_TILES=-(-VOCAB // BLOCK_V)),
        divisible=(*pointers, "stride_row", "V"),
    )
    assert_builds_without_spills(compiled)
    assert compiled.count(r"ld\.global\.v4") > 0
    assert compiled.count(NOT_NEAREST_BF16) == 0
    writes_tile = kernel == "_policy_rows_grad_kernel"
    assert (compiled.count(r"st\.global\.v4") > 0) == writes_tile
    assert (compiled.count(r"cvt\.rn\.bf16(x2)?\.f32") > 0) == (writes_tile and dtype == "bf16")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_paged_attention_kernel_compiles_for_sm90(dtype):
    """One program per (sequence, KV head) serving its 2 query heads: each block's [16, 128] key
    and value tiles read in 16-byte loads, the output rounded to nearest in bf16."""
    pointers = dict(
        p_q=f"*{dtype}",
        p_k=f"*{dtype}",
        p_v=f"*{dtype}",
        p_tables="*i32",
        p_lens="*i64",
        p_out=f"*{dtype}",
    )
    strides = ("stride_qb", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_tb")
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.paged_attention",
        "_paged_attention_kernel",
        {**pointers, "scale": "fp32", **{name: "i32" for name in strides}},
        dict(GROUP=GROUP, GROUP_PAD=GROUP, BLOCK_SIZE=BLOCK_SIZE, HEAD_DIM=HEAD_DIM),
        divisible=(*pointers, *strides),
    )
    assert_builds_without_spills(compiled)
    assert compiled.count(r"ld\.global\.v4") > 0
    assert compiled.count(NOT_NEAREST_BF16) == 0
    assert (compiled.count(r"cvt\.rn\.bf16(x2)?\.f32") > 0) == (dtype == "bf16")


@pytest.mark.parametrize("alignment", ["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_grad_adamw_kernel_compiles_for_sm90_with_only_the_intended_roundings(
    dtype, alignment
):
    """Per element-step, three fma.rn (lerp's two branches, addcdiv), two mul.rn (weight
    decay, beta2), two div.rn, one sqrt.rn, one add.rn (eps), and nothing approximate or fused
    beyond that (triton 3.5 emitted .ftz here; 3.6 does not). Aligned tensors are read with
    16-byte loads. Qwen3-0.6B's 227 tensors in one launch, three folded steps."""
    is_bf16 = dtype == "bf16"
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.zero_grad_adamw",
        "_zero_grad_adamw_kernel",
        {
            "p_addresses": "*i64",
            "p_first_blocks": "*i64",
            "p_scalars": "*fp32",
            "n_tensors": "i32",
            "stride_scalars": "i32",
        },
        dict(
            SEARCH_STEPS=(QWEN3_TENSORS - 1).bit_length(),
            STEPS=3,
            BLOCK=2048,
            IS_BF16=is_bf16,
            ELEMENT="tl.uint16" if is_bf16 else "tl.float32",
            ALIGNED=alignment == "aligned",
        ),
        options={"num_warps": 8, "enable_fp_fusion": False},
    )
    assert_builds_without_spills(compiled)
    assert (compiled.count(r"ld\.global\.v4") > 0) == (alignment == "aligned")
    counts = {
        op: compiled.count(rf"\b{op}\.[a-z0-9.]*f32\b")
        for op in ("fma", "mad", "mul", "add", "div", "sqrt")
    }
    roundings = {op: compiled.count(rf"\b{op}\.rn\.f32\b") for op in counts}
    per_step = roundings["sqrt"]
    assert per_step > 0
    assert counts == roundings, "every float32 operation rounds to nearest, none flushes"
    assert roundings == {
        "fma": 3 * per_step,
        "mad": 0,
        "mul": 2 * per_step,
        "div": 2 * per_step,
        "sqrt": per_step,
        "add": per_step,
    }
