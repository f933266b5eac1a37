"""The C++ decoder layer of a paged float32 CPU pass (``csrc/decoder_layer.cpp``) against the
same layer run op by op: its output and its cache writes bit for bit."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.engine.kv_storage import PagedKVStorage
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.context import ForwardContext
from rlvr_fast.models.qwen3 import DecoderLayer, RotaryEmbedding

BLOCK_SIZE = 4
CACHED = torch.tensor([5, 9, 2])  # tokens each row holds before the pass


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
    config = ModelConfig(
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
    )
    generator = torch.Generator().manual_seed(0)
    layer = DecoderLayer(config, layer_idx=1)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(1 + 0.3 * torch.randn(parameter.shape, generator=generator))
    storages = [
        PagedKVStorage(config, 12, BLOCK_SIZE, dtype=torch.float32, device=torch.device("cpu"))
        for _ in range(2)
    ]
    storages[0].data.copy_(torch.randn(storages[0].data.shape, generator=generator))
    storages[1].data.copy_(storages[0].data)
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
