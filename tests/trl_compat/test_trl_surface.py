"""The ``Trainer`` surface TRL scripts use, on rlvr_fast's GRPOTrainer: callbacks, checkpoints
and bit-identical resuming, save strategies, evaluation (TRL's metric names, side by side),
log_completions, the accelerator, metrics and state files, model cards, refusals by name."""

from __future__ import annotations

import json

import pytest
import torch

from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer
from trl_side_by_side import QUIET_CPU_RUN, text_rows, trl_modules, varied_reward

MODEL = str(TINY_MODEL_DIR)
ROWS = text_rows(4)
SETTINGS = dict(
    max_steps=2,
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=16,
    temperature=0.8,
    learning_rate=1e-3,
    **QUIET_CPU_RUN,
)


def trainer_for(tmp_path, rows=ROWS, callbacks=None, **settings):
    args = GRPOConfig(output_dir=str(tmp_path), **{**SETTINGS, **settings})
    return GRPOTrainer(
        model=MODEL, reward_funcs=varied_reward, args=args, train_dataset=rows, callbacks=callbacks
    )


def test_callbacks_see_steps_and_logs_and_can_stop(tmp_path):
    from transformers import TrainerCallback

    events = []

    class Watcher(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            events.append(("begin", state.global_step))

        def on_step_end(self, args, state, control, **kwargs):
            events.append(("end", state.global_step))
            control.should_training_stop = state.global_step == 1

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(("log", "reward" in logs))

    output = trainer_for(tmp_path, callbacks=[Watcher()]).train()
    assert output.global_step == 1
    assert events == [("begin", 0), ("end", 1), ("log", True), ("log", False)]


def weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}


def test_resuming_from_a_checkpoint_continues_bit_for_bit(tmp_path):
    # Two prompts per step, two steps per epoch: the resumed step opens a new epoch.
    settings = dict(per_device_train_batch_size=8, max_steps=3, save_strategy="steps", save_steps=1)
    straight = trainer_for(tmp_path / "straight", **settings)
    straight.train()
    assert (tmp_path / "straight" / "checkpoint-2" / "rlvr_fast" / "state.safetensors").is_file()
    resumed = trainer_for(tmp_path / "resumed", **settings)
    output = resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    assert output.global_step == 3
    for name, tensor in weights(straight).items():
        assert torch.equal(tensor, weights(resumed)[name]), name
    assert resumed.state.log_history[:2] == straight.state.log_history[:2]
    reloaded = load_policy(tmp_path / "straight" / "checkpoint-3")
    for a, b in zip(reloaded.model.parameters(), straight.policy.model.parameters()):
        assert torch.equal(a, b)


def test_resume_true_takes_the_newest_checkpoint_and_save_total_limit_keeps_one(tmp_path):
    trainer = trainer_for(tmp_path, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    again = trainer_for(tmp_path, save_strategy="steps", save_steps=1, max_steps=3)
    assert again.train(resume_from_checkpoint=True).global_step == 3
    with pytest.raises(ValueError, match="No valid checkpoint"):
        trainer_for(tmp_path / "empty").train(resume_from_checkpoint=True)


def test_save_strategy_epoch_and_save_only_model(tmp_path):
    trainer = trainer_for(tmp_path, save_strategy="epoch", save_only_model=True, max_steps=3)
    trainer.train()
    # Four prompts, one per step: an epoch is four steps, so only the end of training saves.
    assert not list(tmp_path.glob("checkpoint-*"))
    trainer = trainer_for(tmp_path / "two", rows=ROWS[:2], save_strategy="epoch")
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "two").glob("checkpoint-*")) == ["checkpoint-2"]
    assert (tmp_path / "two" / "checkpoint-2" / "trainer_state.json").is_file()


def eval_run(config_cls, trainer_cls, out_dir):
    args = config_cls(
        output_dir=str(out_dir),
        **{**SETTINGS, "eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 4},
    )
    trainer = trainer_cls(
        model=MODEL,
        reward_funcs=varied_reward,
        args=args,
        train_dataset=ROWS,
        eval_dataset=text_rows(2, seed=9),
    )
    trainer.train()
    return [log for log in trainer.state.log_history if "eval_loss" in log]


def test_evaluation_logs_trls_eval_metrics(tmp_path):
    trl = trl_modules()
    from datasets import Dataset

    theirs = eval_run(
        trl.GRPOConfig,
        lambda **kw: trl.GRPOTrainer(
            **{
                **kw,
                "train_dataset": Dataset.from_list(kw["train_dataset"]),
                "eval_dataset": Dataset.from_list(kw["eval_dataset"]),
            }
        ),
        tmp_path / "trl",
    )
    ours = eval_run(GRPOConfig, GRPOTrainer, tmp_path / "ours")
    assert len(ours) == len(theirs) == 1
    assert set(ours[0]) == set(theirs[0])
    assert ours[0]["step"] == theirs[0]["step"] == 2


def test_log_completions_prints_a_table_and_writes_jsonl(tmp_path, capsys):
    trainer_for(tmp_path, log_completions=True, num_completions_to_print=2).train()
    printed = capsys.readouterr().out
    assert "completions at step 1" in printed and "advantage" in printed
    lines = (tmp_path / "completions" / "completions_00001.jsonl").read_text().splitlines()
    entry = json.loads(lines[0])
    assert len(lines) == 4 and set(entry) == {"step", "prompt", "completion", "varied_reward"} | {
        "advantage"
    }


def test_trainer_surface_scripts_call(tmp_path, capsys):
    trainer = trainer_for(tmp_path)
    accelerator = trainer.accelerator
    assert accelerator.is_main_process and accelerator.num_processes == 1
    assert accelerator.process_index == 0 and accelerator.device.type == "cpu"
    assert accelerator.unwrap_model(trainer.model) is trainer.model
    accelerator.wait_for_everyone()
    accelerator.print("printed once")
    metrics = trainer.train().metrics
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    trainer.model.config.use_cache = True
    trainer.save_model()
    trainer.create_model_card({"tags": ["rl"]})
    trainer.end()
    out = capsys.readouterr().out
    assert "printed once" in out and "***** train metrics *****" in out
    assert json.loads((tmp_path / "train_results.json").read_text())["train_loss"] is not None
    assert (tmp_path / "trainer_state.json").is_file() and (tmp_path / "README.md").is_file()
    assert load_policy(tmp_path).config == trainer.policy.config
    with pytest.raises(RuntimeError, match="never contacts the Hub"):
        trainer.push_to_hub()


@pytest.mark.parametrize(
    "argument,message",
    [
        ({"quantization_config": object()}, "quantization_config=object"),
        ({"optimizers": (object(), None)}, "optimizers=tuple"),
        ({"rollout_func": print}, "rollout_func=builtin_function_or_method"),
    ],
)
def test_constructor_arguments_it_does_not_implement_are_refused_by_name(
    tmp_path, argument, message
):
    args = GRPOConfig(output_dir=str(tmp_path), **SETTINGS)
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(
            model=MODEL, reward_funcs=varied_reward, args=args, train_dataset=ROWS, **argument
        )
    GRPOTrainer(
        model=MODEL, reward_funcs=varied_reward, args=args, train_dataset=ROWS, peft_config=None
    )


def test_report_to_tensorboard_writes_events_or_names_the_missing_package(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="tensorboard"):
            trainer_for(tmp_path, report_to="tensorboard")
        return
    trainer_for(tmp_path, report_to="tensorboard").train()
    assert list(tmp_path.rglob("events.out.tfevents.*"))


def test_a_reward_model_path_scores_completions_in_one_batch(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(MODEL)
    config.num_labels = 1
    torch.manual_seed(0)
    reward_model = transformers.AutoModelForSequenceClassification.from_config(config)
    reward_model.save_pretrained(tmp_path / "rm")
    transformers.AutoTokenizer.from_pretrained(MODEL).save_pretrained(tmp_path / "rm")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**SETTINGS, "max_steps": 1})
    trainer = GRPOTrainer(
        model=MODEL, reward_funcs=str(tmp_path / "rm"), args=args, train_dataset=ROWS
    )
    trainer.train()
    assert trainer.reward_func_names == ["rm"]
    group = trainer.task.groups[0]
    assert not group.per_function.isnan().any()
    assert "rewards/rm/mean" in trainer.state.log_history[0]
