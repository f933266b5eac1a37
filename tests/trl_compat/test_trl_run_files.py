"""What a run leaves on disk beside TRL's, and a checkpoint TRL wrote resumed by rlvr_fast.

The same run on both sides (two steps, a checkpoint at each, ``save_model``) leaves the same
files but TRL's optimizer, scheduler and RNG files (rlvr_fast's state is one checked file); the
model's config, generation config and tokenizer config are TRL's to the byte, the trainer
state has TRL's fields. A ``checkpoint-1`` TRL wrote (trl itself, here) resumes on rlvr_fast with
TRL's weights, AdamW moments and step, and learning rate, and the run continues; files needing
more than ``torch.load(weights_only=True)`` are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer
from rlvr_fast.trl_compat.trl_checkpoint import by_trl_name, trained_tensors
from trl_side_by_side import QUIET_CPU_RUN, text_rows, trl_modules, varied_reward

MODEL = str(TINY_MODEL_DIR)
ROWS = text_rows(8)
SETTINGS = dict(
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=16,
    learning_rate=1e-3,
    **dict(QUIET_CPU_RUN, save_strategy="steps"),
    save_steps=1,
)
# Where rlvr_fast's checkpoint differs from transformers': its state in one checked file.
TRL_STATE_FILES = {"optimizer.pt", "scheduler.pt", "rng_state.pth"}
OUR_STATE_FILES = {"rlvr_fast/state.safetensors", "rlvr_fast/manifest.json"}


def lora_config():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def run(side_config, side_trainer, output_dir: Path, max_steps: int, lora):
    """A trainer of ``max_steps``: full (lora False), LoRA by ``peft_config`` (True) or on a
    PeftModel ("peft_model", its adapter named "policy")."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    args = side_config(output_dir=str(output_dir), max_steps=max_steps, **SETTINGS)
    model, peft_config = MODEL, lora_config() if lora else None
    if lora == "peft_model":
        base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        model = pytest.importorskip("peft").get_peft_model(base, peft_config, "policy")
        peft_config = None
    return side_trainer(
        model=model,
        reward_funcs=varied_reward,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        peft_config=peft_config,
    )


def files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_run_leaves_trls_files(tmp_path, lora):
    trl = trl_modules()
    outputs = {}
    for name, config, trainer_class in (
        ("trl", trl.GRPOConfig, trl.GRPOTrainer),
        ("ours", GRPOConfig, GRPOTrainer),
    ):
        trainer = run(config, trainer_class, tmp_path / name, 2, lora)
        trainer.train()
        trainer.save_model()
        outputs[name] = tmp_path / name
    theirs, ours = files(outputs["trl"]), files(outputs["ours"])

    def without_state(names):
        return {n for n in names if Path(n).name not in TRL_STATE_FILES | {"README.md"}} - {
            f"checkpoint-{s}/{f}" for s in (1, 2) for f in OUR_STATE_FILES
        }

    # peft's own model card in each LoRA checkpoint is written by a PeftModel's save only.
    assert without_state(theirs) == without_state(ours)
    assert "README.md" in ours and "training_args.bin" in ours
    assert {f"checkpoint-{s}/{f}" for s in (1, 2) for f in OUR_STATE_FILES} <= ours
    for name in (
        "tokenizer_config.json",
        *(() if lora else ("config.json", "generation_config.json")),
    ):
        assert (outputs["trl"] / name).read_bytes() == (outputs["ours"] / name).read_bytes(), name
    tokenizer = json.loads((outputs["ours"] / "tokenizer_config.json").read_text())
    assert tokenizer["padding_side"] == "left" and tokenizer["truncation_side"] == "left"
    state = [
        json.loads((outputs[s] / "checkpoint-2/trainer_state.json").read_text()) for s in outputs
    ]
    assert set(state[0]) == set(state[1])
    for field in ("eval_steps", "logging_steps", "save_steps", "max_steps", "stateful_callbacks"):
        assert state[0][field] == state[1][field], field
    args = torch.load(outputs["ours"] / "training_args.bin", weights_only=False)
    assert isinstance(args, GRPOConfig) and args.output_dir == str(outputs["ours"])
    if lora:
        written = json.loads((outputs["ours"] / "adapter_config.json").read_text())
        expected = json.loads((outputs["trl"] / "adapter_config.json").read_text())
        assert set(written["target_modules"]) == set(expected.pop("target_modules"))
        assert {k: written[k] for k in expected} == expected


def trl_optimizer_by_name(trainer) -> tuple[dict, dict]:
    """TRL's live AdamW state by parameter name (its parameters' own identities) and weights."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    moments = {}
    for group in trainer.optimizer.param_groups:
        for param in group["params"]:
            moments[names[id(param)]] = trainer.optimizer.state[param]
    weights = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad
    }
    return moments, weights


@pytest.mark.parametrize("lora", [False, True, "peft_model"], ids=["full", "lora", "peft_model"])
def test_a_checkpoint_trl_wrote_resumes_on_rlvr_fast_with_its_weights_moments_and_schedule(
    tmp_path, lora
):
    trl = trl_modules()
    trl_run = run(trl.GRPOConfig, trl.GRPOTrainer, tmp_path / "out", 1, lora)
    trl_run.train()
    moments, weights = trl_optimizer_by_name(trl_run)
    learning_rate = trl_run.lr_scheduler.get_last_lr()[0]
    assert (tmp_path / "out/checkpoint-1/optimizer.pt").is_file()

    ours = run(GRPOConfig, GRPOTrainer, tmp_path / "out", 2, lora)
    seen = {}

    from transformers import TrainerCallback

    class AtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            tensors = trained_tensors(ours)
            stepping = ours.trainer.stepping
            by_id = {id(p): i for i, p in enumerate(stepping.stepped)}
            optimizer_state = stepping.optimizer.state_dict()["state"]
            per_name = {
                key: {n: optimizer_state[by_id[id(t)]][key].clone() for n, t in tensors.items()}
                for key in ("exp_avg", "exp_avg_sq")
            }
            seen["weights"] = {n: v.clone() for n, v in by_trl_name(ours, tensors).items()}
            seen["moments"] = {k: by_trl_name(ours, v) for k, v in per_name.items()}
            seen["step"] = {float(s["step"]) for s in optimizer_state.values()}
            seen["lr"] = stepping.optimizer.param_groups[0]["lr"]
            seen["global_step"] = state.global_step

    ours.add_callback(AtStart())
    ours.train(resume_from_checkpoint=True)
    assert seen["global_step"] == 1 and seen["step"] == {1.0}
    assert seen["lr"] == pytest.approx(learning_rate, rel=1e-12)
    assert set(seen["weights"]) == set(weights)
    for name, value in weights.items():
        assert torch.equal(seen["weights"][name], value), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(seen["moments"][key][name], moments[name][key]), (name, key)
    assert any(float(m["exp_avg"].abs().max()) > 0 for m in moments.values())
    # The run continued from there: TRL's first log, then rlvr_fast's second step.
    assert ours.state.global_step == 2
    logged = [entry["step"] for entry in ours.state.log_history if "loss" in entry]
    assert logged == [1, 2]
    assert (tmp_path / "out/checkpoint-2/rlvr_fast/state.safetensors").is_file()


def test_what_a_trl_checkpoint_needs_beyond_tensors_is_refused_by_name(tmp_path):
    trl = trl_modules()
    trl_run = run(trl.GRPOConfig, trl.GRPOTrainer, tmp_path / "out", 1, False)
    trl_run.train()
    checkpoint = tmp_path / "out/checkpoint-1"
    optimizer = checkpoint / "optimizer.pt"
    saved = optimizer.read_bytes()
    torch.save({"state": {}, "param_groups": [], "extra": Path("pickled")}, optimizer)

    def resume():
        ours = run(GRPOConfig, GRPOTrainer, tmp_path / "out", 2, False)
        ours.train(resume_from_checkpoint=str(checkpoint))

    with pytest.raises(ValueError, match=r"optimizer\.pt: needs unpickling beyond tensors"):
        resume()
    optimizer.write_bytes(saved)
    (checkpoint / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: pickled weights"):
        resume()
