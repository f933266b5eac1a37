"""scripts/make_checkpoint.py: the published Qwen3-0.6B-Base shape as data, seeded random
weights in a Hugging Face directory both loaders read, and a byte-level tokenizer that decodes
every id of the vocabulary."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.policy import load_policy

SCRIPT = Path(__file__).parents[2] / "scripts" / "make_checkpoint.py"
spec = importlib.util.spec_from_file_location("make_checkpoint", SCRIPT)
make_checkpoint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_checkpoint)


def small_qwen3_config(tmp_path) -> Path:
    """Qwen3-0.6B-Base's config.json with every size shrunk."""
    raw = json.loads(make_checkpoint.NAMED_CONFIGS["qwen3-0.6b"].read_text())
    raw.update(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        eos_token_id=299,
        bos_token_id=299,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_qwen3_0_6b_base_configuration_is_the_published_one():
    config = ModelConfig.from_file(make_checkpoint.resolve_config("qwen3-0.6b"))
    assert (
        config.vocab_size,
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
    ) == (151_936, 1024, 28, 16, 8, 128, 3072)
    assert config.rope_theta == 1e6 and config.tie_word_embeddings
    assert config.eos_token_id == [151_643] and config.torch_dtype == "bfloat16"
    assert config.num_parameters() == 751_632_384


def test_byte_level_tokenizer_covers_qwen3s_vocabulary():
    tokenizer = make_checkpoint.byte_level_tokenizer(151_936, 151_643)
    assert tokenizer.get_vocab_size() == 151_936
    assert tokenizer.token_to_id(make_checkpoint.EOS) == 151_643
    text = "Find x if 3x + 5 = 20.\n\\boxed{5}, π ≤ 3.15"
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode()) and max(ids) < 256, "one id per byte"
    assert tokenizer.decode(ids) == text
    texts = tokenizer.decode_batch([[i] for i in range(0, 151_936, 7)])
    assert all(isinstance(t, str) for t in texts)
    assert tokenizer.decode([151_643], skip_special_tokens=False) == make_checkpoint.EOS


def test_checkpoint_loads_here_and_in_transformers_with_seeded_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = small_qwen3_config(tmp_path)
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert (
            make_checkpoint.main(
                ["--config", str(config), "--out", str(tmp_path / name), "--seed", str(seed)]
            )
            == 0
        )
    policy = load_policy(tmp_path / "a")
    assert policy.tokenizer.eos_token_ids == [299]
    state = policy.model.state_dict()
    assert bool((state["model.norm.weight"] == 1).all())
    assert float(state["model.embed_tokens.weight"].float().std()) == pytest.approx(0.02, rel=0.1)
    same = load_policy(tmp_path / "b").model.state_dict()
    other = load_policy(tmp_path / "c").model.state_dict()
    assert all(torch.equal(t, same[k]) for k, t in policy.model.state_dict().items())
    assert not torch.equal(other["lm_head.weight"], same["lm_head.weight"])

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    ids = torch.tensor([policy.tokenizer.encode("What is 2 + 3?")])
    with torch.no_grad():
        ours = policy.model.float()(ids)
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_unknown_config_is_a_one_line_error(tmp_path, capsys):
    assert make_checkpoint.main(["--config", "qwen3-8b", "--out", str(tmp_path / "x")]) == 2
    assert "neither a name (qwen3-0.6b, tiny) nor a config.json" in capsys.readouterr().err


@pytest.mark.cuda
def test_weights_drawn_on_the_gpu_load_on_the_gpu(tmp_path):
    assert (
        make_checkpoint.main(["--config", "tiny", "--out", str(tmp_path / "m"), "--device", "cuda"])
        == 0
    )
    policy = load_policy(tmp_path / "m", device="cuda")
    assert policy.device.type == "cuda" and policy.config.vocab_size == 384
