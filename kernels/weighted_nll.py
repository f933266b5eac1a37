"""Advantage-weighted token NLL: the row kernel (Triton), its torch twin, and the reference.

Semantics (``weighted_token_nll_reference``, the test oracle):
    loss = sum_t w_t * (-log softmax(h_t @ W^T)[y_t])      hidden [N, H], W [V, H]

Split between Triton and cuBLAS. The fused op walks the tokens in chunks of C rows. Per chunk,
cuBLAS computes the logits tile ``h_c @ W^T`` [C, V]; the Triton kernel below then reads each row
once for an online (max, sum-exp) log-sum-exp in fp32 and once more to overwrite the row in place
with the logit gradient ``w_t * (softmax - onehot)``, formed in fp32 and rounded once to the
input dtype; cuBLAS then computes ``dH_c = dlogits @ W`` and ``dW += dlogits^T @ h_c`` (dW
accumulated across chunks in fp32). The two GEMMs and the logits GEMM are >99% of the FLOPs and
already run at tensor-core speed in cuBLAS; writing them in Triton would only re-implement them.
What cuBLAS cannot do is the softmax/gradient epilogue without a second [C, V] buffer; the
in-place kernel removes that buffer and every fp32 [N, V] intermediate of the eager path, so
memory is bounded by one [C, V] tile plus dW. The per-token weights are applied to the logit
gradient, before both backward GEMMs.

The torch twin ``weighted_nll_rows_torch`` does the same row work on CPU tensors.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path and the reference need no Triton
    triton = None


def weighted_token_nll_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Eager PyTorch: materialises the fp32 [N, V] logits. Differentiable in hidden and weight."""
    logits = (hidden @ weight.T).float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
    return -(weights.float() * logprobs).sum()


# The torch row work goes this many rows at a time, so its fp32 temporaries stay a sliver of the
# tile (a row's result does not depend on the rows beside it).
TORCH_ROW_BLOCK = 4


def weighted_nll_rows_torch(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, write_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row work on [C, V] logits: returns (w_t * nll_t, log p_t) in fp32 and, with
    ``write_grad``, overwrites ``logits`` with w_t * (softmax - onehot)."""
    logprobs = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], TORCH_ROW_BLOCK):
        end = min(start + TORCH_ROW_BLOCK, logits.shape[0])
        logprobs[start:end] = _rows_torch(
            logits[start:end], targets[start:end], weights[start:end], write_grad
        )
    return -weights.float() * logprobs, logprobs


def _rows_torch(logits, targets, weights, write_grad) -> torch.Tensor:
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    rows = torch.arange(logits.shape[0], device=logits.device)
    logprobs = x[rows, targets] - lse
    if write_grad:
        # In place for fp32 (x is logits); a bf16 block gets one fp32 temporary, rounded once.
        grad = x.sub_(lse[:, None]).exp_()
        grad[rows, targets] -= 1.0
        grad.mul_(weights.float()[:, None])
        if grad.data_ptr() != logits.data_ptr():
            logits.copy_(grad)
    return logprobs


if triton is not None:

    @triton.jit
    def _weighted_nll_rows_kernel(
        p_logits,
        stride_row,
        p_targets,
        p_weights,
        p_losses,
        p_logprobs,
        V,
        BLOCK_V: tl.constexpr,
        NUM_TILES: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
    ):
        i_row = tl.program_id(0).to(tl.int64)
        p_row = p_logits + i_row * stride_row
        b_target = tl.load(p_targets + i_row)
        b_weight = tl.load(p_weights + i_row).to(tl.float32)
        b_max = tl.full([], float("-inf"), tl.float32)
        b_sum = tl.full([], 0.0, tl.float32)
        for i_t in range(0, NUM_TILES):
            o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
            m_v = o_v < V
            b_x = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32)  # [BV]
            b_new_max = tl.maximum(b_max, tl.max(b_x, axis=0))
            b_sum = b_sum * tl.exp(b_max - b_new_max) + tl.sum(tl.exp(b_x - b_new_max), axis=0)
            b_max = b_new_max
        b_lse = b_max + tl.log(b_sum)
        b_logprob = tl.load(p_row + b_target).to(tl.float32) - b_lse
        tl.store(p_losses + i_row, -b_weight * b_logprob)
        tl.store(p_logprobs + i_row, b_logprob)
        if WRITE_GRAD:
            for i_t in range(0, NUM_TILES):
                o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
                m_v = o_v < V
                b_x = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
                b_onehot = tl.where(o_v == b_target, 1.0, 0.0)
                b_grad = b_weight * (tl.exp(b_x - b_lse) - b_onehot)  # [BV], fp32
                tl.store(p_row + o_v, b_grad.to(p_logits.dtype.element_ty), mask=m_v)


def weighted_nll_rows_triton(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, write_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``weighted_nll_rows_torch`` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = min(triton.next_power_of_2(vocab), 4096)
    _weighted_nll_rows_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets,
        weights,
        losses,
        logprobs,
        vocab,
        BLOCK_V=block,
        NUM_TILES=triton.cdiv(vocab, block),
        WRITE_GRAD=write_grad,
    )
    return losses, logprobs
