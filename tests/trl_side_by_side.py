"""What the TRL side-by-side tests share: the embedded model with a chat template, the rows of a
synthetic task, and the two sides' classes."""

from __future__ import annotations

import json
import shutil
import weakref
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


# A chat template with tool calls in the embedded tokenizer's characters: the assistant's turn ends
# with its end-of-sequence text (so TRL's tool turn is cut after it, as Qwen's), tool calls are
# <tool_call>JSON</tool_call>; and transformers' response template that parses them.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}; {% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "assistant: {{ m.content }}{% for call in m.tool_calls or [] %}<tool_call>"
    "{{ call.function | tojson }}</tool_call>{% endfor %}<|endoftext|>; "
    "{%- elif m.role == 'tool' -%}tool: {{ m.content }}; "
    "{%- else -%}{{ m.role }}: {{ m.content }}; "
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}assistant: {% endif -%}"
)
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "assistant: ",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|endoftext\|>\s*", "content": "text"},
    },
}


def tool_model_dir(directory: Path) -> Path:
    """A copy of the embedded model whose tokenizer renders and parses tool calls."""
    target = directory / "tiny-tools"
    if not target.exists():
        shutil.copytree(TINY_MODEL_DIR, target)
        config_path = target / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = TOOL_CHAT_TEMPLATE
        config["response_template"] = TOOL_RESPONSE_TEMPLATE
        config_path.write_text(json.dumps(config, indent=1))
    return target


class ScriptedTurns:
    """A stand-in sampler for the engine (the embedded model never writes a tool call): every
    pass of the model runs as ever, and the token each row draws is replaced by the next one of
    its script, a list of turns (texts, each ended by end-of-sequence) given to the rows in the
    order the engine first draws for them, cycling. ``install(monkeypatch)`` patches the model
    runner's two draws."""

    def __init__(self, tokenizer, scripts: list[list[str]]) -> None:
        eos = tokenizer.eos_token_id
        self.scripts = [[tokenizer(t)["input_ids"] + [eos] for t in s] for s in scripts]
        self.eos, self.rows, self.seen = eos, weakref.WeakKeyDictionary(), 0

    def token(self, seq) -> int:
        if seq not in self.rows:
            self.rows[seq] = (self.scripts[self.seen % len(self.scripts)], [])
            self.seen += 1
        script, starts = self.rows[seq]
        if seq.start not in starts:
            starts.append(seq.start)
        turn = starts.index(seq.start)
        ids = script[turn] if turn < len(script) else []
        return ids[seq.num_generated] if seq.num_generated < len(ids) else self.eos

    def install(self, monkeypatch) -> None:
        import torch

        from rlvr_fast.engine.model_runner import ModelRunner

        decode, draw = ModelRunner.decode, ModelRunner.draw

        def scripted_decode(runner, batch, params):
            decode(runner, batch, params)
            return torch.tensor([self.token(seq) for seq in batch.rows])

        def scripted_draw(runner, logits, rows, params):
            draw(runner, logits, rows, params)
            return torch.tensor([self.token(seq) for seq in rows])

        monkeypatch.setattr(ModelRunner, "decode", scripted_decode)
        monkeypatch.setattr(ModelRunner, "draw", scripted_draw)
