"""Qwen3 decoder (and the Qwen2 / Llama variants that differ only by two switches), our own code.

Layout follows nano-vllm: q/k/v projections are stored packed as one ``qkv_proj`` and the SwiGLU
gate/up projections as one ``gate_up_proj``, so a decode step runs two GEMMs per block instead of
five. ``rlvr_fast.models.checkpoint`` maps these to and from Hugging Face's per-projection names.

Entry points:
- ``forward(input_ids, attention_mask)``: full sequence (training / scoring); returns logits
  ``[B, T, V]`` or, with ``return_hidden=True``, the final hidden states ``[B, T, H]`` for the
  fused loss op, which multiplies them by ``lm_head.weight`` chunk by chunk.
- ``prefill(input_ids, attention_mask, cache)`` and ``decode(token_ids, cache)``: incremental
  decoding on a ``KVCache``; both return logits of the last position only ``[B, V]``.

Numerics follow the Hugging Face implementation: RMSNorm in fp32, RoPE cos/sin computed in fp32 and
cast to the activation dtype, rotate-half RoPE with the config's theta, softmax scale 1/sqrt(D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlvr_fast.engine.attention import attention
from rlvr_fast.engine.kv_cache import KVCache
from rlvr_fast.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hugging Face's order: normalise in fp32, round to the input dtype, then scale. Written
        # out because on CPU F.rms_norm dispatches to the same ops plus a slower wrapper.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by absolute position, grown on demand.

    Kept as plain fp32 attributes rather than buffers so ``model.to(bfloat16)`` cannot round the
    frequencies and a meta-device build needs no re-initialisation.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._cos = self._sin = None

    def forward(self, positions: torch.Tensor, max_positions: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] int64, all < ``max_positions`` -> cos, sin [B, T, 1, D] in ``dtype``.

        The bound comes from the caller (sequence or cache length) so that no device sync is
        needed to read ``positions.max()``.
        """
        if self._cos is None or self._cos.shape[0] < max_positions or self._cos.device != positions.device:
            current = 0 if self._cos is None else self._cos.shape[0]
            self._build(max(max_positions, 2 * current, 256), positions.device)
        return (self._cos[positions].unsqueeze(2).to(dtype),
                self._sin[positions].unsqueeze(2).to(dtype))

    def _build(self, size: int, device: torch.device) -> None:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        steps = torch.arange(size, device=device, dtype=torch.float32)
        table = (steps[:, None] * inv_freq[None, :]).repeat(1, 2)
        self._cos, self._sin = table.cos(), table.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = self.qkv_proj(x).view(batch, seq, -1, self.head_dim)  # [B, T, Hq + 2Hkv, D]
        qk, v = heads[:, :, :self.num_heads + self.num_kv_heads], heads[:, :, -self.num_kv_heads:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :self.num_heads]),
                            self.k_norm(qk[:, :, self.num_heads:])), dim=2)
        # q and k share one RoPE pass: half the element-wise launches of rotating them apart.
        qk = apply_rope(qk, cos, sin).transpose(1, 2)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = v.transpose(1, 2)
        if cache is None:
            out = attention(q, k, v, mask)
        else:
            out = cache.attend(self.layer_idx, q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, cache: KVCache | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # Positions never exceed the column index, which is bounded by the cache length.
        max_positions = input_ids.shape[1] + (cache.length if cache is not None else 0)
        cos, sin = self.rotary(positions, max_positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (again after
        ``to_empty``, which allocates every parameter afresh)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def untie_weights(self) -> None:
        """Give the LM head its own copy of the embedding, as the study trains Qwen3-0.6B-Base
        (its P = 751,632,384 counts the head separately)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = nn.Parameter(self.model.embed_tokens.weight.detach().clone())
            self.config.tie_word_embeddings = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                return_hidden: bool = False) -> torch.Tensor:
        """input_ids [B, T] int64; attention_mask [B, T] (1 = token, 0 = padding, either side).

        Returns logits [B, T, V] or, with ``return_hidden``, hidden states [B, T, H].
        Positions count real tokens only, so left- and right-padded rows score identically.
        """
        if attention_mask is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            mask = None
        else:
            positions = positions_from_mask(attention_mask)
            mask = causal_padding_mask(attention_mask.bool(), input_ids.shape[1])
        hidden = self.model(input_ids, positions, mask)
        return hidden if return_hidden else self.lm_head(hidden)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """Run left-padded prompts [B, T] into an empty cache; logits of the last column [B, V]."""
        valid = attention_mask.bool()
        positions = positions_from_mask(attention_mask)
        mask = cache.open_columns(valid)
        mask = causal_padding_mask(mask, input_ids.shape[1])
        hidden = self.model(input_ids, positions, mask, cache)
        cache.advance(input_ids.shape[1], next_positions=positions[:, -1] + 1)
        return self.lm_head(hidden[:, -1])

    def decode(self, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row [B] appended to the cache; logits [B, V]."""
        positions = cache.next_positions.unsqueeze(1)
        hidden = self.model(token_ids.unsqueeze(1), positions, cache.decode_mask(), cache)
        cache.advance(1)
        return self.lm_head(hidden[:, -1])


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of every column counting only real tokens; padding columns get 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def causal_padding_mask(key_valid: torch.Tensor, num_queries: int) -> torch.Tensor:
    """[B, 1, Tq, Tk] boolean mask from key validity [B, Tk]: causal, padding keys hidden.

    Queries are the last Tq of the Tk columns. Every query may always see its own column, so a
    padding query row is never fully masked (which would make SDPA return NaN); padding outputs
    are never read.
    """
    tq, tk = num_queries, key_valid.shape[1]
    cols = torch.arange(tk, device=key_valid.device)
    rows = cols[tk - tq:]
    causal = cols[None, :] <= rows[:, None]
    diagonal = cols[None, :] == rows[:, None]
    return ((causal & key_valid[:, None, :]) | diagonal).unsqueeze(1)
