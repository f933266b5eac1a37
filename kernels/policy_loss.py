"""Per-token statistics and logit gradients of a policy loss at a sampling temperature: the row
kernels (Triton), their torch twins, and the eager reference.

For raw logits z_t = h_t @ W^T and temperature T, the row work on a [C, V] logits tile reads
x = z / T in fp32 and gives
    log p_t = x[y_t] - lse(x),   entropy_t = -sum_v softmax(x)_v (x_v - lse(x))
(pass 1, ``policy_rows_stats_*``), and, once the loss's gradients g_t = dL / d log p_t and
g^H_t = dL / d entropy_t are known, overwrites the tile with
    dL / dz_t = (g_t (onehot(y_t) - p) - g^H_t p (log p + entropy_t)) / T,   p = softmax(x),
formed in fp32 and rounded once to the tile's dtype (pass 2, ``policy_rows_grad_*``; the entropy
term only when a loss differentiates the entropy, an entropy bonus: without it the pass does the
work it did before the term existed). The entropy is the by-product
of the pass that finds the log-sum-exp: an online (max, sum-exp, sum of exp-weighted centred
logits) triple per row. cuBLAS does the GEMMs around the tile, as in ``weighted_nll``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path and the reference need no Triton
    triton = None

# The torch row work goes this many rows at a time: its fp32 temporaries stay a sliver of the tile.
TORCH_ROW_BLOCK = 4


def token_stats_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager PyTorch (fp32 [N, V] logits): differentiable log p_t [N] and entropy_t [N]."""
    logprobs = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    token = logprobs.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logprobs.exp() * logprobs).sum(dim=-1)
    return token, entropy


def policy_rows_stats_torch(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p_t, lse_t, entropy_t) [C] fp32 of a [C, V] raw-logits tile; the tile may be
    overwritten (it is scratch after this pass)."""
    rows = logits.shape[0]
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    for start in range(0, rows, TORCH_ROW_BLOCK):
        end = min(start + TORCH_ROW_BLOCK, rows)
        x = logits[start:end].float().mul_(1.0 / temperature)
        lse = torch.logsumexp(x, dim=-1)
        out[0, start:end] = x.gather(1, targets[start:end, None]).squeeze(1) - lse
        out[1, start:end] = lse
        # -sum p log p over log p = x - lse: no cancellation of two large terms.
        logp = x.sub_(lse[:, None])
        out[2, start:end] = -(logp.exp() * logp).sum(dim=-1)
    return out[0], out[1], out[2]


def policy_rows_grad_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor,
    temperature: float,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> None:
    """Overwrites a [C, V] raw-logits tile with dL / dz (module docstring): g_t = grad_logprobs
    [C]; with ``grad_entropy`` [C] (and the rows' ``entropy`` [C]) the entropy term too,
    skipped when no row's g^H is nonzero."""
    if grad_entropy is not None and not bool(grad_entropy.any()):
        grad_entropy = None
    for start in range(0, logits.shape[0], TORCH_ROW_BLOCK):
        end = min(start + TORCH_ROW_BLOCK, logits.shape[0])
        x = logits[start:end].float().mul_(1.0 / temperature)
        logp = x.sub_(lse[start:end, None])
        # Without the entropy term the softmax overwrites log p in place: one fp32 temporary.
        p = logp.exp() if grad_entropy is not None else None
        grad = logp.exp_().neg_() if p is None else p.neg()
        grad.scatter_add_(1, targets[start:end, None], torch.ones_like(grad[:, :1]))
        grad.mul_((grad_logprobs[start:end] / temperature)[:, None])
        if p is not None:
            entropy_term = logp.add_(entropy[start:end, None]).mul_(p)  # p (log p + H)
            grad.sub_(entropy_term.mul_((grad_entropy[start:end] / temperature)[:, None]))
        if grad.data_ptr() != logits.data_ptr():
            logits[start:end].copy_(grad)


if triton is not None:

    @triton.jit
    def _policy_rows_stats_kernel(
        p_logits,
        stride_row,
        p_targets,
        p_logprobs,
        p_lse,
        p_entropy,
        V,
        inv_temperature,
        BLOCK_V: tl.constexpr,
        NUM_TILES: tl.constexpr,
    ):
        i_row = tl.program_id(0).to(tl.int64)
        p_row = p_logits + i_row * stride_row
        b_max = tl.full([], float("-inf"), tl.float32)
        b_sum = tl.full([], 0.0, tl.float32)
        # sum_v exp(x_v - max) (x_v - max), carried to each new max: the entropy is then
        # log(sum) - dot / sum, with no cancellation of two large terms.
        b_dot = tl.full([], 0.0, tl.float32)
        for i_t in range(0, NUM_TILES):
            o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
            m_v = o_v < V
            b_x = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
            b_x = b_x * inv_temperature  # [BV]
            b_new_max = tl.maximum(b_max, tl.max(b_x, axis=0))
            # <= 0; taken as 0 on the first tile (max -inf), where both sums are still 0.
            b_shift = tl.where(b_sum > 0, b_max - b_new_max, 0.0)
            b_scale = tl.exp(b_shift)
            b_centred = tl.where(m_v, b_x - b_new_max, 0.0)
            b_e = tl.where(m_v, tl.exp(b_centred), 0.0)
            b_dot = b_scale * (b_dot + b_shift * b_sum) + tl.sum(b_e * b_centred, axis=0)
            b_sum = b_sum * b_scale + tl.sum(b_e, axis=0)
            b_max = b_new_max
        b_lse = b_max + tl.log(b_sum)
        b_target = tl.load(p_targets + i_row)
        b_logit = tl.load(p_row + b_target).to(tl.float32) * inv_temperature
        tl.store(p_logprobs + i_row, b_logit - b_lse)
        tl.store(p_lse + i_row, b_lse)
        tl.store(p_entropy + i_row, tl.log(b_sum) - b_dot / b_sum)

    @triton.jit
    def _policy_rows_grad_kernel(
        p_logits,
        stride_row,
        p_targets,
        p_lse,
        p_grad_logprobs,
        p_entropy,
        p_grad_entropy,
        V,
        inv_temperature,
        BLOCK_V: tl.constexpr,
        NUM_TILES: tl.constexpr,
        HAS_ENTROPY_GRAD: tl.constexpr,
    ):
        i_row = tl.program_id(0).to(tl.int64)
        p_row = p_logits + i_row * stride_row
        b_target = tl.load(p_targets + i_row)
        b_lse = tl.load(p_lse + i_row)
        b_scale = tl.load(p_grad_logprobs + i_row) * inv_temperature
        if HAS_ENTROPY_GRAD:
            b_entropy = tl.load(p_entropy + i_row)
            b_scale_h = tl.load(p_grad_entropy + i_row) * inv_temperature
        for i_t in range(0, NUM_TILES):
            o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
            m_v = o_v < V
            b_x = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
            b_logp = b_x * inv_temperature - b_lse  # [BV]
            b_p = tl.exp(b_logp)
            b_grad = b_scale * (tl.where(o_v == b_target, 1.0, 0.0) - b_p)  # [BV], fp32
            if HAS_ENTROPY_GRAD:
                # d entropy / dx_v = -p_v (log p_v + entropy); 0 on the masked lanes (p = 0).
                b_grad -= b_scale_h * tl.where(m_v, b_p * (b_logp + b_entropy), 0.0)
            tl.store(p_row + o_v, b_grad.to(p_logits.dtype.element_ty), mask=m_v)


def _launch_shape(vocab: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(vocab), 4096)
    return block, triton.cdiv(vocab, block)


def policy_rows_stats_triton(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of ``policy_rows_stats_torch`` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    rows, vocab = logits.shape
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    block, tiles = _launch_shape(vocab)
    _policy_rows_stats_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets,
        out[0],
        out[1],
        out[2],
        vocab,
        1.0 / temperature,
        BLOCK_V=block,
        NUM_TILES=tiles,
    )
    return out[0], out[1], out[2]


def policy_rows_grad_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor,
    temperature: float,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> None:
    """Triton version of ``policy_rows_grad_torch`` (the entropy term whenever
    ``grad_entropy`` is given: testing it for zeros would sync with the device)."""
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    rows, vocab = logits.shape
    block, tiles = _launch_shape(vocab)
    has_entropy_grad = grad_entropy is not None
    _policy_rows_grad_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets,
        lse,
        grad_logprobs,
        entropy if has_entropy_grad else lse,  # unread without the entropy term
        grad_entropy if has_entropy_grad else lse,
        vocab,
        1.0 / temperature,
        BLOCK_V=block,
        NUM_TILES=tiles,
        HAS_ENTROPY_GRAD=has_entropy_grad,
    )
