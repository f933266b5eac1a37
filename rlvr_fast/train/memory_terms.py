"""The memory plan's formulas (``rlvr_fast.train.memory_plan`` adds them into terms): bytes per
parameter of each copy a precision keeps, per token of each activation a decoder layer keeps, of
the fused loss, the optimizer step and the KV cache (the decode working set and SDPA's math-path
scores are the engine's, ``rlvr_fast.engine.memory``); and LoRA's (``rlvr_fast.models.lora``):
the adapters' parameters, the engine's merged twin of each adapted projection and what an adapted
projection keeps for backward per token; Adafactor's factored state."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.lora import (
    PROJECTIONS,
    LoraSettings,
    adapted_projections,
    in_features,
    part_rows,
)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each copy a precision keeps (0: no such copy)."""

    compute: int
    master: int
    gradient: int
    moment: int
    half: str = "bf16"  # the 2-byte dtype, where one is used


PRECISIONS = {
    "fp32": Precision(compute=4, master=0, gradient=4, moment=4),
    "bf16-mixed": Precision(compute=2, master=4, gradient=4, moment=4),
    "bf16-true": Precision(compute=2, master=0, gradient=2, moment=2),
    "fp16-mixed": Precision(compute=2, master=4, gradient=4, moment=4, half="fp16"),
}


def _widths(config: ModelConfig) -> tuple[int, int, int, int]:
    """Hidden, MLP, query and key/value widths."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return config.hidden_size, config.intermediate_size, q, kv


def _norm_saved(width: int, rows: int, e: int) -> int:
    """RMSNorm (``rms_norm_reference``) over ``width`` per token, ``rows`` normalised rows: the
    fp32 input (the input itself in fp32, a cast otherwise), its inverse RMS, the normalised
    value in the compute dtype and the weighted output (kept by the next linear layer)."""
    return 4 * width + 4 * rows + 2 * e * width


def saved_bytes_per_token_layer(config: ModelConfig, e: int) -> int:
    """Bytes one decoder layer keeps for backward per token, compute dtype size ``e``."""
    h, i, q, kv = _widths(config)
    heads = config.num_attention_heads
    saved = 2 * _norm_saved(h, 1, e)  # input_layernorm, post_attention_layernorm
    saved += e * (q + 2 * kv)  # qkv_proj's output: v (and, in fp32, the q / k norm's input)
    if config.qk_norm:
        qk, rows = q + kv, heads + config.num_key_value_heads
        # No weighted output kept (RoPE's multiplies keep only cos / sin); no fp32 cast in fp32.
        saved += (4 * qk if e < 4 else 0) + 4 * rows + e * qk
    saved += e * (q + kv)  # RoPE's output: attention's q and k
    saved += e * q + 4 * heads  # attention's output (o_proj's input) and its log-sum-exp
    saved += 4 * e * i  # gate_up_proj's output, silu(gate), silu(gate) * up
    return saved


def tail_bytes_per_token(config: ModelConfig, e: int) -> int:
    """Kept outside the layers per token: the final norm, the cos / sin rows gathered from the
    RoPE tables."""
    return _norm_saved(config.hidden_size, 1, e) + 2 * e * config.head_dim


def rope_table_bytes(config: ModelConfig, e: int) -> int:
    """``RotaryEmbedding``'s cos and signed sin tables [max_position_embeddings, 1, D]."""
    return 2 * config.max_position_embeddings * config.head_dim * e


def backward_bytes_per_token(config: ModelConfig, e: int) -> int:
    """Backward's working set beyond what is saved, per token: the gradients in flight through
    one layer's MLP (three [T, I] wide), and in bf16 one more hidden state (the fp32 norm input's
    gradient, cast back); as measured on the meta device, where this is exact without
    checkpointing."""
    return e * 3 * config.intermediate_size + (4 - e) * config.hidden_size


def activation_bytes(config: ModelConfig, e: int, tokens: int, checkpointing: bool | int) -> int:
    """Peak activation memory of one forward + backward over ``tokens`` tokens, ``checkpointing``
    every layer (True), none (False) or the first that many: a checkpointed layer keeps its
    input, the others all they save, and the recompute adds one layer's."""
    checkpointed = checkpointed_layers(config, checkpointing)
    layer = saved_bytes_per_token_layer(config, e)
    per_token = tail_bytes_per_token(config, e) + backward_bytes_per_token(config, e)
    per_token += (
        checkpointed * e * config.hidden_size + (config.num_hidden_layers - checkpointed) * layer
    )
    if checkpointed:
        per_token += layer
    return tokens * per_token


def checkpointed_layers(config: ModelConfig, checkpointing: bool | int) -> int:
    """How many decoder layers recompute: all (True), none (False) or that many."""
    if isinstance(checkpointing, bool):
        return config.num_hidden_layers if checkpointing else 0
    return min(checkpointing, config.num_hidden_layers)


def fused_loss_bytes(
    config: ModelConfig, e: int, tokens: int, chunk: int, head_gradient: bool = True
) -> int:
    """``weighted_token_nll`` on CUDA: the fp32 dW [V, H] (the GEMM accumulates into it, no
    per-chunk product), the hidden states and their gradient [N, H]; in the forward one logits
    tile [chunk, V] (the row kernel turns it into its gradient in place), in backward dW cast to
    the compute dtype (none in fp32) and the hidden gradient scaled by the incoming one. A
    frozen head (``head_gradient`` False: LoRA) has no dW."""
    vh = config.vocab_size * config.hidden_size if head_gradient else 0
    nh = tokens * config.hidden_size * e
    backward = (e * vh if e < 4 else 0) + nh
    return 4 * vh + 2 * nh + max(chunk * config.vocab_size * e, backward)


# torch's AdamW implementations, as the trainer picks them: foreach (its default on CUDA), the
# fused kernel (``adamw_fused``), single-tensor (its default on the CPU).
ADAMW_STEPS = ("foreach", "fused", "single-tensor")


def adamw_step_bytes(step: str, trained: int, largest: int, moment: int) -> int:
    """Temporaries of one torch AdamW step over ``trained`` elements whose largest tensor has
    ``largest``, moments of ``moment`` bytes (measured on the meta device, tests): foreach takes
    the square root of every second moment at once, a list as large as the moments; single-tensor
    the root and its quotient by the bias correction of one parameter while the previous
    parameter's denominator is still held, at most 3 x the largest (2 x when the largest is
    followed by smaller ones, as the embedding is); the fused kernel updates in place."""
    if step not in ADAMW_STEPS:
        raise ValueError(f"adamw step must be one of {', '.join(ADAMW_STEPS)}, got {step!r}")
    if step == "foreach":
        return trained * moment
    if step == "single-tensor":
        return 3 * largest * moment
    return 0


def largest_parameter(config: ModelConfig, lora: LoraSettings | None = None) -> tuple[int, int]:
    """(rows, columns) of the largest trained tensor: the embedding or a packed projection's
    weight; under LoRA the largest A [r, in] or B [rows, r]."""
    if lora is None:
        weights = [(sum(part_rows(config, s)), in_features(config, s)) for s in PROJECTIONS]
        return max([(config.vocab_size, config.hidden_size), *weights], key=math.prod)
    shapes = [(0, 0)]
    for suffix, parts in adapted_projections(config, lora).values():
        rows = dict(zip(PROJECTIONS[suffix], part_rows(config, suffix)))
        for p in parts:
            shapes += [(lora.rank, in_features(config, suffix)), (rows[p], lora.rank)]
    return max(shapes, key=math.prod)


def adafactor_step_bytes(largest: tuple[int, int], gradient: int) -> int:
    """Temporaries of one Adafactor step (``rlvr_fast.train.adafactor``), tensor by tensor, at
    the largest (measured on the meta device, tests): g^2 + eps and the update it gives, fp32
    and the tensor's size each, and its row and column factors; with bf16 gradients
    (bf16-true) the tensor's fp32 weight and gradient besides."""
    rows, cols = largest
    copies = 2 if gradient == 4 else 4
    return 4 * (copies * rows * cols + rows + cols)


def eager_loss_bytes(config: ModelConfig, e: int, tokens: int) -> int:
    """Logits [N, V], their fp32 copy, log-softmax kept for backward, and in backward the
    gradients of both."""
    return tokens * config.vocab_size * (2 * e + 12)


def kv_block_bytes(config: ModelConfig, block_size: int, e: int) -> int:
    """Keys and values of ``block_size`` tokens in every layer."""
    width = config.num_key_value_heads * config.head_dim * e
    return config.num_hidden_layers * 2 * block_size * width


def merged_twin_parameters(config: ModelConfig, settings: LoraSettings) -> int:
    """Elements of the merged weights the engine decodes from: a whole copy of each adapted
    projection module (its frozen parts included: one packed weight)."""
    return sum(
        in_features(config, suffix) * sum(part_rows(config, suffix))
        for suffix, _ in adapted_projections(config, settings).values()
    )


def adapter_saved_bytes_per_token(config: ModelConfig, settings: LoraSettings, e: int) -> int:
    """Bytes the adapted projections of every layer keep for backward per token, beyond the
    frozen projections': each part's A x (B's input, r wide) and, with dropout, its own dropped
    input (in wide) and mask (a byte per element)."""
    saved = 0
    for suffix, parts in adapted_projections(config, settings).values():
        dropout = (e + 1) * in_features(config, suffix) if settings.dropout else 0
        saved += len(parts) * (e * settings.rank + dropout)
    return saved


def adafactor_state_elements(
    config: ModelConfig, untied: bool = False, lora: LoraSettings | None = None
) -> int:
    """Float32 elements of Adafactor's state (``rlvr_fast.train.adafactor``) over the trained
    Hugging Face tensors (LoRA: the adapters alone): a matrix's row and column statistics
    (rows + columns), a vector's every element."""
    h, i, q, kv = _widths(config)
    if lora is not None:
        rank, total = lora.rank, 0
        for suffix, parts in adapted_projections(config, lora).values():
            rows = dict(zip(PROJECTIONS[suffix], part_rows(config, suffix)))
            # A [r, in] and B [rows, r] of each adapted part.
            total += sum(rank + in_features(config, suffix) + rows[p] + rank for p in parts)
        return total
    # q, k, v, o; gate, up, down; the two norms.
    layer = (q + h) + 2 * (kv + h) + (h + q) + 2 * (i + h) + (h + i) + 2 * h
    if config.attention_bias:
        layer += q + 2 * kv
    if config.qk_norm:
        layer += 2 * config.head_dim
    embedding = config.vocab_size + h
    head = embedding if untied else 0
    return config.num_hidden_layers * layer + embedding + head + h
