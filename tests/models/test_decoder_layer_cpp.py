"""The C++ decoder layer of a paged float32 CPU pass (``csrc/decoder_layer.cpp``), and the whole
pass in C++ (``DecoderModelCpu``), against the same layer / model run op by op: outputs and cache
writes bit for bit; the C++ pass follows the model's weights."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.engine.kv_storage import PagedKVStorage
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.context import ForwardContext
from rlvr_fast.models.qwen3 import DecoderLayer, Qwen3ForCausalLM, RotaryEmbedding

BLOCK_SIZE = 4
CACHED = torch.tensor([5, 9, 2])  # tokens each row holds before the pass


def small_config(qk_norm: bool, bias: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=32,
        hidden_size=40,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        attention_bias=bias,
        qk_norm=qk_norm,
        tie_word_embeddings=False,
    )


def randomise(module, generator) -> None:
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(1 + 0.3 * torch.randn(parameter.shape, generator=generator))


def filled_storages(config, generator) -> list[PagedKVStorage]:
    """Two storages of 12 blocks holding the same random keys and values."""
    storages = [
        PagedKVStorage(config, 12, BLOCK_SIZE, dtype=torch.float32, device=torch.device("cpu"))
        for _ in range(2)
    ]
    storages[0].data.copy_(torch.randn(storages[0].data.shape, generator=generator))
    storages[1].data.copy_(storages[0].data)
    return storages


def paged_context(storage, positions, block_tables) -> ForwardContext:
    blocks = block_tables.long().gather(1, positions // BLOCK_SIZE)
    return ForwardContext(
        positions=positions,
        kv_cache=storage.layers,
        slot_mapping=(blocks * BLOCK_SIZE + positions % BLOCK_SIZE).flatten(),
        context_lens=positions + 1,
        block_tables=block_tables,
        backend="cpp",
    )


@pytest.mark.parametrize("qk_norm, bias", [(True, False), (False, True)], ids=["qwen3", "qwen2"])
@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "suffix"])
def test_cpp_layer_is_the_layer_ops_bit_for_bit(qk_norm, bias, tokens):
    config = small_config(qk_norm, bias)
    generator = torch.Generator().manual_seed(0)
    layer = DecoderLayer(config, layer_idx=1)
    randomise(layer, generator)
    storages = filled_storages(config, generator)
    block_tables = torch.randperm(12, generator=generator).view(3, 4).int()
    positions = CACHED[:, None] + torch.arange(tokens)
    cos, sin = RotaryEmbedding(config.head_dim, config.rope_theta, 64)(positions, torch.float32)
    x = torch.randn(3, tokens, config.hidden_size, generator=generator)
    with torch.inference_mode():
        by_ops = layer.pass_ops(x, cos, sin, paged_context(storages[0], positions, block_tables))
        in_cpp = layer.paged_pass_cpp(
            x, cos, sin, paged_context(storages[1], positions, block_tables)
        )
    assert torch.equal(in_cpp, by_ops)
    assert torch.equal(storages[1].data, storages[0].data), "the same keys and values stored"


def pass_by_ops(model: Qwen3ForCausalLM, input_ids, context) -> torch.Tensor:
    """``infer`` module by module, each layer op by op."""
    x = model.model.embed_tokens(input_ids)
    cos, sin = model.model.rotary(context.positions, x.dtype)
    for layer in model.model.layers:
        x = layer.pass_ops(x, cos, sin, context)
    hidden = model.model.norm(x)
    if context.logits_index is None:
        return model.lm_head(hidden[:, -1])
    return model.lm_head(hidden.flatten(0, 1).index_select(0, context.logits_index))


@pytest.mark.parametrize("qk_norm, bias", [(True, False), (False, True)], ids=["qwen3", "qwen2"])
@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "suffix"])
def test_cpp_pass_is_the_model_ops_bit_for_bit(qk_norm, bias, tokens):
    config = small_config(qk_norm, bias)
    generator = torch.Generator().manual_seed(1)
    model = Qwen3ForCausalLM(config)
    randomise(model, generator)
    storages = filled_storages(config, generator)
    block_tables = torch.randperm(12, generator=generator).view(3, 4).int()
    positions = CACHED[:, None] + torch.arange(tokens)
    input_ids = torch.randint(0, config.vocab_size, positions.shape, generator=generator)
    contexts = [paged_context(storage, positions, block_tables) for storage in storages]
    if tokens > 1:  # a suffix whose rows end at different tokens
        for context in contexts:
            context.logits_index = torch.tensor([2, tokens + 1, 2 * tokens])
    with torch.inference_mode():
        by_ops = pass_by_ops(model, input_ids, contexts[0])
        in_cpp = model.infer(input_ids, contexts[1])
    assert torch.equal(in_cpp, by_ops)
    assert torch.equal(storages[1].data, storages[0].data), "the same keys and values stored"


def test_cpp_pass_follows_in_place_updates_and_replaced_parameters():
    config = small_config(qk_norm=True, bias=False)
    generator = torch.Generator().manual_seed(2)
    model = Qwen3ForCausalLM(config)
    randomise(model, generator)
    storage = filled_storages(config, generator)[0]
    positions = CACHED[:, None]
    input_ids = torch.randint(0, config.vocab_size, positions.shape, generator=generator)
    context = paged_context(storage, positions, torch.arange(12).view(3, 4).int())

    def both():
        with torch.inference_mode():
            return model.infer(input_ids, context), pass_by_ops(model, input_ids, context)

    assert torch.equal(*both())
    decoder = model.cpp_decoder()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-1)  # an optimizer's in-place step
    assert model.cpp_decoder() is decoder
    assert torch.equal(*both())
    model.lm_head.weight = torch.nn.Parameter(torch.randn(config.vocab_size, 40))
    assert model.cpp_decoder() is not decoder
    assert torch.equal(*both())
