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
    hf_model = synced_transformers_model(
        policy, meta_transformers_model(TINY_MODEL_DIR), TINY_MODEL_DIR, masters
    )
    assert next(hf_model.parameters()).dtype == torch.float32
    embedding = hf_model.get_input_embeddings().weight
    assert torch.equal(embedding, masters["model.embed_tokens.weight"])
    assert not torch.equal(embedding, masters["model.embed_tokens.weight"].bfloat16().float())
