"""The policy a TRL script hands over: a local checkpoint path, or a ``transformers`` model whose
weights are copied into our engine's model and copied back into it after training (so the
caller's object is the trained one), and the tokenizer, ours or the caller's processing class."""

from __future__ import annotations

from pathlib import Path

import torch

from rlvr_fast.models.checkpoint import build_model, packed_to_hf
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.policy import Policy, default_dtype, load_policy
from rlvr_fast.models.tokenizer import Tokenizer


def is_transformers_model(model) -> bool:
    return (
        hasattr(model, "state_dict")
        and hasattr(model, "config")
        and hasattr(model.config, "to_dict")
    )


def load_trl_policy(model, processing_class, *, device: torch.device, bf16: bool | None) -> Policy:
    """``model``: a path (or "tiny") or a ``transformers`` causal LM of a supported architecture
    (Qwen3, Qwen2, Llama). ``bf16`` None picks bfloat16 on CUDA and float32 elsewhere."""
    dtype = default_dtype(device) if bf16 is None else (torch.bfloat16 if bf16 else torch.float32)
    if isinstance(model, (str, Path)):
        policy = load_policy(model, device=device, dtype=dtype)
        if processing_class is not None:
            policy.tokenizer = tokenizer_of(processing_class, policy.tokenizer.eos_token_ids)
        return policy
    if not is_transformers_model(model):
        raise TypeError(
            f"model must be a checkpoint path or a transformers model, got {type(model).__name__}"
        )
    config = ModelConfig.from_hf_dict(model.config.to_dict())
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    ours = build_model(config, dict(model.state_dict()), device=device, dtype=dtype, source=name)
    if processing_class is None:
        if not Path(name).is_dir():
            raise ValueError(
                "a transformers model needs processing_class (its tokenizer) unless "
                "its config names a local checkpoint directory"
            )
        tokenizer = Tokenizer.from_directory(name)
    else:
        eos = (
            model.generation_config.eos_token_id
            if getattr(model, "generation_config", None)
            else None
        )
        tokenizer = tokenizer_of(
            processing_class, [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        )
    return Policy(model=ours, tokenizer=tokenizer, config=config, path=Path(name))


def tokenizer_of(processing_class, eos_token_ids: list[int]) -> Tokenizer:
    """Our tokenizer over the processing class's own ``tokenizers`` backend; its end-of-sequence
    token is added to ``eos_token_ids`` as TRL does."""
    backend = getattr(processing_class, "backend_tokenizer", None)
    if backend is None:
        raise TypeError("processing_class must be a fast tokenizer (one with backend_tokenizer)")
    eos = list(eos_token_ids)
    if processing_class.eos_token_id is not None and processing_class.eos_token_id not in eos:
        eos.insert(0, processing_class.eos_token_id)
    pad = processing_class.pad_token_id
    return Tokenizer(backend, eos, eos[0] if pad is None else pad)


def copy_weights_to(policy: Policy, hf_model) -> None:
    """Copy the policy's weights into ``hf_model`` (Hugging Face names; tied heads share the
    embedding there, so copying it covers both)."""
    state = {name: p.detach() for name, p in policy.model.named_parameters()}
    if policy.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = packed_to_hf(state, policy.config)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name not in tensors:
                raise KeyError(f"copy back: {name} has no counterpart in rlvr_fast's model")
            param.copy_(tensors[name])
