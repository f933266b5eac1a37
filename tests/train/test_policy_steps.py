"""TRL's loss types on the native trainer (``rlvr_fast.train.policy``): a run with the KL to a
synced reference model and two clipped updates per generation writes a ledger that keeps its
laws, marks the reused updates, carries the entropy / KL / clip figures, and verifies; a
generation split over two optimizer steps (generation_steps) trains each on its share and
verifies; the reference sync is TRL's; under LoRA the reference is the frozen base."""

from __future__ import annotations

import json

import pytest
import torch

from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.lora import LoraSettings, apply_lora
from rlvr_fast.models.policy import load_policy
from rlvr_fast.ops.policy_loss import PolicyLossSettings, PolicyLossStats
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.losses import completion_logprobs, policy_loss
from rlvr_fast.train.policy import PolicyTerms, ReferenceModel, reference_dtype, step_figures
from rlvr_fast.train.steps import generation_shares
from rlvr_fast.train.trainer import RLVRTrainer

POLICY_RUN = dict(
    steps=4,
    checkpoint_every=2,
    group_size=4,
    max_new_tokens=16,
    eval_max_new_tokens=16,
    eval_before=False,
    lr=1e-3,
    loss_order="token_weighted",
    loss_type="dapo",
    tempered_logprobs=True,
    kl_beta=0.1,
    sync_ref_model=True,
    ref_model_sync_steps=2,
    num_iterations=2,
    epsilon=0.01,
)


def test_a_kl_run_with_two_updates_per_generation_keeps_and_verifies_its_ledger(tmp_path):
    config = TrainConfig.from_arm("zg_flat", **POLICY_RUN)
    problems = synthetic_problems("train", 2, seed=11)
    RLVRTrainer(load_policy("tiny"), config, problems, out_dir=tmp_path, progress=False).train()
    lines = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [line.get("reused", False) for line in lines] == [False, True, False, True]
    assert [r.get("iteration", 0) for r in rollouts] == [0, 1, 0, 1]
    assert rollouts[0]["texts"] == rollouts[1]["texts"]  # the second update reuses them
    for line in lines:
        assert line["active"], "the KL term gives every group a gradient"
        assert (line["gen"] == 0) == line.get("reused", False)
        assert line["policy"]["entropy"] > 0 and "clip_ratio/region_mean" in line["policy"]
    assert lines[0]["policy"]["kl"] == 0.0  # the policy is the reference before any update
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["config"]["kl_beta"] == 0.1
    verification = verify_run(tmp_path)
    assert verification.ok, "\n".join(verification.lines())


def test_one_generation_split_over_two_steps_trains_each_on_its_share_and_verifies(tmp_path):
    settings = dict(POLICY_RUN, steps=2, num_iterations=1, sync_ref_model=False)
    config = TrainConfig.from_arm(
        "zg_flat", **settings, questions_per_step=2, combine_questions="pooled", generation_steps=2
    )
    problems = synthetic_problems("train", 4, seed=11)
    RLVRTrainer(load_policy("tiny"), config, problems, out_dir=tmp_path, progress=False).train()
    lines = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [[q.get("reused", False) for q in line["questions"]] for line in lines] == [
        [False, False],
        [True, True],
    ]
    first, second = (line["questions"] for line in rollouts)
    assert [q["texts"] for q in first] == [q["texts"] for q in second]  # one generation
    assert [q.get("iteration", 0) for q in first + second] == [0, 0, 1, 1]
    assert lines[0]["gen"] > 0 and lines[1]["gen"] == lines[1]["decode_rows"] == 0
    shares = [[q["trained"] for q in line["questions"]] for line in lines]
    for index in range(2):  # the two steps split each question's completions between them
        assert sorted(shares[0][index] + shares[1][index]) == list(range(4))
        assert shares == [generation_shares([4, 4], config.seed, 0, 2, k) for k in range(2)]
    for line, step_shares in zip(lines, shares):
        assert line["active"]
        trained = [
            q["lengths"][i] for q, share in zip(line["questions"], step_shares) for i in share
        ]
        assert line["bwd_out"] == sum(trained) < line["leaf"]
    verification = verify_run(tmp_path)
    assert verification.ok, "\n".join(verification.lines())


def test_a_group_masked_out_of_the_loss_has_a_zero_loss_and_gradient():
    model = load_policy("tiny").model
    loss, stats = policy_loss(
        model, [1, 2, 3], [[], []], torch.tensor([1.0, -1.0]), PolicyLossSettings("grpo")
    )
    loss.backward()
    assert float(loss) == 0.0 and stats.entropy.numel() == 0
    assert not model.lm_head.weight.grad.any()


def test_the_reference_sync_is_trls():
    callbacks = pytest.importorskip("trl.trainer.callbacks")
    torch.manual_seed(0)
    policy, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    reference = ReferenceModel(target, sync_steps=2, alpha=0.6)
    expected = ReferenceModel(target, sync_steps=None, alpha=0.6).model
    reference.after_step(1, policy)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), target.parameters()))
    reference.after_step(2, policy)
    callbacks.SyncRefModelCallback._sync_target_model(policy, expected, 0.6)
    for ours, theirs in zip(reference.model.parameters(), expected.parameters()):
        assert torch.equal(ours, theirs)
        assert not ours.requires_grad


def test_cudas_bf16_reference_beside_an_fp32_policy_on_the_cpu():
    """On CUDA the reference is a bf16 copy whatever the policy's dtype (``reference_dtype``);
    that pairing, built here on the CPU: its log-probabilities of a group's completions are the
    fp32 policy's within bf16 rounding and come back fp32, and a TRL sync mixes the fp32
    policy's weights into the bf16 copy."""
    policy = load_policy("tiny")
    assert reference_dtype(next(policy.model.parameters())) == torch.float32
    reference = ReferenceModel(policy.model, sync_steps=1, alpha=0.5, dtype=torch.bfloat16)
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}
    prompt, completions = [5, 6, 7, 8], [[9, 10, 11], [12, 13], [14]]
    ours = completion_logprobs(reference.model, prompt, completions, 0.9)
    full = completion_logprobs(policy.model, prompt, completions, 0.9)
    assert ours.dtype == full.dtype == torch.float32 and ours.shape == (6,)
    torch.testing.assert_close(ours, full, rtol=0.05, atol=0.05)
    before = [p.clone() for p in reference.model.parameters()]
    with torch.no_grad():
        for param in policy.model.parameters():
            param.add_(0.01)
    reference.after_step(1, policy.model)
    for old, new, param in zip(before, reference.model.parameters(), policy.model.parameters()):
        expected = old.mul(0.5).add_(param.to(torch.bfloat16), alpha=0.5)
        assert new.dtype == torch.bfloat16 and torch.equal(new, expected)


def test_under_lora_the_reference_is_the_frozen_base_sharing_its_tensors():
    """TRL disables a PeftModel's adapters for the reference: ours is the frozen base, every
    tensor the policy's own (nothing copied, nothing to checkpoint), whatever B has learned."""
    ids, mask = torch.tensor([[5, 17, 3, 9, 41]]), torch.ones(1, 5, dtype=torch.long)
    with torch.no_grad():
        base_logits = load_policy("tiny").model(ids, mask)
    policy = load_policy("tiny")
    policy.adapters = apply_lora(policy.model, LoraSettings(rank=2, targets="all-linear"))
    with torch.no_grad():
        for b in (p for n, p in policy.model.named_parameters() if "lora_B" in n):
            b.normal_(0.0, 0.1)
    reference = ReferenceModel(policy.model, None, 0.0, policy.adapters)
    assert not reference.owns_weights
    own = {p.data_ptr() for p in policy.model.parameters()}
    names = [n for n, _ in reference.model.named_parameters()]
    assert names and not any("lora" in n for n in names)
    assert all(p.data_ptr() in own for p in reference.model.parameters())
    with torch.no_grad():
        assert torch.equal(reference.model(ids, mask), base_logits)
        assert not torch.allclose(policy.model(ids, mask), base_logits)
    with pytest.raises(ValueError, match="sync_ref_model with lora_r"):
        TrainConfig.from_arm("zg_flat", lora_r=2, **POLICY_RUN)


def test_policy_settings_need_a_policy_loss_type():
    with pytest.raises(ValueError, match="kl_beta is a setting of TRL's loss types"):
        TrainConfig.from_arm("zg_flat", kl_beta=0.1)
    with pytest.raises(ValueError, match="multiple of num_iterations"):
        TrainConfig.from_arm("zg_flat", **dict(POLICY_RUN, checkpoint_every=3))
    with pytest.raises(ValueError, match="sync_ref_model syncs the reference"):
        TrainConfig.from_arm("zg_flat", **dict(POLICY_RUN, kl_beta=0.0))
    with pytest.raises(ValueError, match="generation_steps is a setting of TRL's loss types"):
        TrainConfig.from_arm("zg_flat", generation_steps=2)
    with pytest.raises(ValueError, match=r"generation_steps \(3\) must divide"):
        TrainConfig.from_arm("zg_flat", **dict(POLICY_RUN, checkpoint_every=6, generation_steps=3))
    with pytest.raises(ValueError, match="multiple of num_iterations x generation_steps"):
        TrainConfig.from_arm("zg_flat", **dict(POLICY_RUN, generation_steps=2))


def test_cispo_figures_without_epsilon_high_clip_at_epsilon_as_trls():
    """TRL's cispo clip ratio with epsilon_high None counts ratios above epsilon."""
    ratio = torch.tensor([0.1, 0.3, 1.0, 0.15])
    stats = PolicyLossStats(torch.zeros(4), torch.zeros(4), ratio, torch.zeros(4))
    terms = PolicyTerms(torch.tensor([1.0, -1.0]), [2, 2], stats=stats)
    figures = step_figures([terms], PolicyLossSettings(loss_type="cispo", epsilon=0.2))
    assert figures["cispo_clip_ratio"] == pytest.approx(0.25)
