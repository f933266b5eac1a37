"""The TRL drop-in (``rlvr_fast.trl_compat``) beside ``trl`` itself: one script body run with
both, gradients of one step from identical rollouts (one and several prompts per step, every
loss type), the reward-function calls, and the gradient-free parts of the Trainer surface."""

from __future__ import annotations

import pytest
import torch

import rlvr_fast
from rlvr_fast.models.checkpoint import packed_to_hf
from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer
from rlvr_fast.trl_compat.run_setup import train_config
from rlvr_fast.train.steps import generation_order
from trl_side_by_side import (
    QUIET_CPU_RUN,
    chat_model_dir,
    chat_rows,
    text_rows,
    trl_modules,
    varied_reward,
)

MODEL = str(TINY_MODEL_DIR)
ROWS = text_rows(8)
# Small enough for CI, long enough that some completions end and some are cut.
SETTINGS = dict(
    max_steps=2,
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=24,
    temperature=0.8,
    learning_rate=1e-3,
    **QUIET_CPU_RUN,
)
TWO_PROMPTS = dict(per_device_train_batch_size=8)
TWO_MICRO_BATCHES = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2)


def dataset(rows=ROWS):
    from datasets import Dataset

    return Dataset.from_list(rows)


class Recorder:
    """A reward function that records how it was called."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append(dict(prompts=prompts, completions=completions, kwargs=kwargs))
        return [
            float(rlvr_fast.grade_response(c, a)) for c, a in zip(completions, kwargs["answer"])
        ]


def run_script(config_cls, trainer_cls, out_dir, **settings):
    """A TRL user's script body; only the classes differ between the two runs."""
    recorder = Recorder()
    args = config_cls(output_dir=str(out_dir), **{**SETTINGS, **settings})
    trainer = trainer_cls(
        model=MODEL, reward_funcs=[recorder, varied_reward], args=args, train_dataset=dataset()
    )
    trainer.train()
    return trainer, recorder


@pytest.mark.parametrize("layout", [{}, TWO_PROMPTS, TWO_MICRO_BATCHES])
def test_the_same_script_runs_on_trl_and_on_rlvr_fast(tmp_path, layout):
    trl = trl_modules()
    theirs, their_recorder = run_script(trl.GRPOConfig, trl.GRPOTrainer, tmp_path / "t", **layout)
    ours, our_recorder = run_script(GRPOConfig, GRPOTrainer, tmp_path / "o", **layout)
    assert ours.state.global_step == theirs.state.global_step == SETTINGS["max_steps"]
    their_logs, our_logs = theirs.state.log_history, ours.state.log_history
    assert len(our_logs) == len(their_logs) == SETTINGS["max_steps"] + 1
    for mine, their in zip(our_logs, their_logs):
        assert set(mine) == set(their)
        assert mine["step"] == their["step"] and mine["epoch"] == pytest.approx(their["epoch"])
    for index in (0, 1):
        assert our_logs[index]["learning_rate"] == pytest.approx(their_logs[index]["learning_rate"])
    # One call per step over all its completions, the same prompts in the same order.
    our_calls, their_calls = our_recorder.calls, their_recorder.calls
    assert len(our_calls) == len(their_calls) == SETTINGS["max_steps"]
    assert [c["prompts"] for c in our_calls] == [c["prompts"] for c in their_calls]
    for mine, their in zip(our_calls, their_calls):
        assert set(mine["kwargs"]) == set(their["kwargs"])
        assert mine["kwargs"]["answer"] == their["kwargs"]["answer"]
        assert mine["kwargs"]["level"] == their["kwargs"]["level"]
        assert mine["kwargs"]["trainer_state"] is ours.state


def trl_gradient(
    trl,
    completions,
    prompts,
    tmp_path,
    weights=None,
    reward=varied_reward,
    generation=0,
    stepped=None,
    state=None,
    **settings,
):
    """TRL's gradient and logged loss of one step whose generation (number ``generation``)
    returns ``completions``, through its own accumulation: each micro-batch's compute_loss and
    backward, the generation shuffled in our order (``generation_order``: TRL's shuffle draws
    from torch's global RNG); the policy at ``weights`` (default: the model's own; the
    reference model stays at them); ``state``: attributes of TRL's trainer set before.
    ``stepped`` gets the weights after the Trainer's optimizer step on that gradient, clipped to
    max_grad_norm as the Trainer clips it."""
    from trl.trainer import grpo_trainer

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **{**SETTINGS, **settings})
    trainer = trl.GRPOTrainer(model=MODEL, reward_funcs=reward, args=args, train_dataset=dataset())
    if weights is not None:
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                param.copy_(weights[name])
    for name, value in (state or {}).items():  # e.g. the adaptive entropy control's
        setattr(trainer, name, value)
    trainer._generate_single_turn = lambda *a, **k: ([list(c) for c in completions], None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    batch = [{"prompt": p} for p in prompts]
    order = generation_order(args.seed, generation, len(prompts))
    loss_total = 0.0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_trainer, "shuffle_sequence_dict", shuffled_as(order))
        for micro in range(args.gradient_accumulation_steps):
            trainer._step = micro
            loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch))
            loss.backward()
            loss_total += float(loss)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    metrics = {name: sum(v) / len(v) for name, v in trainer._metrics["train"].items() if v}
    if stepped is not None:
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), args.max_grad_norm)
        trainer.create_optimizer().step()
        stepped.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    return grads, loss_total, metrics


def first_group_agrees(prompts, completion_ids, **kwargs):
    """Equal rewards in the group of a call's first prompt, varied in the others'."""
    return [
        0.0 if p == prompts[0] else float(sum(ids) % 7) for p, ids in zip(prompts, completion_ids)
    ]


def our_gradient(tmp_path, at=0, steps=None, reward=varied_reward, final=None, **settings):
    """Our gradient of the ``at``-th step that ran a backward (from 0), its completions,
    prompts, loss and the weights it was taken at (Hugging Face names); ``steps`` gets every
    such step's (groups, weights, gradient, logs), ``final`` the weights the run ends with."""
    args = GRPOConfig(output_dir=str(tmp_path / "ours"), **{**SETTINGS, "max_steps": 3, **settings})
    trainer = GRPOTrainer(model=MODEL, reward_funcs=reward, args=args, train_dataset=dataset())
    captured = []
    clip = trainer.trainer.stepping.clip_gradients

    def capture():
        model = trainer.policy.model
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        captured.append((grads, list(trainer.task.groups), trainer.state.global_step, weights))
        return clip()

    trainer.trainer.stepping.clip_gradients = capture
    trainer.train()
    assert len(captured) > at, "too few steps ran a backward (rewards never varied)"
    if steps is not None:
        config = trainer.policy.config
        steps.extend(
            (groups, packed_to_hf(w, config), packed_to_hf(g, config), trainer.state.log_history[i])
            for g, groups, i, w in captured
        )
    grads, groups, step, weights = captured[at]
    completions = [c for g in groups for c in g.completion_ids]
    prompts = [ROWS[g.row]["prompt"] for g in groups for _ in g.completion_ids]
    config = trainer.policy.config
    if final is not None:
        final.update(packed_to_hf(dict(trainer.policy.model.named_parameters()), config))
    logs = trainer.state.log_history[step]
    return (packed_to_hf(grads, config), completions, prompts, logs, packed_to_hf(weights, config))


@pytest.mark.parametrize(
    "settings",
    [
        dict(loss_type="dapo"),
        dict(loss_type="grpo"),
        dict(loss_type="dr_grpo"),
        dict(loss_type="bnpo"),
        dict(loss_type="dapo", mask_truncated_completions=True),
        dict(loss_type="grpo", scale_rewards="none"),
        dict(loss_type="dapo", **TWO_PROMPTS),
        dict(loss_type="dapo", **TWO_MICRO_BATCHES),
        dict(loss_type="grpo", **TWO_MICRO_BATCHES),
        dict(loss_type="dr_grpo", **TWO_PROMPTS),
        dict(loss_type="bnpo", **TWO_PROMPTS),
        dict(loss_type="dapo", scale_rewards="batch", **TWO_PROMPTS),
        dict(loss_type="grpo", multi_objective_aggregation="normalize_then_sum", **TWO_PROMPTS),
        dict(loss_type="luspo", importance_sampling_level="sequence", **TWO_MICRO_BATCHES),
        dict(loss_type="dapo", mask_truncated_completions=True, **TWO_MICRO_BATCHES),
        dict(loss_type="grpo", importance_sampling_level="sequence", **TWO_PROMPTS),
        # vespo pools its normaliser over the step's tokens, as dapo does.
        dict(loss_type="vespo", **TWO_PROMPTS),
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_one_step_from_identical_rollouts_gives_trls_gradient(tmp_path, settings):
    trl = trl_modules()
    ours, completions, prompts, logs, _ = our_gradient(tmp_path, **settings)
    theirs, their_loss, metrics = trl_gradient(
        trl, completions, prompts, tmp_path, generation=logs["step"] - 1, **settings
    )
    assert_same_gradient(ours, theirs)
    assert logs["loss"] == pytest.approx(their_loss, rel=1e-4, abs=1e-6)
    assert logs["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)


def test_one_adafactor_step_from_identical_rollouts_gives_trls_updated_weights(tmp_path):
    """optim='adafactor': the first step's gradient is TRL's, and so are the weights after it
    (transformers' Adafactor on each Hugging Face tensor, clipped to max_grad_norm)."""
    trl = trl_modules()
    settings = dict(loss_type="dapo", optim="adafactor", max_steps=1)
    ours_after, theirs_after = {}, {}
    ours, completions, prompts, logs, before = our_gradient(tmp_path, final=ours_after, **settings)
    assert logs["step"] == 1
    theirs, _, _ = trl_gradient(
        trl, completions, prompts, tmp_path, stepped=theirs_after, **settings
    )
    assert_same_gradient(ours, theirs)
    assert_same_gradient(
        {n: w - before[n] for n, w in ours_after.items()},
        {n: w - before[n] for n, w in theirs_after.items()},
    )
    for name, weight in theirs_after.items():
        error = float((ours_after[name] - weight).abs().max() / weight.abs().max())
        assert error <= 1e-5, f"{name}: {error:.2e} of the largest weight"


def test_entropy_covers_a_group_without_a_loss_in_trls_micro_batches(tmp_path):
    """Two prompts, the first group's rewards equal (beta = 0: no loss runs on it, a pass
    without gradients measures it), in two micro-batches: TRL's entropy, the mean of each
    micro-batch's token mean over every completion, within 1e-5; TRL's gradient."""
    trl = trl_modules()
    settings = dict(loss_type="grpo", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    ours, completions, prompts, logs, _ = our_gradient(
        tmp_path, reward=first_group_agrees, **settings
    )
    assert logs["frac_reward_zero_std"] == 0.5
    theirs, _, metrics = trl_gradient(
        trl,
        completions,
        prompts,
        tmp_path,
        reward=first_group_agrees,
        generation=logs["step"] - 1,
        **settings,
    )
    assert_same_gradient(ours, theirs)
    assert logs["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)


@pytest.mark.parametrize(
    "settings",
    [
        dict(entropy_coef=0.01),
        dict(top_entropy_quantile=0.2),
        dict(loss_type="grpo", top_entropy_quantile=0.2, entropy_coef=0.01),
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_entropy_bonus_and_mask_give_trls_gradient(tmp_path, settings):
    """TRL's entropy bonus (its gradient through the fused pass) and high-entropy token mask:
    one step from identical rollouts gives TRL's gradient within 1e-5 relative, its loss,
    entropy and entropy_coef."""
    trl = trl_modules()
    ours, completions, prompts, logs, _ = our_gradient(tmp_path, **settings)
    theirs, their_loss, metrics = trl_gradient(
        trl, completions, prompts, tmp_path, generation=logs["step"] - 1, **settings
    )
    assert_gradient_within(ours, theirs, 1e-5)
    assert logs["loss"] == pytest.approx(their_loss, rel=1e-5, abs=1e-7)
    assert logs["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)
    for name in ("entropy_coef", "policy_loss"):
        assert (name in logs) == (name in metrics), name
        if name in metrics:
            assert logs[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-7), name


def test_adaptive_entropy_gives_trls_gradient_and_coefficient(tmp_path):
    """use_adaptive_entropy: the first step applies no bonus (no entropy measured yet), the
    second the coefficient the first step's entropy moved; at the second step's weights and
    controller state TRL's gradient within 1e-5 relative, and the same next coefficient."""
    trl = trl_modules()
    settings = dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=50.0)
    steps = []
    ours, completions, prompts, logs, weights = our_gradient(
        tmp_path, at=1, steps=steps, **settings
    )
    first_logs = steps[0][3]
    assert first_logs["entropy_coef"] == pytest.approx(0.015)
    assert logs["entropy_coef"] == pytest.approx(0.02)
    trl_state = dict(entropy_coef=first_logs["entropy_coef"], _last_world_entropy=0.0)
    theirs, their_loss, metrics = trl_gradient(
        trl, completions, prompts, tmp_path, weights, state=trl_state, **settings
    )
    assert_gradient_within(ours, theirs, 1e-5)
    assert logs["loss"] == pytest.approx(their_loss, rel=1e-5, abs=1e-7)
    assert metrics["entropy_coef"] == logs["entropy_coef"]
    assert logs["policy_loss"] == pytest.approx(metrics["policy_loss"], rel=1e-5, abs=1e-7)


def assert_gradient_within(ours, theirs, rel: float):
    """Every tensor's largest difference at most ``rel`` of TRL's largest gradient entry."""
    assert set(ours) == set(theirs)
    scale = max(float(g.abs().max()) for g in theirs.values())
    assert scale > 0
    worst = max(float((ours[n] - g).abs().max()) for n, g in theirs.items()) / scale
    assert worst <= rel, worst


def assert_same_gradient(ours, theirs):
    assert set(ours) == set(theirs)
    scale = max(float(g.abs().max()) for g in theirs.values())
    assert scale > 0
    for name, grad in theirs.items():
        torch.testing.assert_close(
            ours[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize(
    "settings",
    [
        dict(loss_type="dapo", beta=0.5),
        dict(loss_type="grpo", beta=0.5, use_bias_correction_kl=True, **TWO_PROMPTS),
        dict(loss_type="cispo", epsilon_high=1.2),
        dict(loss_type="sapo"),
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_kl_cispo_and_sapo_give_trls_gradient_and_metrics(tmp_path, settings):
    """The second step (the policy moved from the reference, so the KL term has a gradient)
    from identical rollouts and weights gives TRL's gradient, loss, entropy and KL."""
    trl = trl_modules()
    ours, completions, prompts, logs, weights = our_gradient(tmp_path, at=1, **settings)
    theirs, their_loss, metrics = trl_gradient(
        trl, completions, prompts, tmp_path, weights, **settings
    )
    assert_same_gradient(ours, theirs)
    assert logs["loss"] == pytest.approx(their_loss, rel=1e-4, abs=1e-6)
    assert logs["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)
    for name in ("kl", "cispo_clip_ratio", "vespo/phi_seq_mean"):
        assert (name in logs) == (name in metrics)
        if name in metrics:
            assert logs[name] == pytest.approx(metrics[name], rel=1e-4, abs=1e-9)


def test_config_mapping_defaults_fast_paths_arms_and_several_prompts():
    config = train_config(GRPOConfig(use_cpu=True), 10, 1)
    assert (config.loss_type, config.loss_order, config.tempered_logprobs) == (
        "dapo",
        "token_weighted",
        True,
    )
    assert config.skip_zero_var and config.zero_var_step == "zero_grad"
    assert config.group_size == 8 and config.lr == 1e-6 and config.temperature == 1.0
    pooled = train_config(GRPOConfig(use_cpu=True, scale_rewards="batch"), 10, 4)
    assert (pooled.questions_per_step, pooled.combine_questions) == (4, "pooled")
    assert pooled.advantage_std == "batch"
    arm = train_config(GRPOConfig(use_cpu=True, arm="ra_flat"), 10, 1)
    assert arm.gate_min_chars == 30 and arm.loss_type == "dapo"
    baseline = train_config(GRPOConfig(use_cpu=True, arm="baseline", loss_type="sum"), 10, 1)
    assert baseline.loss_order == "sum_then_scale" and not baseline.skip_zero_var
    tree = train_config(GRPOConfig(use_cpu=True, arm="stopped_tree", loss_type="sum"), 10, 1)
    assert tree.sampler == "tree" and tree.tree_k == 4
    with pytest.raises(ValueError, match="loss_type='sum'"):
        train_config(GRPOConfig(use_cpu=True, tree=True), 10, 1)
    with pytest.raises(ValueError, match="parallel-path arms"):
        train_config(GRPOConfig(use_cpu=True, arm="shapley_vote"), 10, 1)
    with pytest.raises(ValueError, match="skip_zero_variance_backward=False"):
        train_config(GRPOConfig(use_cpu=True, skip_zero_variance_backward=False), 10, 2)


def test_transformers_model_is_trained_in_place_with_chat_prompts(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = chat_model_dir(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []

    def reward(prompts, completions, **kwargs):
        calls.append((prompts, completions))
        return varied_reward(**kwargs)

    rows = chat_rows(4)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **SETTINGS)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=rows, processing_class=tokenizer
    )
    trainer.train()
    prompts, completions = calls[0]
    assert prompts[0] in [row["prompt"] for row in rows]
    assert completions[0][0]["role"] == "assistant"
    assert trainer.model is model
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    ours = packed_to_hf(
        {n: p.detach() for n, p in trainer.policy.model.named_parameters()}, trainer.policy.config
    )
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), ours[name]), name
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


def test_a_model_path_brings_its_tokenizer_and_chat_template(tmp_path):
    directory = chat_model_dir(tmp_path)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**SETTINGS, "max_steps": 1})
    trainer = GRPOTrainer(
        model=str(directory), reward_funcs=varied_reward, args=args, train_dataset=chat_rows(4)
    )
    assert trainer.processing_class.chat_template is not None
    assert next(trainer.model.parameters()).device.type == "meta"
    assert trainer.model.config.model_type == "qwen3"
    trainer.train()
    assert next(trainer.model.parameters()).device.type == "cpu"
    prompt = trainer.processing_class.apply_chat_template(
        [chat_rows(4)[0]["prompt"]], add_generation_prompt=True, tokenize=False
    )[0]
    assert prompt.endswith("assistant:")


def test_zero_variance_groups_take_the_zero_gradient_step(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), weight_decay=0.1, **SETTINGS)
    trainer = GRPOTrainer(
        model=MODEL,
        reward_funcs=lambda completions, **k: [1.0] * len(completions),
        args=args,
        train_dataset=ROWS,
    )
    before = [p.detach().clone() for p in trainer.policy.model.parameters()]
    trainer.train()
    steps = {int(s["step"]) for s in trainer.optimizer.state.values()}
    assert steps == {2}, "each zero-variance step advanced AdamW"
    assert all(not torch.equal(a, p) for a, p in zip(before, trainer.policy.model.parameters()))
    logs = trainer.state.log_history[0]
    assert logs["frac_reward_zero_std"] == 1.0 and logs["loss"] == 0.0
    # TRL's loss runs on (and logs the entropy of) groups whose rewards agree too.
    assert logs["grad_norm"] == 0.0 and logs["entropy"] > 0


def test_async_reward_functions_and_none_rewards(tmp_path):
    async def halves(completions, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    args = GRPOConfig(output_dir=str(tmp_path), **{**SETTINGS, "max_steps": 1})
    trainer = GRPOTrainer(
        model=MODEL, reward_funcs=[halves, varied_reward], args=args, train_dataset=ROWS
    )
    trainer.train()
    group = trainer.task.groups[0]
    assert group.per_function[:, 0].isnan().tolist() == [False, True, False, True]
    assert "rewards/halves/mean" in trainer.state.log_history[0]


def trl_later_update(
    trl, completions, prompts, tmp_path, first, second, micro_steps=(1,), **settings
):
    """TRL's gradient, loss and metrics of a later update on one generation: generated (and its
    old log-probabilities taken) at ``first`` weights, the update's ``micro_steps`` (TRL's
    ``_step`` of each micro-batch) at ``second``."""
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **{**SETTINGS, **settings})
    trainer = trl.GRPOTrainer(
        model=MODEL, reward_funcs=varied_reward, args=args, train_dataset=dataset()
    )
    trainer._generate_single_turn = lambda *a, **k: ([list(c) for c in completions], None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    batch = [{"prompt": p} for p in prompts]

    def load(weights):
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                param.copy_(weights[name])

    load(first)
    trainer._step = 0
    trainer._prepare_inputs(batch)
    load(second)
    loss_total = 0.0
    for micro in micro_steps:
        trainer._step = micro
        loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch))
        loss.backward()
        loss_total += float(loss)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    metrics = {name: sum(v) / len(v) for name, v in trainer._metrics["train"].items() if v}
    return grads, loss_total, metrics


@pytest.mark.parametrize(
    "settings",
    [
        dict(loss_type="dapo", num_iterations=2, epsilon=0.02, epsilon_high=0.03),
        dict(
            loss_type="grpo", num_iterations=2, epsilon=0.02, importance_sampling_level="sequence"
        ),
        # The update lowered the negative-advantage sequences' log-probabilities: OPSM drops them.
        dict(loss_type="dapo", num_iterations=2, epsilon=0.02, off_policy_mask_threshold=1e-6),
        # VESPO's sequence weights away from 1, and TRL's mean of them.
        dict(loss_type="vespo", num_iterations=2, vespo_k_pos=1.5, vespo_lambda_neg=0.5),
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_the_second_iteration_on_a_generation_gives_trls_gradient_and_clip_ratios(
    tmp_path, settings
):
    """num_iterations: the second update reuses the generation's rollouts and old
    log-probabilities (a no-gradient pass at the first update's weights), so its ratio is no
    longer 1 and clips; TRL's gradient, loss, entropy and clip_ratio/* at the same weights."""
    trl = trl_modules()
    steps = []
    ours, completions, prompts, logs, second = our_gradient(
        tmp_path, at=1, steps=steps, **{"max_steps": 2, **settings}
    )
    (first_groups, first, *_), (second_groups, *_) = steps[:2]
    reused = [g.completion_ids for g in first_groups] == [g.completion_ids for g in second_groups]
    assert reused, "the second update reused the generation"
    theirs, their_loss, metrics = trl_later_update(
        trl, completions, prompts, tmp_path, first, second, **settings
    )
    assert_same_gradient(ours, theirs)
    assert logs["loss"] == pytest.approx(their_loss, rel=1e-4, abs=1e-6)
    assert logs["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)
    if settings["loss_type"] == "vespo":
        phi = metrics["vespo/phi_seq_mean"]
        assert phi != pytest.approx(1.0, abs=1e-6), "every sequence weight is 1"
        assert logs["vespo/phi_seq_mean"] == pytest.approx(phi, rel=1e-5)
        return
    clip_keys = [k for k in metrics if k.startswith("clip_ratio/")]
    assert len(clip_keys) == 5
    if settings.get("importance_sampling_level") != "sequence":  # a sequence's mean drifts less
        assert metrics["clip_ratio/region_mean"] > 0, "the case clips nothing"
    for name in clip_keys:
        assert logs[name] == pytest.approx(metrics[name], abs=1e-6), name


def shuffled_as(order: list[int]):
    """TRL's ``shuffle_sequence_dict`` with ``order`` for its permutation (ours)."""
    permutation = torch.tensor(order)

    def shuffle(batch: dict) -> dict:
        def permute(value):
            if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
                return value
            if isinstance(value, torch.Tensor):
                return value[permutation]
            return [value[i] for i in permutation]

        return {key: permute(value) for key, value in batch.items()}

    return shuffle


@pytest.mark.parametrize(
    "settings",
    [
        dict(
            loss_type="dapo",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            steps_per_generation=4,
        ),
        dict(loss_type="bnpo", steps_per_generation=2),
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_a_step_on_a_share_of_a_larger_generation_gives_trls_gradient(
    tmp_path, monkeypatch, settings
):
    """steps_per_generation = 2 x gradient_accumulation_steps: one generation of two prompts
    serves two optimizer steps. From the same rollouts and the same shuffle (ours, given to
    TRL's shuffle_sequence_dict), the first step's gradient is TRL's, and so is the second's,
    on the other half of the generation at the moved weights, clipped against the generation's
    old log-probabilities."""
    trl = trl_modules()
    from trl.trainer import grpo_trainer

    steps = []
    _, completions, prompts, _, _ = our_gradient(
        tmp_path, at=1, max_steps=2, steps=steps, **settings
    )
    (first_groups, first, ours_first, logs_first), (second_groups, second, ours, logs) = steps
    assert [g.completion_ids for g in first_groups] == [g.completion_ids for g in second_groups]
    assert len(completions) == 8, "one generation of two prompts"
    order = generation_order(42, 0, len(completions))  # TRL's default seed, as ours
    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", shuffled_as(order))
    theirs, their_loss, _ = trl_gradient(trl, completions, prompts, tmp_path, **settings)
    assert_same_gradient(ours_first, theirs)
    assert logs_first["loss"] == pytest.approx(their_loss, rel=1e-4, abs=1e-6)
    micro_batches = settings.get("gradient_accumulation_steps", 1)
    theirs, their_loss, metrics = trl_later_update(
        trl,
        completions,
        prompts,
        tmp_path,
        first,
        second,
        micro_steps=range(micro_batches, 2 * micro_batches),
        **settings,
    )
    assert_same_gradient(ours, theirs)
    assert logs["loss"] == pytest.approx(their_loss, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize(
    "settings",
    [
        # TRL's GSPO example's buffer: steps_per_generation 4 x gradient_accumulation_steps,
        # sequence-level ratios, its clip range.
        dict(
            loss_type="grpo",
            importance_sampling_level="sequence",
            epsilon=3e-4,
            epsilon_high=4e-4,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            steps_per_generation=8,
        ),
        # generation_batch_size spelled instead, each buffer slice trained twice.
        dict(
            loss_type="dapo",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            generation_batch_size=12,
            num_iterations=2,
            epsilon=0.02,
        ),
    ],
    ids=["gspo-spg8-ga2", "dapo-gbs12-ga2-iter2"],
)
def test_every_step_of_a_buffered_generation_gives_trls_gradient(tmp_path, monkeypatch, settings):
    """One generation round serves every optimizer step of TRL's buffer (S = steps_per_generation
    / gradient_accumulation_steps slices, num_iterations times over): step k trains on slice
    k mod S of the shuffled generation batch, at the weights k-1 steps moved, its ratios
    against the old log-probabilities taken at generation. From the same rollouts and shuffle,
    each step's gradient is TRL's (its micro-batches 2k and 2k+1 of the buffer) within 1e-5
    relative, and so is its logged loss."""
    trl = trl_modules()
    from trl.trainer import grpo_trainer

    steps = []
    args = GRPOConfig(output_dir=str(tmp_path / "check"), **{**SETTINGS, **settings})
    updates = args.updates_per_generation
    _, completions, prompts, _, _ = our_gradient(
        tmp_path, at=updates - 1, max_steps=updates, steps=steps, **settings
    )
    assert len(steps) == updates, "a step of the buffer ran no backward"
    assert len(completions) == args.generation_batch_size
    first_weights = steps[0][1]
    order = generation_order(42, 0, len(completions))  # TRL's default seed, as ours
    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", shuffled_as(order))
    micro_batches = args.gradient_accumulation_steps
    for index, (groups, weights, ours, logs) in enumerate(steps):
        assert [g.completion_ids for g in groups] == [g.completion_ids for g in steps[0][0]]
        assert logs["step"] == index + 1
        theirs, their_loss, _ = trl_later_update(
            trl,
            completions,
            prompts,
            tmp_path,
            first_weights,
            weights,
            micro_steps=range(index * micro_batches, (index + 1) * micro_batches),
            **settings,
        )
        assert_gradient_within(ours, theirs, 1e-5)
        assert logs["loss"] == pytest.approx(their_loss, rel=1e-4, abs=1e-6)
