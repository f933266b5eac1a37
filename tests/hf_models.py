"""Small random Hugging Face models built by ``transformers`` itself, for parity tests."""

from __future__ import annotations

import pytest
import torch


def random_hf_model(model_type: str = "qwen3", *, tie: bool = False, seed: int = 0):
    """A small random HF model with awkward sizes; every weight (norms included) perturbed so a
    parity test cannot pass by accident on ones / zeros."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    common = dict(
        vocab_size=211,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
        eos_token_id=0,
    )
    if model_type == "qwen3":
        config = transformers.Qwen3Config(head_dim=32, **common)
        model = transformers.Qwen3ForCausalLM(config)
    elif model_type == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()
