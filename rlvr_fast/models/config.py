"""Decoder-only model configuration read from a Hugging Face ``config.json``.

One dataclass covers Qwen3 (the reference architecture: q/k RMSNorm, no attention bias), Qwen2
(bias on q/k/v, no q/k norm) and Llama (neither), because the three differ only in those two
switches. Anything our engine does not implement (rope scaling, sliding windows, MoE) is refused
here with a clear error rather than silently computed wrong.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlvr_fast.utils.files import UnreadableFileError, read_json

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
# Above these a dimension or layer count is a corrupt file, not a model: the model is built
# layer by layer before any weight is read, so a billion layers would hang there.
MAX_DIMENSION = 1 << 24
MAX_LAYERS = 1024
# A config.json is a few KB; the cap is checked before reading (a link to /dev/zero, a FIFO).
MAX_CONFIG_BYTES = 16 << 20


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
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
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
        if not isinstance(raw, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type", "qwen3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        _refuse_unsupported(raw)
        heads = _integer(raw, "num_attention_heads")
        hidden = _integer(raw, "hidden_size")
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if not isinstance(eos, list) else eos)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids):
            raise ConfigError(
                f"config: eos_token_id must be a token id or a list of them, got {eos!r}"
            )
        bos = raw.get("bos_token_id")
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
            raise ConfigError(f"config: bos_token_id must be a token id or null, got {bos!r}")
        return cls(
            vocab_size=_integer(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_integer(raw, "intermediate_size"),
            num_hidden_layers=_integer(raw, "num_hidden_layers", most=MAX_LAYERS),
            num_attention_heads=heads,
            num_key_value_heads=_integer(raw, "num_key_value_heads", heads),
            head_dim=_integer(raw, "head_dim", hidden // heads if heads > 0 else 0),
            max_position_embeddings=_integer(raw, "max_position_embeddings", 32768),
            rms_norm_eps=_positive_number(raw, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            tie_word_embeddings=_boolean(raw, "tie_word_embeddings", False),
            attention_bias=_boolean(raw, "attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
            bos_token_id=bos,
            eos_token_id=list(eos_ids),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = Path(path)
        try:
            raw = read_json(path, MAX_CONFIG_BYTES, "model config")
        except UnreadableFileError as err:
            raise ConfigError(str(err)) from None
        try:
            return cls.from_hf_dict(raw)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None

    def to_hf_dict(self) -> dict:
        """The config.json a Hugging Face ``AutoModelForCausalLM`` can load."""
        raw = asdict(self)
        del raw["qk_norm"]
        arch = {
            "qwen3": "Qwen3ForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "llama": "LlamaForCausalLM",
        }
        raw["architectures"] = [arch[self.model_type]]
        raw["hidden_act"] = "silu"
        raw["eos_token_id"] = (
            self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        )
        raw["rope_scaling"] = None
        raw["use_cache"] = True
        return raw


def _integer(raw: dict, name: str, default: int | None = None, most: int = MAX_DIMENSION) -> int:
    """A whole number field in [1, most] (JSON may write it as 4.0); ``default`` when absent or
    null."""
    value = raw.get(name)
    if value is None:
        if default is None:
            raise ConfigError(f"config: missing field {name!r}")
        return default
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )
    if not whole or not 1 <= value <= most:
        raise ConfigError(f"config: {name} must be a whole number in [1, {most:,}], got {value!r}")
    return int(value)


def _positive_number(raw: dict, name: str, default: float) -> float:
    value = raw.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"config: {name} must be a positive finite number, got {value!r}")
    return float(value)


def _boolean(raw: dict, name: str, default: bool) -> bool:
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config: {name} must be true or false, got {value!r}")
    return value


def _section(raw: dict, name: str) -> dict:
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config: {name} must be an object or null, got {value!r}")
    return value


def _rope_theta(raw: dict) -> float:
    # transformers 5 writes rope settings under "rope_parameters"; older files use "rope_theta".
    params = _section(raw, "rope_parameters")
    source = params if "rope_theta" in params else raw
    return _positive_number(source, "rope_theta", 10000.0)


def _refuse_unsupported(raw: dict) -> None:
    scaling = _section(raw, "rope_scaling")
    rope_type = (
        _section(raw, "rope_parameters").get("rope_type")
        or scaling.get("rope_type")
        or scaling.get("type")
        or "default"
    )
    if rope_type != "default":
        raise ConfigError(
            f"config: rope scaling {rope_type!r} is not supported (only default RoPE)"
        )
    if raw.get("use_sliding_window"):
        raise ConfigError("config: sliding-window attention is not supported")
    if raw.get("mlp_bias"):
        raise ConfigError("config: mlp_bias is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
