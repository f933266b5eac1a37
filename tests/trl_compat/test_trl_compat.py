"""The TRL drop-in (``rlvr_fast.trl_compat``): one script body run with ``trl`` and with
rlvr_fast, gradients from identical rollouts, reward-function calls, refused settings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rlvr_fast
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.checkpoint import packed_to_hf
from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer, UnsupportedFieldError
from rlvr_fast.trl_compat.config import DEFAULT_ONLY_FIELDS, NO_EFFECT_FIELDS
from rlvr_fast.trl_compat.trainer import LRSchedule, train_config

MODEL = str(TINY_MODEL_DIR)
ROWS = [
    {"prompt": render_prompt(p.question), "answer": p.answer, "level": p.level}
    for p in synthetic_problems("train", 4, seed=5)
]
# Small enough for CI, long enough that some completions end and some are cut.
SETTINGS = dict(
    max_steps=2,
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=24,
    temperature=0.8,
    learning_rate=1e-3,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    bf16=False,
    use_cpu=True,
    disable_tqdm=True,
)


def varied_reward(completion_ids, **kwargs):
    """Differs within most groups, so steps run a backward on both sides."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def trl_modules():
    trl = pytest.importorskip("trl")
    pytest.importorskip("datasets")
    return trl


def dataset():
    from datasets import Dataset

    return Dataset.from_list(ROWS)


class Recorder:
    """A reward function that records how it was called."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append(
            dict(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                kwargs=kwargs,
            )
        )
        return [
            float(rlvr_fast.grade_response(c, a)) for c, a in zip(completions, kwargs["answer"])
        ]


def run_script(config_cls, trainer_cls, out_dir):
    """A TRL user's script body; only the classes differ between the two runs."""
    recorder = Recorder()
    args = config_cls(output_dir=str(out_dir), **SETTINGS)
    trainer = trainer_cls(
        model=MODEL, reward_funcs=[recorder, varied_reward], args=args, train_dataset=dataset()
    )
    trainer.train()
    return trainer, recorder


def test_the_same_script_runs_on_trl_and_on_rlvr_fast(tmp_path):
    trl = trl_modules()
    theirs, their_recorder = run_script(trl.GRPOConfig, trl.GRPOTrainer, tmp_path / "trl")
    ours, our_recorder = run_script(GRPOConfig, GRPOTrainer, tmp_path / "ours")
    our_calls, their_calls = our_recorder.calls, their_recorder.calls
    assert ours.state.global_step == theirs.state.global_step == SETTINGS["max_steps"]
    assert ours.state.max_steps == theirs.state.max_steps
    their_logs, our_logs = theirs.state.log_history, ours.state.log_history
    assert len(our_logs) == len(their_logs) == SETTINGS["max_steps"] + 1
    for mine, their in zip(our_logs, their_logs):
        assert set(mine) == set(their)
        assert mine["step"] == their["step"] and mine["epoch"] == pytest.approx(their["epoch"])
    assert our_logs[0]["learning_rate"] == pytest.approx(their_logs[0]["learning_rate"])
    assert our_logs[1]["learning_rate"] == pytest.approx(their_logs[1]["learning_rate"])
    # Same prompts in the same order (TRL's seeded shuffle), the same reward-function call.
    assert [c["prompts"] for c in our_calls] == [c["prompts"] for c in their_calls]
    for mine, their in zip(our_calls, their_calls):
        assert (
            set(mine["kwargs"])
            == set(their["kwargs"])
            == {"answer", "level", "trainer_state", "log_extra", "log_metric"}
        )
        assert mine["kwargs"]["answer"] == their["kwargs"]["answer"]
        assert mine["kwargs"]["level"] == their["kwargs"]["level"]
        assert all(isinstance(c, str) for c in mine["completions"])
        assert all(isinstance(t, int) for ids in mine["completion_ids"] for t in ids)
        assert mine["kwargs"]["trainer_state"] is ours.state


def trl_gradient(trl, loss_type, completions, prompt, tmp_path, **settings):
    """TRL's gradient of one step whose generation returns ``completions``."""
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), loss_type=loss_type, **{**SETTINGS, **settings}
    )
    trainer = trl.GRPOTrainer(
        model=MODEL, reward_funcs=varied_reward, args=args, train_dataset=dataset()
    )
    trainer._generate_single_turn = lambda *a, **k: ([list(c) for c in completions], None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions([{"prompt": prompt}] * len(completions))
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}, float(loss)


def our_gradient(loss_type, tmp_path, **settings):
    """Our gradient of the first step that ran a backward, its completions, prompt and loss."""
    args = GRPOConfig(
        output_dir=str(tmp_path / "ours"),
        loss_type=loss_type,
        **{**SETTINGS, "max_steps": 3, **settings},
    )
    trainer = GRPOTrainer(
        model=MODEL, reward_funcs=varied_reward, args=args, train_dataset=dataset()
    )
    captured = []
    clip = trainer.trainer.stepping.clip_gradients

    def capture():
        grads = {n: p.grad.clone() for n, p in trainer.policy.model.named_parameters()}
        captured.append((grads, trainer.task.last, trainer.state.global_step))
        return clip()

    trainer.trainer.stepping.clip_gradients = capture
    trainer.train()
    assert captured, "no step ran a backward (rewards never varied)"
    grads, scored, step = captured[0]
    return (
        packed_to_hf(grads, trainer.policy.config),
        scored.completion_ids,
        ROWS[scored.row]["prompt"],
        trainer.state.log_history[step]["loss"],
    )


def first_row(rows: int) -> int:
    """The row of the first step: TRL's shuffle, randperm from a generator seeded with seed."""
    return int(torch.randperm(rows, generator=torch.Generator().manual_seed(42))[0])


@pytest.mark.parametrize(
    "loss_type,settings",
    [
        ("dapo", {}),
        ("grpo", {}),
        ("dr_grpo", {}),
        ("bnpo", {}),
        ("dapo", {"mask_truncated_completions": True}),
        ("grpo", {"scale_rewards": "none"}),
    ],
)
def test_one_step_from_identical_rollouts_gives_trls_gradient(tmp_path, loss_type, settings):
    trl = trl_modules()
    ours, completions, prompt, our_loss = our_gradient(loss_type, tmp_path, **settings)
    theirs, their_loss = trl_gradient(trl, loss_type, completions, prompt, tmp_path, **settings)
    assert set(ours) == set(theirs)
    scale = max(float(g.abs().max()) for g in theirs.values())
    assert scale > 0
    for name, grad in theirs.items():
        torch.testing.assert_close(
            ours[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert our_loss == pytest.approx(their_loss, rel=1e-4, abs=1e-6)


def test_trl_config_fields_are_all_classified_with_trls_defaults():
    trl = trl_modules()
    ours = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for f in dataclasses.fields(trl.GRPOConfig):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name in DEFAULT_ONLY_FIELDS:
            assert DEFAULT_ONLY_FIELDS[f.name] == default, f.name
        elif f.name in ours:
            assert ours[f.name] == default, f.name
        else:
            assert f.name in NO_EFFECT_FIELDS, f"{f.name} is not classified"


def other_value(default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 3
    if isinstance(default, str):
        return default + "-other"
    if isinstance(default, list):
        return ["other"]
    return "other"


@pytest.mark.parametrize("name", sorted(DEFAULT_ONLY_FIELDS))
def test_every_unsupported_trl_field_is_refused_by_name(name):
    default = DEFAULT_ONLY_FIELDS[name]
    GRPOConfig(**{name: default})
    with pytest.raises(UnsupportedFieldError, match=rf"^GRPOConfig: {name}="):
        GRPOConfig(**{name: other_value(default)})


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(per_device_train_batch_size=16), "per_device_train_batch_size x gradient_accum"),
        (dict(num_generations=3, per_device_train_batch_size=3), "num_generations must be even"),
        (dict(num_generations=1, per_device_train_batch_size=1), "num_generations >= 2"),
        (dict(loss_type="cispo"), "loss_type must be one of"),
        (
            dict(loss_type="bnpo", per_device_train_batch_size=4, gradient_accumulation_steps=2),
            "loss_type='bnpo'",
        ),
        (dict(steps_per_generation=2), "steps_per_generation"),
        (dict(generation_batch_size=8, steps_per_generation=1), "cannot both be set"),
        (dict(lr_scheduler_type="polynomial"), "lr_scheduler_type"),
        (dict(report_to="wandb"), "report_to"),
        (dict(arm="no_such_arm"), "arm must be one of"),
    ],
)
def test_config_checks_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**settings)


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match="'learning_rat'"):
        GRPOConfig(learning_rat=1e-5)


def test_config_mapping_defaults_fast_paths_and_arms():
    config = train_config(GRPOConfig(), 10)
    assert (config.loss_type, config.loss_order, config.tempered_logprobs) == (
        "dapo",
        "token_weighted",
        True,
    )
    assert config.skip_zero_var and config.zero_var_step == "zero_grad"
    assert config.group_size == 8 and config.lr == 1e-6 and config.temperature == 1.0
    arm = train_config(GRPOConfig(arm="ra_flat"), 10)
    assert arm.gate_min_chars == 30 and arm.loss_type == "dapo"
    baseline = train_config(GRPOConfig(arm="baseline", loss_type="sum"), 10)
    assert baseline.loss_order == "sum_then_scale" and not baseline.skip_zero_var
    assert not baseline.tempered_logprobs
    tree = train_config(GRPOConfig(arm="stopped_tree", loss_type="sum"), 10)
    assert tree.sampler == "tree" and tree.tree_k == 4
    with pytest.raises(ValueError, match="loss_type='sum'"):
        train_config(GRPOConfig(tree=True), 10)
    with pytest.raises(ValueError, match="parallel-path arms"):
        train_config(GRPOConfig(arm="shapley_vote"), 10)


def test_linear_schedule_matches_transformers():
    transformers = pytest.importorskip("transformers")
    for kind in ("linear", "cosine", "constant_with_warmup"):
        ours = LRSchedule(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5), kind, 3, 10
        )
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        theirs = transformers.get_scheduler(
            kind, optimizer, num_warmup_steps=3, num_training_steps=10
        )
        for _ in range(10):
            assert ours.get_last_lr()[0] == pytest.approx(theirs.get_last_lr()[0], abs=1e-12)
            optimizer.step()
            ours.step()
            theirs.step()


def test_transformers_model_is_trained_in_place_with_chat_prompts(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Answer:{% endif %}"
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []

    def reward(prompts, completions, **kwargs):
        calls.append((prompts, completions))
        return varied_reward(**kwargs)

    rows = [
        {"prompt": [{"role": "user", "content": p.question}]}
        for p in synthetic_problems("train", 2, seed=3)
    ]
    args = GRPOConfig(output_dir=str(tmp_path), **{**SETTINGS, "max_steps": 2})
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=rows, processing_class=tokenizer
    )
    trainer.train()
    prompts, completions = calls[0]
    assert prompts[0] == rows[first_row(len(rows))]["prompt"]
    assert completions[0][0]["role"] == "assistant"
    assert isinstance(completions[0][0]["content"], str)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    ours = packed_to_hf(
        {n: p.detach() for n, p in trainer.policy.model.named_parameters()}, trainer.policy.config
    )
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), ours[name]), name
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


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
    assert logs["grad_norm"] == 0.0 and logs["entropy"] is None


def test_callbacks_see_steps_and_logs_and_can_stop(tmp_path):
    events = []

    class Watcher:
        def on_step_begin(self, args, state, control, **kwargs):
            events.append(("begin", state.global_step))

        def on_step_end(self, args, state, control, **kwargs):
            events.append(("end", state.global_step))
            control.should_training_stop = state.global_step == 1

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(("log", "reward" in logs))

    args = GRPOConfig(output_dir=str(tmp_path), **SETTINGS)
    trainer = GRPOTrainer(
        model=MODEL,
        reward_funcs=varied_reward,
        args=args,
        train_dataset=ROWS,
        callbacks=[Watcher()],
    )
    output = trainer.train()
    assert output.global_step == 1
    assert events == [("begin", 0), ("end", 1), ("log", True), ("log", False)]


def test_save_steps_write_loadable_checkpoints_and_the_ledger(tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        ledger=True,
        **{**SETTINGS, "save_strategy": "steps", "save_steps": 1},
    )
    trainer = GRPOTrainer(model=MODEL, reward_funcs=varied_reward, args=args, train_dataset=ROWS)
    trainer.train()
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").is_file()
    reloaded = load_policy(tmp_path / "checkpoint-2")
    for a, b in zip(reloaded.model.parameters(), trainer.policy.model.parameters()):
        assert torch.equal(a, b)
    assert len((tmp_path / "ledger" / "ledger.jsonl").read_text().splitlines()) == 2
    trainer.save_model()
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").is_file(), "save_model keeps them"
    assert (tmp_path / "ledger" / "ledger.jsonl").is_file()
    assert load_policy(tmp_path).model.config == trainer.policy.model.config
