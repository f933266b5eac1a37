"""LoRA on the decoder (``rlvr_fast.models.lora``): which projections a target list adapts, the
adapted forward against W + s B A applied by hand, the merged decoder the engine runs against the
unmerged forward (and its in-place refresh), adapters alone in the optimizer (the zero-gradient
AdamW step included), and the adapter files loaded by peft onto the transformers model."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.models.lora import ADAPTER_DIR, LoraLinear, LoraSettings, apply_lora
from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.decision import StepDecision
from rlvr_fast.train.stepping import OptimizerStepping
from rlvr_fast.utils.phases import Phases

IDS = torch.tensor([[5, 17, 3, 9, 41, 2, 8], [1, 12, 30, 7, 0, 0, 0]])
MASK = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])


def adapted_policy(settings: LoraSettings, seed: int = 0):
    """The embedded model with adapters whose B is random (peft starts it at zero, which
    would make every comparison below trivial)."""
    policy = load_policy("tiny")
    policy.adapters = apply_lora(policy.model, settings)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in policy.adapters.layers.values():
            for b in layer.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
    return policy


def test_targets_select_projections_and_unsupported_targets_are_refused():
    config = load_policy("tiny").config
    everything = apply_lora(load_policy("tiny").model, LoraSettings(targets="all-linear"))
    assert everything.targets() == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert len(everything.layers) == 4 * config.num_hidden_layers
    qv = apply_lora(load_policy("tiny").model, LoraSettings(targets=("q_proj", "v_proj")))
    assert {n.rsplit(".", 1)[1] for n in qv.layers} == {"qkv_proj"}
    assert all(layer.adapted == ("q_proj", "v_proj") for layer in qv.layers.values())
    layer0 = apply_lora(
        load_policy("tiny").model, LoraSettings(targets=r"model\.layers\.0\..*_proj")
    )
    assert sorted(layer0.layers) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.self_attn.qkv_proj",
    ]
    with pytest.raises(ValueError, match="match model.embed_tokens"):
        apply_lora(load_policy("tiny").model, LoraSettings(targets=".*"))
    with pytest.raises(ValueError, match="match lm_head"):
        apply_lora(load_policy("tiny").model, LoraSettings(targets=("q_proj", "lm_head")))
    with pytest.raises(ValueError, match="match none of the model's projections"):
        apply_lora(load_policy("tiny").model, LoraSettings(targets=("query",)))
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        LoraSettings(rank=0)
    assert LoraSettings(rank=16, alpha=8, rslora=True).scaling == 8 / math.sqrt(16)


def test_adapted_projection_adds_s_b_a_x_on_its_rows_only():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 9, bias=True)
    settings = LoraSettings(rank=3, alpha=6.0)
    layer = LoraLinear(
        base, {"q_proj": 5, "k_proj": 2, "v_proj": 2}, ("q_proj", "v_proj"), settings
    )
    with torch.no_grad():
        for b in layer.lora_B.values():
            b.normal_()
    x = torch.randn(4, 6)
    expected = base(x)
    expected[:, :5] += 2.0 * x @ (layer.lora_B["q_proj"] @ layer.lora_A["q_proj"]).T
    expected[:, 7:] += 2.0 * x @ (layer.lora_B["v_proj"] @ layer.lora_A["v_proj"]).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x @ layer.merged_weight().T + base.bias, expected)


def test_merged_decoder_equals_the_unmerged_forward_and_is_refreshed_in_place():
    policy = adapted_policy(LoraSettings(rank=4, alpha=8.0, targets="all-linear"))
    model, decoder = policy.model, policy.decoder
    assert decoder is not model and policy.decoder is decoder
    shared = {id(p) for p in model.parameters()}
    merged = [decoder.get_submodule(name).weight for name in policy.adapters.layers]
    assert all(id(w) not in shared for w in merged)
    assert decoder.model.embed_tokens.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(decoder(IDS, MASK), model(IDS, MASK), rtol=1e-5, atol=1e-5)
        for b in policy.adapters.layers["model.layers.1.mlp.down_proj"].lora_B.values():
            b.mul_(3.0)
        addresses = [w.data_ptr() for w in merged]
        assert not torch.allclose(decoder(IDS, MASK), model(IDS, MASK), rtol=1e-5, atol=1e-5)
        policy.refresh_decoder()
        assert [w.data_ptr() for w in merged] == addresses
        torch.testing.assert_close(decoder(IDS, MASK), model(IDS, MASK), rtol=1e-5, atol=1e-5)


def test_the_engine_decodes_from_the_merged_decoder():
    policy = adapted_policy(LoraSettings(rank=4, alpha=16.0, targets="all-linear"))
    engine = RolloutEngine(policy.decoder, cuda_graphs=False, kv_blocks=16)
    assert RolloutEngine.for_policy(policy, cuda_graphs=False, kv_blocks=4).model is policy.decoder
    prompt = [int(t) for t in IDS[0]]
    (seq,) = engine.run([engine.add(prompt)], SamplingParams.greedy(6))
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            logits = policy.model(torch.tensor([expected]))[0, -1]
            expected.append(int(logits.argmax()))
    assert seq.completion == expected[len(prompt) :]


def test_only_adapters_are_stepped_and_the_zero_gradient_step_moves_them_alone():
    policy = adapted_policy(LoraSettings(rank=2, alpha=4.0, targets=("q_proj", "down_proj")))
    model = policy.model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    config = TrainConfig(lr=1e-2, weight_decay=0.1, fused_zero_grad_step=True)
    stepping = OptimizerStepping(model, config, after_publish=policy.refresh_decoder)
    stepped = {id(p) for group in stepping.optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in policy.adapters.parameters()}
    assert stepping.num_params == sum(p.numel() for p in model.parameters())
    decoder = policy.decoder

    def loss():
        return model(IDS, MASK).logsumexp(-1).mean()

    stepping.update(Phases(policy.device), StepDecision(True, True, 1), [loss])
    stepping.update(Phases(policy.device), StepDecision(False, True, 0), [loss])
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, frozen[name]), name
    assert all(stepping.optimizer.state[p]["step"] == 2 for p in policy.adapters.parameters())
    with torch.no_grad():
        torch.testing.assert_close(decoder(IDS, MASK), model(IDS, MASK), rtol=1e-5, atol=1e-5)


def test_the_adapter_loads_in_peft_with_our_logits(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = adapted_policy(LoraSettings(rank=4, alpha=8.0, dropout=0.1, targets="all-linear"))
    final = tmp_path / "final"
    policy.save(final)  # what a run writes: the merged model, the adapter in adapter/
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, final / ADAPTER_DIR).eval()
    # transformers applies an adapter_config.json it finds in the directory: the merged model
    # must load as itself, not as merged weights with the adapter added a second time.
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        theirs = peft_model(input_ids=IDS, attention_mask=MASK).logits
        loaded = merged(input_ids=IDS, attention_mask=MASK).logits
        ours = policy.decoder(IDS, MASK)
    # Merged (W + s B A) against peft's unmerged sum: fp32 roundings in another order.
    real = MASK.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[real], loaded[real], rtol=1e-5, atol=1e-5)
