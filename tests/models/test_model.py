"""The model: parity with transformers, checkpoints, config (cached decoding: test_engine.py)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

import rlvr_fast
from hf_models import random_hf_model
from rlvr_fast.models.checkpoint import CheckpointError, load_model, save_model
from rlvr_fast.models.config import ConfigError, ModelConfig

# config.json of Qwen/Qwen3-0.6B-Base, the study's model, as the package keeps it.
QWEN3_0_6B_BASE = json.loads(
    (Path(rlvr_fast.__file__).parent / "assets" / "configs" / "qwen3-0.6b-base.json").read_text()
)


def left_padded_batch(vocab: int, lengths: list[int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return ids * mask, mask


@pytest.mark.parametrize(
    "model_type,tie", [("qwen3", False), ("qwen3", True), ("qwen2", False), ("llama", True)]
)
def test_logits_match_transformers(tmp_path, model_type, tie):
    hf = random_hf_model(model_type, tie=tie, seed=1)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids, mask = left_padded_batch(hf.config.vocab_size, [37, 20, 1, 29])
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
        got = ours(ids, mask)
        unpadded = ours(ids[:1])
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max() <= 1e-5
    assert (unpadded - hf(ids[:1]).logits).abs().max() <= 1e-5


def test_hidden_states_feed_the_lm_head(hf_qwen3):
    _, directory = hf_qwen3
    model = load_model(directory)
    ids = torch.randint(0, 211, (2, 13))
    with torch.no_grad():
        hidden = model(ids, return_hidden=True)
        assert hidden.shape == (2, 13, 96)
        torch.testing.assert_close(hidden @ model.lm_head.weight.T, model(ids), rtol=0, atol=1e-5)


def test_left_and_right_padding_score_alike(hf_qwen3):
    _, directory = hf_qwen3
    model = load_model(directory)
    ids = torch.randint(1, 211, (1, 9))
    left = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    right = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    left_mask = (torch.arange(13) >= 4).long()[None]
    with torch.no_grad():
        a = model(left, left_mask)[0, 4:]
        b = model(right, left_mask.flip(1))[0, :9]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_saved_checkpoint_loads_in_transformers(tmp_path, hf_qwen3, tie):
    transformers = pytest.importorskip("transformers")
    hf = random_hf_model("qwen3", tie=tie, seed=2)
    hf.save_pretrained(tmp_path / "source")
    ours = load_model(tmp_path / "source")
    save_model(ours, tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids = torch.randint(0, 211, (2, 10))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)
    assert (
        json.loads((tmp_path / "saved" / "config.json").read_text())["tie_word_embeddings"] is tie
    )


def test_bfloat16_load_keeps_rope_in_fp32(hf_qwen3):
    hf, directory = hf_qwen3
    model = load_model(directory, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 211, (1, 40))
    with torch.no_grad():
        err = (model(ids).float() - hf(ids).logits).abs().max()
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
        err_hf_bf16 = (hf_bf16(ids).logits.float() - hf(ids).logits).abs().max()
    assert err <= 2 * err_hf_bf16 + 1e-2


def test_parameter_count_matches_the_seed():
    config = ModelConfig.from_hf_dict(QWEN3_0_6B_BASE)
    assert config.num_parameters() == 751_632_384
    assert config.num_parameters(untied=False) == 596_049_920


@pytest.mark.parametrize("model_type,tie", [("qwen3", False), ("qwen3", True), ("qwen2", False)])
def test_parameter_count_matches_the_module(tmp_path, model_type, tie):
    random_hf_model(model_type, tie=tie).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    actual = sum(p.numel() for p in model.parameters())
    assert model.config.num_parameters(untied=False) == actual
    head = model.config.vocab_size * model.config.hidden_size
    assert model.config.num_parameters(untied=True) == actual + (head if tie else 0)


def test_untie_gives_the_head_its_own_copy(tmp_path):
    random_hf_model("qwen3", tie=True).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(0, 211, (1, 8))
    with torch.no_grad():
        before = model(ids)
        model.untie_weights()
        assert torch.equal(model(ids), before)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters()


def test_transformers5_rope_parameters_are_read():
    raw = dict(
        QWEN3_0_6B_BASE,
        rope_theta=None,
        rope_parameters={"rope_theta": 5e5, "rope_type": "default"},
    )
    assert ModelConfig.from_hf_dict(raw).rope_theta == 5e5


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
        ({"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(dict(QWEN3_0_6B_BASE, **change))


def test_missing_config_field_is_named():
    raw = dict(QWEN3_0_6B_BASE)
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="missing field 'hidden_size'"):
        ModelConfig.from_hf_dict(raw)


def test_checkpoint_with_wrong_tensors_is_refused(tmp_path, hf_qwen3):
    _, directory = hf_qwen3
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=4)))
    os.link(directory / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, intermediate_size=128)))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nope")


def test_a_padded_forward_under_autograd_on_cuda_is_refused_by_name():
    """SDPA's flash kernel takes no mask: on CUDA a padded training forward would keep T x T
    scores per layer that no memory plan counts, so it is one line naming the way out; without
    gradients, or on a CPU (whose flash kernel takes the mask), it runs."""
    from rlvr_fast.models.qwen3 import refuse_masked_training

    with pytest.raises(ValueError, match="attention_mask under autograd on CUDA") as err:
        refuse_masked_training(torch.device("cuda", 0))
    assert "\n" not in str(err.value)
    refuse_masked_training(torch.device("cpu"))
    with torch.no_grad():
        refuse_masked_training(torch.device("cuda"))


@pytest.mark.cuda
def test_the_model_refuses_a_padded_training_forward_on_cuda(hf_qwen3):
    model = load_model(hf_qwen3[1]).cuda()
    ids, mask = left_padded_batch(model.config.vocab_size, [9, 4])
    ids, mask = ids.cuda(), mask.cuda()
    with pytest.raises(ValueError, match="attention_mask under autograd on CUDA"):
        model(ids, mask)
    with torch.no_grad():
        assert model(ids, mask).shape == (2, 9, model.config.vocab_size)
