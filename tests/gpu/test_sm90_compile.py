"""Every Triton kernel compiled ahead of time for an H100 / H200 (sm_90) at Qwen3-0.6B's shapes,
without a GPU (``aot_sm90``): it builds to a binary with the bundled ptxas, spills no register,
its PTX holds the roundings the kernel means (and the 16-byte memory accesses where the layout
allows them), and every address offset scaled by a program id or a loaded index is computed in
64 bits (checked to catch the 32-bit kind on control kernels)."""

from __future__ import annotations

import re

import pytest

from aot_sm90 import compile_for_sm90

VOCAB, BLOCK_V = 151_936, 4096
# Qwen3-0.6B: 16 query heads share 8 KV heads, head_dim 128, the engine's 16-token blocks, the
# paged kernel's 32-token tiles.
GROUP, HEAD_DIM, BLOCK_SIZE, TILE_TOKENS = 2, 128, 16, 32
# Qwen3-0.6B has 227 parameter tensors untied (8 per layer x 28, embeddings, final norm, head).
QWEN3_TENSORS = 227
# A float32 -> bf16 conversion that does not round to nearest (rz, rm, rp, rni ...).
NOT_NEAREST_BF16 = r"cvt\.(?!rn\.)[a-z0-9.]*bf16(x2)?\.f32"


def assert_builds_without_spills(compiled) -> None:
    assert compiled.cubin_bytes > 0
    assert compiled.spill_stores == compiled.spill_loads == 0, compiled
    assert compiled.narrow_offsets() == [], "32-bit address offsets"


@pytest.mark.parametrize("width", ["narrow", "wide"])
def test_the_64_bit_offset_check_catches_32_bit_offsets(width):
    """A row copy whose row offset and loaded block index scale in int32 has two 32-bit
    products in its addresses; cast to int64 first, none."""
    pointers = dict(p_x="*fp32", p_blocks="*i32", p_out="*fp32")
    compiled = compile_for_sm90(
        "offset_control_kernels",
        f"_{width}_copy_kernel",
        {**pointers, "stride_row": "i32"},
        dict(BLOCK=128),
        divisible=(*pointers, "stride_row"),
    )
    narrow = compiled.narrow_offsets()
    if width == "wide":
        assert narrow == []
    else:
        assert len(narrow) == 2 and all(line.startswith("mul.lo.s32") for line in narrow), narrow


# Each compile costs about 5 s of CI: fp32 once, in the variant that writes the tile.
@pytest.mark.parametrize("dtype,write_grad", [("bf16", True), ("bf16", False), ("fp32", True)])
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


@pytest.mark.parametrize(
    "dtype,kernel,entropy_grad",
    # Every variant in bf16 (the rounding of the tile pass 2 writes); fp32 once, in pass 2
    # (pass 1 differs only in the load's type). A compile costs about 5 s of CI.
    [
        ("bf16", "_policy_rows_stats_kernel", None),
        ("bf16", "_policy_rows_grad_kernel", False),
        ("bf16", "_policy_rows_grad_kernel", True),
        ("fp32", "_policy_rows_grad_kernel", False),
    ],
)
def test_policy_loss_row_kernels_compile_for_sm90(dtype, kernel, entropy_grad):
    """Pass 1 (log p, log-sum-exp, entropy) and pass 2 (the logit gradient, in place, with and
    without the entropy bonus's term) over a row of Qwen3's 151,936 logits in 4,096-wide tiles:
    16-byte loads; pass 2 stores in 16-byte writes, rounded to nearest in bf16."""
    pointers = dict(p_logits=f"*{dtype}", p_targets="*i64", p_lse="*fp32")
    constants = dict(BLOCK_V=BLOCK_V, NUM_TILES=-(-VOCAB // BLOCK_V))
    if kernel == "_policy_rows_stats_kernel":
        pointers.update(p_logprobs="*fp32", p_entropy="*fp32")
    else:
        pointers.update(p_grad_logprobs="*fp32", p_entropy="*fp32", p_grad_entropy="*fp32")
        constants.update(HAS_ENTROPY_GRAD=entropy_grad)
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.policy_loss",
        kernel,
        {**pointers, "stride_row": "i32", "V": "i32", "inv_temperature": "fp32"},
        constants,
        divisible=(*pointers, "stride_row", "V"),
    )
    assert_builds_without_spills(compiled)
    assert compiled.count(r"ld\.global\.v4") > 0
    assert compiled.count(NOT_NEAREST_BF16) == 0
    writes_tile = kernel == "_policy_rows_grad_kernel"
    assert (compiled.count(r"st\.global\.v4") > 0) == writes_tile
    assert (compiled.count(r"cvt\.rn\.bf16(x2)?\.f32") > 0) == (writes_tile and dtype == "bf16")


# bf16 with one and with five context splits; fp32 once (about 6 s of CI a compile).
@pytest.mark.parametrize("dtype,splits", [("bf16", 1), ("bf16", 5), ("fp32", 5)])
def test_paged_attention_kernel_compiles_for_sm90(dtype, splits):
    """One program per (sequence, KV head, context split) serving its 2 query heads: the
    counted tile loop software-pipelined (cp.async copies of the next 32-token tiles in flight),
    no spills, the output rounded to nearest in bf16 (one split) or the fp32 partials."""
    pointers = dict(
        p_q=f"*{dtype}",
        p_k=f"*{dtype}",
        p_v=f"*{dtype}",
        p_tables="*i32",
        p_lens="*i64",
        p_out=f"*{dtype}",
        p_part_acc="*fp32",
        p_part_max="*fp32",
        p_part_sum="*fp32",
    )
    strides = ("stride_qb", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_tb")
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.paged_attention",
        "_paged_attention_kernel",
        {**pointers, "scale": "fp32", **{name: "i32" for name in strides}},
        dict(
            GROUP=GROUP,
            GROUP_PAD=GROUP,
            BLOCK_SIZE=BLOCK_SIZE,
            HEAD_DIM=HEAD_DIM,
            TILE=TILE_TOKENS,
            SPLITS=splits,
            STAGES=3,
            PIPELINED=True,
        ),
        divisible=(*pointers, *strides),
    )
    assert_builds_without_spills(compiled)
    assert compiled.count(r"cp\.async") > 0, "the tile loads are pipelined"
    assert compiled.count(NOT_NEAREST_BF16) == 0
    rounds_output = dtype == "bf16" and splits == 1
    assert (compiled.count(r"cvt\.rn\.bf16(x2)?\.f32") > 0) == rounds_output


def test_split_combine_kernel_compiles_for_sm90():
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.paged_attention",
        "_combine_splits_kernel",
        dict(
            p_part_acc="*fp32",
            p_part_max="*fp32",
            p_part_sum="*fp32",
            p_out="*bf16",
            stride_qb="i32",
            stride_qh="i32",
        ),
        dict(Q_HEADS=16, HEAD_DIM=HEAD_DIM, SPLITS=5, SPLITS_PAD=8),
        divisible=("p_part_acc", "p_out", "stride_qb", "stride_qh"),
    )
    assert_builds_without_spills(compiled)
    assert compiled.count(NOT_NEAREST_BF16) == 0
    assert compiled.count(r"cvt\.rn\.bf16(x2)?\.f32") > 0


@pytest.mark.parametrize("residual", [True, False])
def test_rms_norm_kernel_compiles_for_sm90(residual):
    """Qwen3's 1,024-wide rows in bf16: 16-byte loads, every bf16 result rounded to nearest."""
    pointers = dict(p_x="*bf16", p_residual="*bf16", p_weight="*bf16", p_out="*bf16", p_sum="*bf16")
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.rms_norm",
        "_rms_norm_kernel",
        {**pointers, "stride_x": "i32", "stride_residual": "i32", "D": "i32", "eps": "fp32"},
        dict(HAS_RESIDUAL=residual, BLOCK_D=1024),
        divisible=(*pointers, "stride_x", "stride_residual", "D"),
    )
    assert_builds_without_spills(compiled)
    assert compiled.count(r"ld\.global\.v4") > 0
    assert compiled.count(NOT_NEAREST_BF16) == 0
    assert compiled.count(r"cvt\.rn\.bf16(x2)?\.f32") > 0


@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_store_kernel_compiles_for_sm90(norm):
    """Qwen3-0.6B's 16 q + 8 k heads of 128 in one program per token, v stored beside."""
    pointers = dict(
        p_qkv="*bf16",
        p_q_weight="*bf16",
        p_k_weight="*bf16",
        p_cos="*bf16",
        p_sin="*bf16",
        p_slots="*i64",
        p_key_slots="*bf16",
        p_value_slots="*bf16",
        p_q="*bf16",
        p_k="*bf16",
    )
    strides = ("stride_qkv", "stride_rope", "stride_slot")
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.qk_norm_rope",
        "_qk_norm_rope_store_kernel",
        {**pointers, **{name: "i32" for name in strides}, "eps": "fp32"},
        dict(Q_HEADS=16, KV_HEADS=8, QK_PAD=32, KV_PAD=8, HALF=HEAD_DIM // 2, NORM=norm),
        divisible=(*pointers, *strides),
    )
    assert_builds_without_spills(compiled)
    assert compiled.count(r"st\.global\.v4") > 0
    assert compiled.count(NOT_NEAREST_BF16) == 0
    # The products and sum rounded to bf16 (as converts, or as native bf16 ops where that is
    # the same rounding).
    assert compiled.count(r"\.rn\.bf16") > 0


def test_silu_mul_kernel_compiles_for_sm90():
    compiled = compile_for_sm90(
        "rlvr_fast.kernels.silu_mul",
        "_silu_mul_kernel",
        dict(p_gate_up="*bf16", p_out="*bf16", stride_row="i32", inner="i32"),
        dict(BLOCK=1024),
        divisible=("p_gate_up", "p_out", "stride_row", "inner"),
    )
    assert compiled.cubin_bytes > 0
    assert compiled.spill_stores == compiled.spill_loads == 0, compiled
    # The one 32-bit product allowed: the column block (grid axis 1, at most 65,535 by the
    # hardware) times BLOCK, under 2^26; every row offset is 64-bit.
    axis_1 = re.findall(r"mov\.u32\s+(%r\d+), %ctaid\.y;", compiled.ptx)
    for line in compiled.narrow_offsets():
        assert re.fullmatch(rf"shl\.b32\s+%r\d+, ({'|'.join(axis_1)}), 10;?", line), line
    assert compiled.count(r"ld\.global\.v4") > 0
    assert compiled.count(NOT_NEAREST_BF16) == 0


SAMPLER = "rlvr_fast.kernels.top_p_sampling"
SAMPLER_TILES = dict(BLOCK_V=4096, NUM_TILES=-(-VOCAB // 4096))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sampler_row_passes_compile_for_sm90(dtype):
    """Passes 1 and 2 over a row of Qwen3's 151,936 logits: 16-byte loads."""
    common = dict(p_logits=f"*{dtype}", stride_row="i32", p_temperature="*fp32", p_stats="*fp32")
    stats = compile_for_sm90(
        SAMPLER,
        "_row_stats_kernel",
        {**common, "V": "i32"},
        SAMPLER_TILES,
        divisible=("p_logits", "stride_row", "V"),
    )
    histogram = compile_for_sm90(
        SAMPLER,
        "_histogram_kernel",
        dict(
            p_logits=f"*{dtype}",
            stride_row="i32",
            p_temperature="*fp32",
            p_top_p="*fp32",
            p_top_k="*fp32",
            p_min_p="*fp32",
            p_stats="*fp32",
            p_counts="*i32",
            V="i32",
        ),
        dict(BINS=1024, **SAMPLER_TILES),
        divisible=("p_logits", "stride_row", "V"),
    )
    for compiled in (stats, histogram):
        assert_builds_without_spills(compiled)
        assert compiled.count(r"ld\.global\.v4") > 0


def test_sampler_draw_kernel_compiles_for_sm90():
    """Pass 3 with its 4,096-slot candidate sort, eight warps, no spills, with the top-k and
    min-p bounds, the race over the surely kept tokens in the read that gathers the window, and
    the top-k mass's radix select in it: 2,048-wide tiles (4,096 spill next to the sort)."""
    compiled = compile_for_sm90(
        SAMPLER,
        "_draw_kernel",
        dict(
            p_logits="*bf16",
            stride_row="i32",
            p_temperature="*fp32",
            p_top_p="*fp32",
            p_top_k="*fp32",
            p_min_p="*fp32",
            p_stats="*fp32",
            p_counts="*i32",
            p_seeds="*i64",
            p_positions="*i64",
            p_scratch="*i64",
            p_tokens="*i64",
            V="i32",
        ),
        dict(BINS=1024, CAP=4096, ID_BITS=20, BLOCK_V=2048, NUM_TILES=-(-VOCAB // 2048)),
        divisible=("p_logits", "stride_row", "p_scratch", "V"),
        options={"num_warps": 8},
    )
    assert_builds_without_spills(compiled)


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
