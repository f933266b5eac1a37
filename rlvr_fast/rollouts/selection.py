"""``rlvr-fast select-data``: the study's math_train_zpd.json / math_train_stratified.json, made
reproducible.

Each question's pass rate is estimated from K samples of the policy on the rollout engine, at the
trainer's sampling settings (T = 0.8, top-p 0.9, 512 new tokens unless told otherwise), graded
as the trainer grades rewards (``final_answer``, with the derivation gate if asked, then
``grade_many``). The questions whose rate lies in the pass range are kept: by default the zone
of proximal development 0 < pass < 1, the questions on which a group of K samples has
sigma_R > 0 and so a gradient. They are written in stratified order: round-robin over the
(subject, level) cells, cells sorted, questions in file order within a cell, so that every
prefix (``--limit N``, or the study's ``[:100]``) is balanced over the cells. Each row is the
problem as ``load_problems`` reads it back, plus ``pass_rate``, ``passes`` and ``samples``.

Question i's K samples draw from streams derived from (seed, i) alone, so its rate does not
depend on which questions share its batch, and a resumed run measures what an uninterrupted one
measures. Rates go to OUT.rates.jsonl (first line: the settings), one batch of questions at a
time, flushed and fsynced; the same command run again skips the questions already measured and
refuses a rates file made with other settings or other data (its header records the model, the
settings and a hash of every question's id, text and answer, so changed questions under the same
ids are measured anew, not read back). Once every question is measured the selection is written
atomically; the rates file stays, so another range or limit re-selects without sampling again.

OUT is never a file select-data did not write: an existing OUT is replaced only when its rates
file beside it says it is a selection (a data file, a run's ledger, anything else is refused
before anything is sampled), never when it is the ``--data`` file itself; the output's lock (in the cache
directory, ``rlvr_fast.utils.locks.lock_output``, never beside the user's files) keeps a second
select-data off it while one runs.

    rlvr-fast select-data --model PATH --data math_train.json --k 8 --out math_train_zpd.json
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from rlvr_fast.data.problems import Problem, render_prompt
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.engine.token_sampler import derive_seed
from rlvr_fast.rollouts.evaluation import encode_prompts
from rlvr_fast.utils.files import UnreadableFileError, open_regular, read_text, write_text_atomic
from rlvr_fast.utils.locks import DirectoryLockedError, lock_output
from rlvr_fast.rollouts.generation import sample_groups
from rlvr_fast.grading import final_answer, grade_many
from rlvr_fast.rollouts.limits import MAX_GROUP_SIZE, MAX_NEW_TOKENS, MAX_SEED


# A rates file is one short line per question (MAX_PROBLEMS of them) after its header line.
MAX_RATES_BYTES = 64 << 20
MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class SelectionSettings:
    """What a pass rate depends on (the rates file records it): the model, K, sampling and
    grading settings, and the seed the sampling streams derive from."""

    model: str
    k: int = 8
    max_new_tokens: int = 512
    temperature: float = 0.8
    top_p: float = 0.9
    gate_min_chars: int | None = None
    seed: int = 42

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.k <= MAX_GROUP_SIZE, f"--k must be in [1, {MAX_GROUP_SIZE}], got {self.k}"),
            (
                1 <= self.max_new_tokens <= MAX_NEW_TOKENS,
                f"--max-new-tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}",
            ),
            (
                0 < self.temperature < math.inf,
                f"--temperature must be a finite number > 0, got {self.temperature}",
            ),
            (0 <= self.seed <= MAX_SEED, f"--seed must be in [0, 2**63 - 1], got {self.seed}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}"),
            (
                self.gate_min_chars is None or self.gate_min_chars >= 0,
                f"--gate-min-chars must be >= 0, got {self.gate_min_chars}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class PassRange:
    """Pass rates kept: >= low (None: > 0) and <= high (None: < 1)."""

    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("--min-pass", self.low), ("--max-pass", self.high)):
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"--min-pass ({self.low}) is above --max-pass ({self.high})")

    def __contains__(self, rate: float) -> bool:
        above = rate > 0 if self.low is None else rate >= self.low
        below = rate < 1 if self.high is None else rate <= self.high
        return above and below

    def __str__(self) -> str:
        low = "0 <" if self.low is None else f"{self.low:g} <="
        high = "< 1" if self.high is None else f"<= {self.high:g}"
        return f"{low} pass {high}"


@dataclass(frozen=True)
class QuestionRate:
    index: int
    id: str
    passes: int
    samples: int

    @property
    def rate(self) -> float:
        return self.passes / self.samples


@dataclass
class Selection:
    """Every question's rate (file order) and the kept problems (stratified order)."""

    rates: list[QuestionRate]
    kept: list[tuple[Problem, QuestionRate]]
    pass_range: PassRange
    out: Path

    def counts(self) -> dict:
        histogram = Counter(r.passes for r in self.rates)
        return {
            "questions": len(self.rates),
            "kept": len(self.kept),
            "passes_histogram": {str(p): histogram[p] for p in sorted(histogram)},
            "cells": len({stratum(problem) for problem, _ in self.kept}),
        }

    def describe(self) -> str:
        counts = self.counts()
        samples = self.rates[0].samples if self.rates else 0
        histogram = ", ".join(f"{p}/{samples}: {n}" for p, n in counts["passes_histogram"].items())
        return (
            f"kept {counts['kept']} of {counts['questions']} questions with "
            f"{self.pass_range} ({counts['cells']} subject x level cells) -> {self.out}\n"
            f"passes per question: {histogram}"
        )


def select_data(
    policy,
    engine: RolloutEngine,
    problems: Sequence[Problem],
    settings: SelectionSettings,
    pass_range: PassRange,
    out: Path,
    *,
    limit: int | None = None,
    batch_questions: int = 16,
    progress: bool = True,
    data_path: Path | None = None,
) -> Selection:
    """Measure (or resume measuring) every question's pass rate, then write the questions in
    ``pass_range``, stratified, at most ``limit`` of them, to ``out`` (.json or .jsonl);
    ``data_path``, the file ``problems`` came from, is never overwritten."""
    if out.suffix not in (".json", ".jsonl"):
        raise ValueError(f"--out must end in .json or .jsonl, got {out}")
    if not problems:
        raise ValueError("select-data: no problems in --data")
    check_output(out, data_path)
    # A long question fails here, before the lock file is made: a refusal writes nothing.
    encode_prompts(policy, problems, settings.max_new_tokens)
    try:
        lock = lock_output(out)
    except DirectoryLockedError as err:
        raise ValueError(str(err)) from None
    rates = measure_pass_rates(
        policy,
        engine,
        problems,
        settings,
        rates_path(out),
        batch_questions=batch_questions,
        progress=progress,
        before_write=lock.check,
    )
    kept = stratified(
        [(problems[r.index], r) for r in rates if r.rate in pass_range],
        key=lambda item: stratum(item[0]),
    )[:limit]
    rows = [
        dict(
            dataclasses.asdict(problem),
            pass_rate=rate.rate,
            passes=rate.passes,
            samples=rate.samples,
        )
        for problem, rate in kept
    ]
    lock.check()  # LockLostError once the lock file was removed: another may write OUT
    if out.suffix == ".json":
        write_text_atomic(out, json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    else:
        write_text_atomic(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return Selection(rates, kept, pass_range, out)


def rates_path(out: Path) -> Path:
    return out.with_name(out.name + ".rates.jsonl")


def check_output(out: Path, data_path: Path | None) -> None:
    """Refuse an ``out`` that select-data may not replace: the data it reads, or an existing
    entry that is not a selection of its own (no rates file of ours beside it)."""
    if data_path is not None and os.path.lexists(out) and os.path.samefile(out, data_path):
        raise ValueError(f"{out}: --out is the --data file; choose another --out")
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_file():
        raise ValueError(f"{out}: exists and is not a regular file; choose another --out")
    if not is_rates_file(rates_path(out)):
        raise ValueError(
            f"{out}: exists and select-data did not write it (no {rates_path(out).name} "
            "beside it); choose a new --out"
        )


def is_rates_file(path: Path) -> bool:
    """``path`` starts with a rates file's header line."""
    try:
        with open_regular(path, MAX_RATES_BYTES, "rates file") as file:
            header = json.loads(file.readline(MAX_HEADER_BYTES))
    except (UnreadableFileError, ValueError, RecursionError):
        return False
    return isinstance(header, dict) and {"settings", "questions"} <= set(header)


def problems_sha256(problems: Sequence[Problem]) -> str:
    """What a pass rate is of: each question's id, text and answer, in order."""
    rows = [[p.id, p.question, p.answer] for p in problems]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()


def measure_pass_rates(
    policy,
    engine: RolloutEngine,
    problems: Sequence[Problem],
    settings: SelectionSettings,
    path: Path,
    *,
    batch_questions: int,
    progress: bool,
    before_write=lambda: None,
) -> list[QuestionRate]:
    """Every question's rate: those ``path`` already holds, then the rest, ``batch_questions``
    questions per engine batch, each batch appended to ``path`` as it finishes (after
    ``before_write()``, which raises when the output's lock was lost)."""
    header = {
        "settings": dataclasses.asdict(settings),
        "questions": len(problems),
        "problems_sha256": problems_sha256(problems),
    }
    rates = read_rates(path, header)
    params = SamplingParams(settings.max_new_tokens, settings.temperature, settings.top_p)
    tokenizer = policy.tokenizer
    todo = list(range(len(rates), len(problems)))
    with (
        open(path, "a", encoding="utf-8") as file,
        tqdm(
            total=len(problems),
            initial=len(rates),
            desc="select-data",
            unit="question",
            disable=not progress,
        ) as bar,
    ):
        if not rates:
            before_write()
            append_lines(file, [header])
        for start in range(0, len(todo), batch_questions):
            batch = [problems[i] for i in todo[start : start + batch_questions]]
            indices = todo[start : start + batch_questions]
            prompts = [tokenizer.encode(render_prompt(p.question)) for p in batch]
            out = sample_groups(
                engine,
                prompts,
                settings.k,
                params,
                bases=[derive_seed(settings.seed, i) for i in indices],
            )
            answers = [
                final_answer(text, min_chars=settings.gate_min_chars)
                for text in tokenizer.decode_batch(out.tokens)
            ]
            correct = grade_many(answers, [p.answer for p in batch for _ in range(settings.k)])
            measured = [
                QuestionRate(
                    i, p.id, sum(correct[q * settings.k : (q + 1) * settings.k]), settings.k
                )
                for q, (i, p) in enumerate(zip(indices, batch))
            ]
            before_write()
            append_lines(file, [dataclasses.asdict(r) for r in measured])
            rates += measured
            bar.update(len(batch))
    return rates


def read_rates(path: Path, header: dict) -> list[QuestionRate]:
    """The rates ``path`` holds (a line cut short by a kill is dropped), or [] when it does not
    exist; ``ValueError`` when it was made with other settings or data."""
    if not os.path.lexists(path):
        return []
    try:
        text = read_text(path, MAX_RATES_BYTES, "rates file")
    except UnreadableFileError as err:
        raise ValueError(f"{path}: not a select-data rates file ({err})") from None
    lines = [line for line in text.splitlines(keepends=True) if line.endswith("\n")]
    if not lines:
        if text:
            raise ValueError(f"{path}: not a select-data rates file (no header line)")
        return []
    try:
        recorded = json.loads(lines[0])
        rates = [QuestionRate(**json.loads(line)) for line in lines[1:]]
    except (ValueError, TypeError, RecursionError) as err:
        raise ValueError(f"{path}: not a select-data rates file ({err})") from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path}: not a select-data rates file (its header is not an object)")
    if recorded != header:
        differing = sorted(
            k for k in set(recorded) | set(header) if recorded.get(k) != header.get(k)
        )
        raise ValueError(
            f"{path} was measured with other {', '.join(differing)} (delete it, "
            f"or use another --out)"
        )
    if [r.index for r in rates] != list(range(len(rates))):
        raise ValueError(f"{path}: rates out of order")
    if text and not text.endswith("\n"):  # a line cut short by a kill (the file is ours)
        write_text_atomic(path, "".join(lines))
    return rates


def append_lines(file, rows: list[dict]) -> None:
    file.write("".join(json.dumps(row) + "\n" for row in rows))
    file.flush()
    os.fsync(file.fileno())


def stratum(problem: Problem) -> tuple:
    """A problem's (subject, level) cell; a missing subject or level sorts last."""
    return (
        problem.subject is None,
        problem.subject or "",
        problem.level is None,
        problem.level or 0,
    )


def stratified(items: list, key) -> list:
    """``items`` round-robin over their cells (``key``): the first of every cell in sorted cell
    order, then the second of every cell that has one, and so on."""
    cells: dict = {}
    for item in items:
        cells.setdefault(key(item), []).append(item)
    ordered = [cells[cell] for cell in sorted(cells)]
    depth = max((len(cell) for cell in ordered), default=0)
    return [cell[row] for row in range(depth) for cell in ordered if row < len(cell)]
