"""Activation checkpointing in our decoder: the same loss and the same gradients, with what autograd
saves for backward (``saved_tensors_hooks``) down from every layer's activations to the tensors
outside the recomputed layers; engine passes and no-grad forwards never recompute."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.models.checkpoint import load_model


@pytest.fixture(scope="module")
def model(hf_qwen3):
    return load_model(hf_qwen3[1])


def loss_and_grads(model, ids, checkpointing: bool | int):
    """Loss, gradients and bytes autograd saved, checkpointing every layer (True), none
    (False) or the first that many."""
    if isinstance(checkpointing, bool):
        model.activation_checkpointing = checkpointing
    else:
        model.model.checkpointed_layers = checkpointing
    model.zero_grad(set_to_none=True)
    saved: dict[int, int] = {}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            hidden = model(ids, return_hidden=True)
        loss = (hidden.float() ** 2).mean() + model.lm_head(hidden).logsumexp(-1).mean()
        loss.backward()
    finally:
        model.activation_checkpointing = False
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, sum(saved.values())


def test_checkpointing_keeps_the_gradients_and_saves_less(model):
    ids = torch.randint(
        1, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0)
    )
    loss, grads, saved = loss_and_grads(model, ids, False)
    loss_ckpt, grads_ckpt, saved_ckpt = loss_and_grads(model, ids, True)
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_ckpt[name]), name
    layers = model.config.num_hidden_layers
    # Outside the recomputed layers only the final norm, RoPE tables and logits remain.
    assert saved_ckpt < saved / layers, (saved, saved_ckpt)


def test_checkpointing_the_first_layers_saves_in_between(model):
    """The first k layers recompute: the same loss and gradients, and what autograd saves lies
    between checkpointing every layer and none, falling as k grows."""
    ids = torch.randint(
        1, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(2)
    )
    loss, grads, saved = loss_and_grads(model, ids, False)
    loss_all, _, saved_all = loss_and_grads(model, ids, True)
    layers = model.config.num_hidden_layers
    partial = [loss_and_grads(model, ids, k) for k in range(1, layers)]
    for loss_k, grads_k, _ in partial:
        assert torch.equal(loss, loss_k)
        for name in grads:
            assert torch.equal(grads[name], grads_k[name]), name
    sizes = [saved] + [s for _, _, s in partial] + [saved_all]
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes
    assert model.model.checkpointed_layers == 0


def test_forwards_without_autograd_run_as_before(model):
    ids = torch.randint(
        1, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = model(ids)
    model.activation_checkpointing = True
    try:
        with torch.no_grad():
            got = model(ids)
    finally:
        model.activation_checkpointing = False
    assert torch.equal(expected, got)
    assert model.model.activation_checkpointing is False
