"""Decoder-only model configuration read from a Hugging Face ``config.json``.

One dataclass covers Qwen3 (the reference architecture: q/k RMSNorm, no attention bias), Qwen2
(bias on q/k/v, no q/k norm) and Llama (neither), because the three differ only in those two
switches. Anything our engine does not implement (rope scaling, sliding windows, MoE) is refused
here with a clear error rather than silently computed wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")


class ConfigError(ValueError):
    """A checkpoint's config.json describes something this engine cannot run."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = True
    model_type: str = "qwen3"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"config: head_dim must be even for RoPE, got {self.head_dim}")

    def num_parameters(self, *, untied: bool = True) -> int:
        """Trainable parameters as the seed counts them.

        ``untied=True`` counts the LM head separately even when the checkpoint ties it to the
        embedding, which is how the study reports P = 751,632,384 for Qwen3-0.6B-Base.
        """
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * self.intermediate_size + 2 * h
        embedding = self.vocab_size * h
        head = embedding if (untied or not self.tie_word_embeddings) else 0
        return self.num_hidden_layers * per_layer + embedding + head + h

    @classmethod
    def from_hf_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type", "qwen3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config: model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        _refuse_unsupported(raw)
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                model_type=model_type,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            )
        except KeyError as missing:
            raise ConfigError(f"config: missing field {missing.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: invalid JSON ({err.msg} at line {err.lineno})") from None
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict:
        """The config.json a Hugging Face ``AutoModelForCausalLM`` can load."""
        raw = asdict(self)
        del raw["qk_norm"]
        arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
        raw["architectures"] = [arch[self.model_type]]
        raw["hidden_act"] = "silu"
        raw["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        raw["rope_scaling"] = None
        raw["use_cache"] = True
        return raw


def _rope_theta(raw: dict) -> float:
    # transformers 5 writes rope settings under "rope_parameters"; older files use "rope_theta".
    params = raw.get("rope_parameters") or {}
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _refuse_unsupported(raw: dict) -> None:
    scaling = raw.get("rope_scaling") or {}
    rope_type = (raw.get("rope_parameters") or {}).get("rope_type") or scaling.get("rope_type") \
        or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(f"config: rope scaling {rope_type!r} is not supported (only default RoPE)")
    if raw.get("use_sliding_window"):
        raise ConfigError("config: sliding-window attention is not supported")
    if raw.get("mlp_bias"):
        raise ConfigError("config: mlp_bias is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
