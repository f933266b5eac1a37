"""RMSNorm over the last dim, alone or after the residual add: the Triton kernel and the torch
reference, in Hugging Face's rounding order.

Reference (``rms_norm_reference``): normalise in fp32, round to the input dtype, then scale by
``weight`` (torch's type promotion of ``weight * normed``). With a residual
(``add_rms_norm_reference``) the sum ``x + residual`` is formed first in the activation dtype,
as the decoder's residual stream is, and both the normalised sum and the sum are returned.

The kernel runs one program per row of D elements and makes the same roundings (the add and the
normalised value rounded to the activation dtype, the product to the output dtype); the mean of
squares is a tree sum in fp32, so it equals the reference up to float32 rounding of that sum.
Rows may be strided; the last dim must be contiguous.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference needs no Triton
    triton = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise over the last dim in fp32, round to the input dtype, then scale (``weight``
    broadcasts against x). Written out because on CPU F.rms_norm dispatches to the same ops
    plus a slower wrapper."""
    # The dtype checks skip two no-op casts per call in fp32.
    x32 = x if x.dtype == torch.float32 else x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        p_x,
        p_residual,
        p_weight,
        p_out,
        p_sum,
        stride_x,
        stride_residual,
        D,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        i_row = tl.program_id(0).to(tl.int64)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_x = tl.load(p_x + i_row * stride_x + o_d, mask=m_d, other=0.0)  # [BD]
        if HAS_RESIDUAL:
            b_r = tl.load(p_residual + i_row * stride_residual + o_d, mask=m_d, other=0.0)
            # torch's add in the activation dtype: an fp32 sum rounded once.
            b_x = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(p_sum.dtype.element_ty)
            tl.store(p_sum + i_row * D + o_d, b_x, mask=m_d)
        b_x32 = b_x.to(tl.float32)
        b_inverse = tl.rsqrt(tl.sum(b_x32 * b_x32, axis=0) / D + eps)
        b_normed = (b_x32 * b_inverse).to(p_x.dtype.element_ty).to(tl.float32)  # [BD]
        b_w = tl.load(p_weight + o_d, mask=m_d, other=0.0).to(tl.float32)
        tl.store(p_out + i_row * D + o_d, (b_w * b_normed).to(p_out.dtype.element_ty), mask=m_d)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as a [N, D] view with a unit last stride (a copy only when it must be)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of ``rms_norm_reference`` (``residual`` None) or of
    ``add_rms_norm_reference``: returns (normalised, the sum or None). x, residual [..., D];
    weight [D]. CUDA, or CPU under TRITON_INTERPRET=1."""
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    dim = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    residual_rows = _rows(residual) if residual is not None else rows
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        residual_rows,
        weight.contiguous(),
        out,
        summed if summed is not None else out,
        rows.stride(0),
        residual_rows.stride(0),
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_D=triton.next_power_of_2(dim),
    )
    return out, summed
