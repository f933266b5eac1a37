"""The per-step ledger (seed §5.1): token counts, FLOPs and timings, one JSON line per step.

Token counts of a flat step with G rollouts of lengths L_i after a prompt of L_p tokens:
gen = leaf = sum L_i (trimmed after the first EOS, EOS included); pref = pad_pref = G * L_p (one
prompt, so no padding); untrim_gen = G * max L_i (what a sampler that keeps every row until the
last one ends would decode); bwd_out = leaf and bwd_full = G * L_p + leaf on steps that run a
backward pass, else 0. Pairs are rollouts (2k, 2k+1): [pl0, pl1, l0, l1, r0, r1, category] with
prefix lengths 0 on flat steps. FLOPs at P trainable parameters:
Out = (2 gen + 6 bwd_out) P, Full = (2 (pref + gen) + 6 bwd_full) P,
PadFull = (2 (pad_pref + untrim_gen) + 6 bwd_full) P.

``check_conservation`` enforces the laws every line must satisfy; a violation is a bug in the
trainer, so writing raises instead of recording a wrong line.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FLAT_CATEGORY = "flat"


class LedgerError(AssertionError):
    """A ledger line breaks a conservation law."""


@dataclass
class StepRecord:
    step: int
    question_id: str
    rewards: list[float]
    sigma_r: float
    homogeneous: bool
    active: bool
    optimizer_step: bool
    pairs: list[list]
    prompt_len: int
    lengths: list[int]
    gen: int
    pref: int
    pad_pref: int
    untrim_gen: int
    leaf: int
    bwd_out: int
    bwd_full: int
    decode_rows: int
    max_new_tokens: int
    params: int
    loss: float | None
    grad_norm: float | None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def flops_out(self) -> int:
        return (2 * self.gen + 6 * self.bwd_out) * self.params

    @property
    def flops_full(self) -> int:
        return (2 * (self.pref + self.gen) + 6 * self.bwd_full) * self.params

    @property
    def flops_pad_full(self) -> int:
        return (2 * (self.pad_pref + self.untrim_gen) + 6 * self.bwd_full) * self.params

    def to_json(self) -> dict:
        line = asdict(self)
        line.update(flops_out=self.flops_out, flops_full=self.flops_full,
                    flops_pad_full=self.flops_pad_full)
        return line


def flat_step_record(*, step: int, question_id: str, rewards: list[float], sigma_r: float,
                     active: bool, optimizer_step: bool, prompt_len: int, lengths: list[int],
                     decode_rows: int, max_new_tokens: int, params: int, loss: float | None,
                     grad_norm: float | None, seconds: dict[str, float]) -> StepRecord:
    group = len(lengths)
    leaf = sum(lengths)
    pairs = [[0, 0, lengths[i], lengths[i + 1], rewards[i], rewards[i + 1], FLAT_CATEGORY]
             for i in range(0, group - 1, 2)]
    return StepRecord(
        step=step, question_id=question_id, rewards=rewards, sigma_r=sigma_r,
        homogeneous=sigma_r == 0, active=active, optimizer_step=optimizer_step, pairs=pairs,
        prompt_len=prompt_len, lengths=lengths, gen=leaf, pref=group * prompt_len,
        pad_pref=group * prompt_len, untrim_gen=group * max(lengths), leaf=leaf,
        bwd_out=leaf if active else 0, bwd_full=group * prompt_len + leaf if active else 0,
        decode_rows=decode_rows, max_new_tokens=max_new_tokens, params=params, loss=loss,
        grad_norm=grad_norm, seconds=seconds)


def check_conservation(record: StepRecord) -> None:
    def require(condition: bool, law: str) -> None:
        if not condition:
            raise LedgerError(f"ledger step {record.step}: {law} violated")

    group = len(record.lengths)
    require(len(record.rewards) == group, "one reward per rollout")
    require(record.leaf == sum(record.lengths), "leaf = sum of leaf lengths")
    require([n for p in record.pairs for n in p[2:4]] == record.lengths, "pair lengths = leaves")
    require([r for p in record.pairs for r in p[4:6]] == record.rewards, "pair rewards = rewards")
    stage1_leaf = sum(p[0] + p[1] for p in record.pairs)
    stage2_gen = sum(p[2] - p[0] + p[3] - p[1] for p in record.pairs)
    require(stage1_leaf + stage2_gen == record.leaf, "S1_leaf + S2_gen = leaf")
    for pl0, pl1, l0, l1, *_ in record.pairs:
        for pl, length in ((pl0, l0), (pl1, l1)):
            require(0 <= length - pl <= record.max_new_tokens - pl, "0 <= L_b - pl_b <= cap - pl_b")
    require(record.gen == record.leaf, "flat steps: gen = leaf")
    require(record.untrim_gen == group * max(record.lengths), "untrim_gen = G max L_i")
    require(record.decode_rows == sum(n - 1 for n in record.lengths),
            "decode work = sum(L_i - 1): no decode after EOS")
    expected_out = record.leaf if record.active else 0
    require(record.bwd_out == expected_out, "bwd_out = leaf on backward steps, else 0")
    expected_full = group * record.prompt_len + record.leaf if record.active else 0
    require(record.bwd_full == expected_full, "bwd_full = G L_p + leaf on backward steps, else 0")
    require(record.homogeneous == (len(set(record.rewards)) == 1), "homogeneous iff sigma_R = 0")


class LedgerWriter:
    """Appends checked lines to ``ledger.jsonl``; each line is flushed and fsynced, so a kill
    leaves only whole lines behind."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        check_conservation(record)
        self.file.write(json.dumps(record.to_json()) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def truncate_jsonl(path: Path, keep_lines: int) -> None:
    """Keep the first ``keep_lines`` whole lines of a JSONL file (resume after a kill)."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    whole = [line for line in lines[:keep_lines] if line.endswith("\n")]
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text("".join(whole), encoding="utf-8")
    os.replace(temp, path)
