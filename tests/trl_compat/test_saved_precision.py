"""The precision of what the drop-in loads and saves: the policy loads in float32 unless
``model_init_kwargs`` names a dtype (under bf16 on CUDA the fp32 masters then copy the
checkpoint's own values before the model is cast to bf16), and the transformers model it syncs
holds a bf16-mixed run's fp32 masters, not their bf16 rounding."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy
from rlvr_fast.trl_compat.model_io import (
    meta_transformers_model,
    policy_dtype,
    requested_dtype,
    synced_transformers_model,
)


def test_the_policy_loads_in_float32_unless_a_dtype_is_asked():
    """Under bf16 too: a GRPOConfig's bf16 (on CUDA, bf16-mixed) never rounds the load."""
    args = SimpleNamespace(bf16=True, model_init_kwargs=None)
    assert requested_dtype(args) is None and policy_dtype(args) == torch.float32
    args.model_init_kwargs = {"dtype": "bfloat16"}
    assert policy_dtype(args) == torch.bfloat16
    args.model_init_kwargs = {"dtype": "auto"}
    assert requested_dtype(args) is None


def test_the_synced_model_holds_the_masters_in_their_precision():
    masters = {n: p.detach().clone() for n, p in load_policy("tiny").model.named_parameters()}
    policy = load_policy("tiny")
    policy.model.to(torch.bfloat16)  # the stepping's cast under bf16-mixed
    hf_model = synced_transformers_model(policy, meta_transformers_model(TINY_MODEL_DIR), masters)
    assert next(hf_model.parameters()).dtype == torch.float32
    embedding = hf_model.get_input_embeddings().weight
    assert torch.equal(embedding, masters["model.embed_tokens.weight"])
    assert not torch.equal(embedding, masters["model.embed_tokens.weight"].bfloat16().float())


def test_the_model_of_a_path_holds_the_policys_own_tensors_and_runs_as_transformers_loads_it(
    tmp_path,
):
    """No copy of the weights at a sync (at Qwen3-0.6B's shape the copy was the run's peak):
    every parameter lies in the policy's storage, so an optimizer step shows at once; the RoPE
    buffers are from_config's, so the logits equal those of the checkpoint loaded by
    transformers, and save_pretrained writes the same weights."""
    from transformers import AutoModelForCausalLM

    policy = load_policy("tiny")
    hf_model = synced_transformers_model(policy, meta_transformers_model(TINY_MODEL_DIR))
    storages = {p.untyped_storage().data_ptr() for p in policy.model.parameters()}
    assert all(p.untyped_storage().data_ptr() in storages for p in hf_model.parameters())
    tokens = torch.tensor([[5, 17, 40, 3, 99, 120, 7]])
    loaded = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(hf_model(tokens).logits, loaded(tokens).logits)
        policy.model.model.embed_tokens.weight.mul_(2.0)
        assert torch.equal(
            hf_model.get_input_embeddings().weight, policy.model.model.embed_tokens.weight
        )
        assert synced_transformers_model(policy, hf_model) is hf_model
        hf_model.save_pretrained(tmp_path)
        saved = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        assert torch.equal(saved(tokens).logits, hf_model(tokens).logits)


def test_a_tied_head_is_the_shared_embedding_in_the_model_of_a_path():
    """Qwen3-0.6B ties its LM head: the model built over the policy's tensors ties it again."""
    from hf_models import random_hf_model

    from rlvr_fast.models.checkpoint import build_model
    from rlvr_fast.models.config import ModelConfig
    from rlvr_fast.trl_compat.model_io import shared_transformers_model

    reference = random_hf_model(tie=True)
    config = ModelConfig.from_hf_dict(reference.config.to_dict())
    ours = build_model(config, dict(reference.state_dict()), device="cpu", dtype=torch.float32)
    policy = SimpleNamespace(decoder=ours, config=config, device=torch.device("cpu"))
    hf_model = shared_transformers_model(policy, reference.config)
    head, embedding = hf_model.get_output_embeddings().weight, hf_model.get_input_embeddings()
    assert head is embedding.weight
    assert head.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    tokens = torch.tensor([[5, 17, 40, 3, 99, 120, 7]])
    with torch.no_grad():
        assert torch.equal(hf_model(tokens).logits, reference(tokens).logits)
