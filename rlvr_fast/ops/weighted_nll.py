"""``weighted_token_nll``: sum_t w_t * NLL_t from hidden states and the LM head, chunked.

Never materialises [tokens, vocab]: tokens are processed in chunks whose logits tile is turned in
place into the logit gradient (see ``rlvr_fast.kernels.weighted_nll`` for the split between the
row kernel and the GEMMs). The gradients are computed during the forward pass and scaled by the
incoming gradient in backward, so logits are never recomputed. dW is accumulated in fp32 by the
GEMM itself (``accumulate_grad_weight``), and the input check never reads a CUDA tensor back, so
a call makes no host sync. Backend, resolved once per call:
CUDA tensors use the Triton row kernel, CPU tensors its torch twin; ``backend=`` overrides (tests
run the Triton kernel on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from rlvr_fast.kernels.weighted_nll import weighted_nll_rows_torch, weighted_nll_rows_triton
from rlvr_fast.ops import launch

BACKENDS = {"torch": weighted_nll_rows_torch, "triton": weighted_nll_rows_triton}
# One chunk's logits tile takes about this many bytes in the input dtype (220 rows at V = 151,936
# in fp32, 441 in bf16): the tile is the only [rows, V] buffer, so a bf16 tile takes twice the rows.
CHUNK_BYTES = 2**27


def default_chunk_size(num_tokens: int, vocab: int, element_size: int) -> int:
    """The most rows a tile of CHUNK_BYTES holds, then evened out over the chunks it takes (no
    short last chunk: 2,048 tokens go in ten chunks of 205 rows, not nine of 220 and one of 68)."""
    most = max(1, CHUNK_BYTES // (vocab * element_size))
    chunks = -(-num_tokens // most)
    return max(1, -(-num_tokens // chunks))


def accumulate_grad_weight(grad_weight: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor):
    """grad_weight (fp32) += dlogits^T @ h inside one GEMM: bf16/fp16 inputs on CUDA go through
    cuBLAS with an fp32 output and beta = 1, so no chunk writes a rounded [V, H] product that is
    then converted and added. The CPU has no mixed-dtype GEMM: a half-precision chunk is widened
    (exactly) to fp32 first."""
    if dlogits.dtype == torch.float32:
        grad_weight.addmm_(dlogits.T, h)
    elif dlogits.is_cuda:
        torch.addmm(grad_weight, dlogits.T, h, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight.addmm_(dlogits.T.float(), h.float())


def sequence_sums_loss(
    logprobs: torch.Tensor, weights: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """sum_s weights_s * (sum_{t in s} nll_t): each sequence's NLL summed first, over its row of
    a zero-padded [S, max_len] table as the eager sum-then-scale loss sums it, then scaled."""
    nll = torch.nn.utils.rnn.pad_sequence(list((-logprobs).split(lengths)), batch_first=True)
    return (weights.float() * nll.sum(dim=1)).sum()


class _WeightedTokenNLL(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, targets, token_weights, loss_of, chunk_size, backend, need_grad
    ):
        ctx.weight_dtype = weight.dtype
        rows_fn = BACKENDS[backend]
        num_tokens = hidden.shape[0]
        logprobs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        # A frozen head (LoRA) gets no dW: neither its fp32 [V, H] nor its GEMMs.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_grad and ctx.needs_input_grad[1]
            else None
        )
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            h = hidden[start:end]
            logits = h @ weight.T  # [C, V], becomes the logit gradient in place
            _, logprobs[start:end] = rows_fn(
                logits, targets[start:end], token_weights[start:end], need_grad
            )
            if need_grad:
                torch.mm(logits, weight, out=grad_hidden[start:end])
                if grad_weight is not None:
                    accumulate_grad_weight(grad_weight, logits, h)
            del logits  # else the next chunk's tile is allocated while this one is alive
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(logprobs)
        return loss_of(logprobs), logprobs

    @staticmethod
    def backward(ctx, grad_loss, grad_logprobs):
        grad_hidden, grad_weight = ctx.saved_tensors
        dh = dw = None
        if ctx.needs_input_grad[0]:
            dh = grad_hidden * grad_loss  # in fp32: a loss scale of 2^16 is no fp16 number
        if ctx.needs_input_grad[1]:
            dw = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None


def _check_inputs(hidden, weight, targets, weights, sequence_lengths) -> None:
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
    _check_weights(hidden.shape[0], weights, sequence_lengths)
    if len({hidden.device, weight.device, targets.device, weights.device}) != 1:
        raise ValueError("hidden, weight, targets and weights must be on one device")
    check_target_range(targets, weight.shape[0])


def _check_weights(num_tokens: int, weights, sequence_lengths) -> None:
    if sequence_lengths is not None and (
        any(n < 0 for n in sequence_lengths) or sum(sequence_lengths) != num_tokens
    ):
        raise ValueError(
            f"sequence_lengths must be >= 0 and sum to N={num_tokens}, got {list(sequence_lengths)}"
        )
    rows = num_tokens if sequence_lengths is None else len(sequence_lengths)
    if not weights.is_floating_point() or weights.shape != (rows,):
        raise ValueError(
            f"weights must be float [{'N' if sequence_lengths is None else 'S'}={rows}], "
            f"got {weights.dtype} {tuple(weights.shape)}"
        )


def check_target_range(targets: torch.Tensor, vocab: int) -> None:
    """A ValueError before any launch, on every device: the kernels index the weight's rows by
    target, so on CUDA an out-of-range target would be a device-side assert or fault that ends
    the process's CUDA context. One host sync per call (a single flag read back), once per loss,
    not per chunk."""
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        raise ValueError(f"targets must lie in [0, {vocab})")


def weighted_token_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    *,
    sequence_lengths: list[int] | None = None,
    chunk_size: int | None = None,
    return_logprobs: bool = False,
    backend: str | None = None,
):
    """sum_t weights_t * (-log softmax(hidden_t @ weight^T)[targets_t]) as a 0-dim fp32 tensor.

    hidden [N, H] and weight [V, H] (fp32 or bf16/fp16, one dtype) are differentiable;
    targets [N] int64 and weights [N] float are not. With ``sequence_lengths`` (S ints summing to
    N: the tokens are S sequences back to back) ``weights`` is [S], one per sequence, and the loss
    is sum_s weights_s * (sum_{t in s} NLL_t), each sequence's sum formed first (the study's
    sum-then-scale order). ``chunk_size`` tokens per logits tile (default: CHUNK_BYTES per tile).
    ``return_logprobs=True`` also returns the detached per-token log-probabilities [N] (fp32).
    ``backend`` is "triton" or "torch" (default: by device).
    """
    _check_inputs(hidden, weight, targets, weights, sequence_lengths)
    backend = backend or ("triton" if hidden.is_cuda else "torch")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunk = chunk_size or default_chunk_size(
        max(1, hidden.shape[0]), weight.shape[0], weight.element_size()
    )
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    weights = weights.contiguous()
    if sequence_lengths is None:
        token_weights = weights

        def loss_of(logprobs):
            return (-weights.float() * logprobs).sum()

    else:
        lengths = list(sequence_lengths)
        token_weights = torch.repeat_interleave(
            weights, torch.tensor(lengths, device=weights.device), output_size=hidden.shape[0]
        )

        def loss_of(logprobs):
            return sequence_sums_loss(logprobs, weights, lengths)

    with launch.on_device(hidden):  # the gradients are computed here, in the forward
        loss, logprobs = _WeightedTokenNLL.apply(
            hidden.contiguous(),
            weight.contiguous(),
            targets.contiguous(),
            token_weights,
            loss_of,
            chunk,
            backend,
            need_grad,
        )
    return (loss, logprobs) if return_logprobs else loss
