"""SwiGLU's activation in one pass: silu(gate) * up from the packed projection, the Triton
kernel and the torch reference.

Reference (``silu_mul_reference``): gate, up = the two halves of gate_up [..., 2 I];
F.silu(gate) * up, each op rounded to the activation dtype (Hugging Face's order). The kernel
reads each row's two halves once and writes [..., I], with the same two roundings; silu is
g / (1 + exp(-g)) in fp32, torch's formula (exp itself may differ from torch's in the last
ulp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference needs no Triton
    triton = None


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(p_gate_up, p_out, stride_row, inner, BLOCK: tl.constexpr):
        i_row = tl.program_id(0).to(tl.int64)
        i_col = tl.program_id(1)
        o_i = i_col * BLOCK + tl.arange(0, BLOCK)
        m_i = o_i < inner
        p_row = p_gate_up + i_row * stride_row
        b_gate = tl.load(p_row + o_i, mask=m_i, other=0.0)  # [B]
        b_up = tl.load(p_row + inner + o_i, mask=m_i, other=0.0).to(tl.float32)
        b_g = b_gate.to(tl.float32)
        b_silu = (b_g / (1.0 + tl.exp(-b_g))).to(b_gate.dtype).to(tl.float32)
        tl.store(p_out + i_row * inner + o_i, (b_silu * b_up).to(b_gate.dtype), mask=m_i)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of ``silu_mul_reference`` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    width = gate_up.shape[-1]
    rows = gate_up.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    inner = width // 2
    out = torch.empty((*gate_up.shape[:-1], inner), dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(inner), 1024)
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(inner, block))](
        rows, out, rows.stride(0), inner, BLOCK=block
    )
    return out
