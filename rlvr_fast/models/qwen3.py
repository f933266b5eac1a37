"""Qwen3 decoder (and the Qwen2 / Llama variants that differ only by two switches), our own code.

Layout follows nano-vllm: q/k/v projections are stored packed as one ``qkv_proj`` and the SwiGLU
gate/up projections as one ``gate_up_proj``, so a decode step runs two GEMMs per block instead of
five. ``rlvr_fast.models.checkpoint`` maps these to and from Hugging Face's per-projection names.

Entry points:
- ``forward(input_ids, attention_mask)``: full sequence (training / scoring); returns logits
  ``[B, T, V]`` or, with ``return_hidden=True``, the final hidden states ``[B, T, H]`` for the
  fused loss op, which multiplies them by ``lm_head.weight`` chunk by chunk.
- ``infer(input_ids, context)``: one pass of the rollout engine (prefill or decode) on its paged
  KV cache, described by a ``ForwardContext``; returns the logits of each row's last real token
  ``[R, V]``. The model holds no cache: each layer reads the context. A float32 CPU pass through
  the cache (the engine's decode) runs whole in one C++ call (``paged_pass_cpp``).

``model.activation_checkpointing = True`` keeps only each decoder layer's input for backward and
recomputes the layer's activations there (``torch.utils.checkpoint``, non-reentrant), in training
forwards only: a pass with autograd recording and no KV cache. Gradients are unchanged; the
memory saved for backward drops from every layer's activations to one hidden state per layer.
``model.model.checkpointed_layers = k`` checkpoints the first k layers only (what
``activation_checkpointing="auto"`` sets from the memory plan).

Numerics follow the Hugging Face implementation: RMSNorm in fp32 (``rlvr_fast.ops.rms_norm``), RoPE
cos/sin computed in fp32 and cast to the activation dtype, rotate-half RoPE with the config's
theta, softmax scale 1/sqrt(D).
"""

from __future__ import annotations

import itertools
import operator
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlvr_fast.kernels.qk_norm_rope import apply_rope, split_heads
from rlvr_fast.models.attention import attend_paged, dense_attention
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.context import ForwardContext
from rlvr_fast.ops.rms_norm import add_rms_norm, rms_norm
from rlvr_fast.ops.silu_mul import silu_mul


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin of each position, looked up in a table of every position below
    ``max_positions`` (one index per pass instead of the ten element-wise ops that form them).

    The table is made once per (device, dtype) with Hugging Face's order: angles in fp32, then
    cos / sin, then the cast, so a looked-up row is the one a pass would compute. The inverse
    frequencies are a plain fp32 attribute rather than a buffer, so ``model.to(bfloat16)``
    cannot round them; nothing here grows or is replaced during a run, which a captured CUDA
    graph relies on.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.max_positions = max_positions
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] int64 (< max_positions) -> cos, signed sin [B, T, 1, D] in
        ``dtype``. The sin's first half is negated, which folds rotate-half's sign into it
        (see ``apply_rope``)."""
        cos, signed_sin = self.table(positions.device, dtype)
        return cos[positions], signed_sin[positions]

    def table(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [max_positions, 1, D] in ``dtype``."""
        key = (device, dtype)
        if key not in self._tables:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
            inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
            angles = torch.arange(self.max_positions, device=device).float()[:, None] * inv_freq
            cos = torch.cat((angles, angles), dim=-1).unsqueeze(1).cos()
            sin = angles.sin()
            signed_sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1)
            self._tables[key] = (cos.to(dtype), signed_sin.to(dtype))
        return self._tables[key]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv_proj(x)  # [B, T, (Hq + 2Hkv) D]
        if context.kv_cache is None:
            out = dense_attention(*self.rotated_heads(qkv, cos, sin), context.mask)
        else:
            # A paged pass: norm, RoPE and the KV store in one fused op, then paged attention.
            weights = (
                (self.q_norm.weight, self.k_norm.weight)
                if self.q_norm is not None
                else (None, None)
            )
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            out = attend_paged(self.layer_idx, qkv, *weights, eps, cos, sin, context)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.q_size))

    def rotated_heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, Hq, T, D], k, v [B, Hkv, T, D] of a cache-free pass, in the decoder's torch ops
        (which autograd differentiates)."""
        qk, v = split_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Every head normalised on its own: q and k heads in one pass, each with its weight.
            weight = torch.cat(
                (
                    self.q_norm.weight.expand(self.num_heads, -1),
                    self.k_norm.weight.expand(self.num_kv_heads, -1),
                )
            )
            qk = rms_norm(qk, weight, self.q_norm.eps)
        # q and k share one RoPE pass: half the element-wise launches of rotating them apart.
        qk = apply_rope(qk, cos, sin).transpose(1, 2)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, context):
        if runs_in_cpp(context):
            return self.paged_pass_cpp(x, cos, sin, context)
        return self.pass_ops(x, cos, sin, context)

    def pass_ops(self, x, cos, sin, context):
        """The layer as a sequence of ops, each resolving its own backend."""
        # The residual add and the post-attention norm in one op (the same roundings).
        norm = self.post_attention_layernorm
        h, x = add_rms_norm(
            self.self_attn(self.input_layernorm(x), cos, sin, context), x, norm.weight, norm.eps
        )
        return x + self.mlp(h)

    def paged_pass_cpp(self, x, cos, sin, context):
        """The same layer in one C++ call (``csrc/decoder_layer.cpp``, bitwise these ops): a
        float32 CPU pass through the paged cache (not a fresh prefill), where Python between
        the ops is half the cost. The engine's passes get here (its backend "cpp", under
        inference mode); the model's norms share one eps."""
        from rlvr_fast._C import decoder_layer_cpu  # built by setup.py

        cache = context.kv_cache[self.self_attn.layer_idx]
        return decoder_layer_cpu(
            x,
            *self.cpp_weights(),
            self.input_layernorm.eps,
            cos,
            sin,
            cache.keys,
            cache.values,
            cache.key_slots,
            cache.value_slots,
            context.slot_mapping,
            context.block_tables,
            context.context_lens,
            self.self_attn.num_heads,
        )

    def cpp_weights(self) -> list[torch.Tensor | None]:
        """The layer's weights in the order the C++ layer takes them (None: absent)."""
        attn, mlp = self.self_attn, self.mlp
        norms = (
            [attn.q_norm.weight, attn.k_norm.weight] if attn.q_norm is not None else [None, None]
        )
        return [
            self.input_layernorm.weight,
            attn.qkv_proj.weight,
            attn.qkv_proj.bias,
            *norms,
            attn.o_proj.weight,
            self.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight,
            mlp.down_proj.weight,
        ]


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings
        )
        # The first this many layers recompute in backward (0: none; all: checkpointing on).
        self.checkpointed_layers = 0

    @property
    def activation_checkpointing(self) -> bool:
        return self.checkpointed_layers > 0

    @activation_checkpointing.setter
    def activation_checkpointing(self, enabled: bool) -> None:
        self.checkpointed_layers = len(self.layers) if enabled else 0

    def forward(self, input_ids: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(context.positions, x.dtype)
        recompute = torch.is_grad_enabled() and context.kv_cache is None
        for index, layer in enumerate(self.layers):
            if recompute and index < self.checkpointed_layers:
                x = checkpoint(layer, x, cos, sin, context, use_reentrant=False)
            else:
                x = layer(x, cos, sin, context)
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @property
    def activation_checkpointing(self) -> bool:
        """Recompute each decoder layer in backward instead of saving its activations."""
        return self.model.activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, enabled: bool) -> None:
        self.model.activation_checkpointing = bool(enabled)

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

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """input_ids [B, T] int64; attention_mask [B, T] (1 = token, 0 = padding, either side).

        Returns logits [B, T, V] or, with ``return_hidden``, hidden states [B, T, H].
        Positions count real tokens only, so left- and right-padded rows score identically.
        """
        if attention_mask is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(
                input_ids
            )
            context = ForwardContext(positions)
        else:
            refuse_masked_training(input_ids.device)
            context = ForwardContext(
                positions_from_mask(attention_mask),
                mask=causal_padding_mask(attention_mask.bool(), input_ids.shape[1]),
            )
        hidden = self.model(input_ids, context)
        return hidden if return_hidden else self.lm_head(hidden)

    def run_pass(self, compute):
        """``compute()``, a pass that reads this model's modules and weights directly (a fused
        loss: the decoder, then the LM head's weight), as a forward of this model: a sharded
        model (FSDP2's register_fsdp_forward_method) gathers its root weights around it."""
        return compute()

    def infer(self, input_ids: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """One rollout-engine pass over input_ids [R, T]: logits [R, V] of each row's last real
        token (``context.logits_index``; the only token when T = 1)."""
        if runs_in_cpp(context):
            return self.paged_pass_cpp(input_ids, context)
        hidden = self.model(input_ids, context)
        if context.logits_index is None:
            last = hidden[:, -1]
        else:
            last = hidden.flatten(0, 1).index_select(0, context.logits_index)
        return self.lm_head(last)

    def paged_pass_cpp(self, input_ids: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """``infer`` in one C++ call (``csrc/decoder_layer.cpp``'s ``DecoderModelCpu``, bitwise
        the modules' pass): the embedding, the RoPE lookup, every layer, the final norm and the
        LM head, where the Python around the layers costs a small model's decode step a third
        of its time. A float32 CPU pass through the paged cache (not a fresh prefill)."""
        return self.cpp_decoder().logits(
            input_ids,
            context.positions,
            context.kv_cache,
            context.slot_mapping,
            context.block_tables,
            context.context_lens,
            context.logits_index,
        )

    def cpp_decoder(self):
        """The C++ pass holding this model's weights: the parameter tensors themselves, so an
        optimizer's in-place step needs no refresh. Made on first use and again whenever a
        parameter was replaced by another tensor (``untie_weights``, a load with
        ``assign=True``); kept beside the model, not on it, so the model still deep-copies."""
        held = _CPP_DECODERS.get(self)
        if held is None or not held.current():
            held = _CPP_DECODERS[self] = HeldDecoder(self)
        return held.decoder


class HeldDecoder:
    """A model's ``DecoderModelCpu`` and the parameters it was made from. ``current`` checks,
    at C speed (a pass of the tiny model takes about 2 ms; walking its modules in Python took
    a sixth of that), that each of the model's modules still holds those very parameters."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        from rlvr_fast._C import DecoderModelCpu  # built by setup.py

        decoder = model.model
        self.slots = [module._parameters for module in model.modules()]
        self.parameters = self._parameters_now()
        embedding = decoder.embed_tokens.weight
        cos, sin = decoder.rotary.table(embedding.device, embedding.dtype)
        self.decoder = DecoderModelCpu(
            embedding,
            [layer.cpp_weights() for layer in decoder.layers],
            decoder.norm.weight,
            model.lm_head.weight,
            cos,
            sin,
            decoder.norm.eps,
            model.config.num_attention_heads,
        )

    def _parameters_now(self) -> tuple:
        return tuple(itertools.chain.from_iterable(map(dict.values, self.slots)))

    def current(self) -> bool:
        now = self._parameters_now()
        return len(now) == len(self.parameters) and all(map(operator.is_, now, self.parameters))


# Qwen3ForCausalLM.cpp_decoder: each model's C++ pass (a model's modules stay its own).
_CPP_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runs_in_cpp(context: ForwardContext) -> bool:
    """A pass that C++ runs: float32 CPU (the engine resolved backend "cpp"), through the paged
    cache (block tables: not a fresh prefill), under inference mode."""
    return (
        context.backend == "cpp"
        and context.block_tables is not None
        and torch.is_inference_mode_enabled()
    )


def refuse_masked_training(device: torch.device) -> None:
    """A padded forward under autograd on CUDA is refused by name: SDPA's flash kernel takes no
    mask, so each layer would keep [B, Hq, T, T] scores for backward, which no memory plan
    counts (``rlvr_fast.train.memory_plan``; the trainer's own passes are unpadded and causal).
    Without gradients, or on a CPU (whose flash kernel takes the mask), it runs."""
    if device.type == "cuda" and torch.is_grad_enabled():
        raise ValueError(
            "Qwen3ForCausalLM.forward: attention_mask under autograd on CUDA would keep T x T "
            "attention scores per layer that the memory plan does not count; run it under "
            "torch.no_grad(), or train through rlvr_fast's trainer (unpadded causal passes)"
        )


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
    rows = cols[tk - tq :]
    causal = cols[None, :] <= rows[:, None]
    diagonal = cols[None, :] == rows[:, None]
    return ((causal & key_valid[:, None, :]) | diagonal).unsqueeze(1)
