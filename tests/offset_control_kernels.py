"""Control kernels for the 64-bit offset check of ``test_sm90_compile``: the same row copy with
its row offset and a loaded block index computed in 32 bits (which wrap past 2^31 elements) and
in 64 bits."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _narrow_copy_kernel(p_x, p_blocks, p_out, stride_row, BLOCK: tl.constexpr):
    i_row = tl.program_id(0)
    o_col = tl.arange(0, BLOCK)
    b_block = tl.load(p_blocks + i_row)
    b_x = tl.load(p_x + b_block * stride_row + o_col)  # [BLOCK]
    tl.store(p_out + i_row * stride_row + o_col, b_x)


@triton.jit
def _wide_copy_kernel(p_x, p_blocks, p_out, stride_row, BLOCK: tl.constexpr):
    i_row = tl.program_id(0).to(tl.int64)
    o_col = tl.arange(0, BLOCK)
    b_block = tl.load(p_blocks + i_row).to(tl.int64)
    b_x = tl.load(p_x + b_block * stride_row + o_col)  # [BLOCK]
    tl.store(p_out + i_row * stride_row + o_col, b_x)
