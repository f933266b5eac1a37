"""What the TRL side-by-side tests share: the embedded model with a chat template, the rows of a
synthetic task, and the two sides' classes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.bench_trl import QUIET_CPU_RUN  # noqa: F401  (the tests' run settings)

from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import TINY_MODEL_DIR


# A chat template in the embedded tokenizer's own characters (it has no special chat tokens).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def trl_modules():
    trl = pytest.importorskip("trl")
    pytest.importorskip("datasets")
    return trl


def sides():
    """(name, GRPOConfig, GRPOTrainer) of TRL and of rlvr_fast."""
    import rlvr_fast

    trl = trl_modules()
    return [
        ("trl", trl.GRPOConfig, trl.GRPOTrainer),
        ("rlvr_fast", rlvr_fast.GRPOConfig, rlvr_fast.GRPOTrainer),
    ]


def text_rows(count: int, seed: int = 5) -> list[dict]:
    return [
        {"prompt": render_prompt(p.question), "answer": p.answer, "level": p.level}
        for p in synthetic_problems("train", count, seed=seed)
    ]


def chat_rows(count: int, seed: int = 3) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": p.question}], "solution": p.answer}
        for p in synthetic_problems("train", count, seed=seed)
    ]


def chat_model_dir(directory: Path) -> Path:
    """A copy of the embedded model whose tokenizer has a chat template (as instruct models'
    have), so that a model given as a path brings its template."""
    target = directory / "tiny-chat"
    if not target.exists():
        shutil.copytree(TINY_MODEL_DIR, target)
        config_path = target / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = CHAT_TEMPLATE
        config_path.write_text(json.dumps(config, indent=1))
    return target


def varied_reward(completion_ids, **kwargs):
    """Differs within most groups, so steps run a backward on both sides."""
    return [float(sum(ids) % 7) for ids in completion_ids]
