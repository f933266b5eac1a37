"""``weighted_token_nll``: sum_t w_t * NLL_t from hidden states and the LM head, chunked.

Never materialises [tokens, vocab]: tokens are processed in chunks whose logits tile is turned in
place into the logit gradient (see ``rlvr_fast.kernels.weighted_nll`` for the split between the
row kernel and the GEMMs). The gradients are computed during the forward pass and scaled by the
incoming gradient in backward, so logits are never recomputed. Backend, resolved once per call:
CUDA tensors use the Triton row kernel, CPU tensors its torch twin; ``backend=`` overrides (tests
run the Triton kernel on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from rlvr_fast.kernels.weighted_nll import weighted_nll_rows_torch, weighted_nll_rows_triton
from rlvr_fast.ops import launch

BACKENDS = {"torch": weighted_nll_rows_torch, "triton": weighted_nll_rows_triton}
# One chunk's logits tile holds about this many elements (64 MiB in fp16/bf16, 128 MiB in fp32).
CHUNK_ELEMENTS = 2**25


def default_chunk_size(num_tokens: int, vocab: int) -> int:
    return max(1, min(num_tokens, CHUNK_ELEMENTS // vocab))


class _WeightedTokenNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, weights, chunk_size, backend, need_grad):
        ctx.weight_dtype = weight.dtype
        rows_fn = BACKENDS[backend]
        num_tokens = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        logprobs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_grad
            else None
        )
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            h = hidden[start:end]
            logits = h @ weight.T  # [C, V], becomes the logit gradient in place
            losses, logprobs[start:end] = rows_fn(
                logits, targets[start:end], weights[start:end], need_grad
            )
            loss += losses.sum()
            if need_grad:
                torch.mm(logits, weight, out=grad_hidden[start:end])
                if logits.dtype == torch.float32:
                    grad_weight.addmm_(logits.T, h)
                else:
                    # One rounding per chunk in the GEMM output; the sum over chunks is fp32.
                    grad_weight += (logits.T @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(logprobs)
        return loss, logprobs

    @staticmethod
    def backward(ctx, grad_loss, grad_logprobs):
        grad_hidden, grad_weight = ctx.saved_tensors
        dh = dw = None
        if ctx.needs_input_grad[0]:
            dh = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if ctx.needs_input_grad[1]:
            dw = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None


def _check_inputs(hidden, weight, targets, weights) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden [N, {hidden.shape[1]}] vs weight [V, {weight.shape[1]}]"
        )
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(
            f"hidden and weight need one floating dtype, got {hidden.dtype} and {weight.dtype}"
        )
    if targets.dtype != torch.int64 or targets.shape != (hidden.shape[0],):
        raise ValueError(
            f"targets must be int64 [N={hidden.shape[0]}], got {targets.dtype} "
            f"{tuple(targets.shape)}"
        )
    if not weights.is_floating_point() or weights.shape != (hidden.shape[0],):
        raise ValueError(
            f"weights must be float [N={hidden.shape[0]}], got {weights.dtype} "
            f"{tuple(weights.shape)}"
        )
    if len({hidden.device, weight.device, targets.device, weights.device}) != 1:
        raise ValueError("hidden, weight, targets and weights must be on one device")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(f"targets must lie in [0, {weight.shape[0]})")


def weighted_token_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_size: int | None = None,
    return_logprobs: bool = False,
    backend: str | None = None,
):
    """sum_t weights_t * (-log softmax(hidden_t @ weight^T)[targets_t]) as a 0-dim fp32 tensor.

    hidden [N, H] and weight [V, H] (fp32 or bf16/fp16, one dtype) are differentiable;
    targets [N] int64 and weights [N] float are not. ``chunk_size`` tokens per logits tile
    (default: about 2^25 logits). ``return_logprobs=True`` also returns the detached per-token
    log-probabilities [N] (fp32). ``backend`` is "triton" or "torch" (default: by device).
    """
    _check_inputs(hidden, weight, targets, weights)
    backend = backend or ("triton" if hidden.is_cuda else "torch")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunk = chunk_size or default_chunk_size(max(1, hidden.shape[0]), weight.shape[0])
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with launch.on_device(hidden):  # the gradients are computed here, in the forward
        loss, logprobs = _WeightedTokenNLL.apply(
            hidden.contiguous(),
            weight.contiguous(),
            targets.contiguous(),
            weights.contiguous(),
            chunk,
            backend,
            need_grad,
        )
    return (loss, logprobs) if return_logprobs else loss
