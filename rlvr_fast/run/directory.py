"""Starting and resuming a run directory: what makes a directory a run, and what a resume checks.

A run directory's ``config.json`` carries the run's signature under ``"rlvr_fast_run"``: the
arm, the seed, the step count, a hash of every other training setting, hashes of the model's
starting weights and tokenizer, of the training problems and of each evaluation set, and the
dtype and device type. The trainer

* starts a run in a directory that does not exist or holds nothing (temp files of a writer
  killed before ``config.json`` count as nothing), and refuses any other directory without a
  signature: it may be a model or anyone's files;
* refuses a run directory unless asked to resume it, and resumes only when the signature
  matches: the same arm, seed, settings, model, data and dtype. ``steps`` may grow (the run is
  extended and config.json records it) but not shrink; ``allow_nonfinite`` may change;
* takes the directory's lock (``rlvr_fast.utils.locks.lock_directory``) before it writes anything
  there, and holds it for the rest of the process: a second writer (a ``--resume`` started while
  the run still runs, two ``train``s on one ``--out``) is refused with the holder's pid, and the
  lock of a killed run is taken over, so a kill stays resumable. The writer checks the lock
  before each write (``RunRecorder``) and stops, writing nothing more, once its lock file was
  removed or replaced; the lock file is removed when the process exits normally;
* then removes what killed writers left (``rlvr_fast.utils.files``): only in a directory that carries
  the signature (config.json's, or the lock file a start wrote before config.json), and only the
  names our writers use. A directory that holds anything else and no signature is refused, not
  cleaned.

A run killed before its first checkpoint resumes from step 0: nothing it wrote is kept except
what will be written again the same way. A finished run (summary.json) resumed with the same
settings is left as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Sequence

import torch

from rlvr_fast.data.problems import Problem
from rlvr_fast.run.layout import HF_CHECKPOINT_PREFIX, RunLayout
from rlvr_fast.utils.files import (
    OLD_SUFFIX,
    UnreadableFileError,
    file_kind,
    is_temp_name,
    read_json,
    read_text,
    remove_stale_files,
    write_text_atomic,
)
from rlvr_fast.utils.locks import LOCK_NAME, DirectoryLock, DirectoryLockedError, lock_directory

RUN_KEY = "rlvr_fast_run"
RUN_FORMAT = 1
# Settings a resume may change: neither alters what the steps already taken computed.
# shard: a sharded run resumes unsharded and back (its checkpoint holds whole tensors).
RESUME_MAY_CHANGE = ("steps", "allow_nonfinite", "shard")
EVAL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Size caps of a run's files, checked before reading: config.json is a few KB; a step log line
# is at most a few MB (a group's texts), and a 1 GiB log is thousands of steps past the study.
MAX_CONFIG_BYTES = 16 << 20
MAX_STEP_LOG_BYTES = 1 << 30
# The directories a run swaps in whole (``rlvr_fast.utils.files.replaced_directory``).
SWAPPED_DIRECTORIES = tuple(RunLayout(Path()).model(polyak).name for polyak in (False, True))


class RunDirectoryError(ValueError):
    """A directory cannot be started or resumed as the run asked for; one line says why."""


def check_eval_name(name: str) -> str:
    """Evaluation sets are written to evals/NAME.jsonl: a name is a plain file name."""
    if not EVAL_NAME.fullmatch(name):
        raise ValueError(
            f"eval set name {name!r}: use 1-64 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit"
        )
    return name


def sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def problems_sha256(problems: Sequence[Problem]) -> str:
    return sha256_json([[p.id, p.question, p.answer] for p in problems])


def policy_sha256(policy) -> str:
    """The starting weights (names, dtypes, bytes; which are trained: a tied LM head is one
    parameter, an untied one two) and the tokenizer (its JSON, eos and pad)."""
    digest = hashlib.sha256()
    digest.update(
        json.dumps(
            [name for name, p in policy.model.named_parameters() if p.requires_grad]
        ).encode()
    )
    for name, tensor in policy.model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    tokenizer = policy.tokenizer
    digest.update(tokenizer.backend.to_str().encode())
    digest.update(json.dumps([tokenizer.eos_token_ids, tokenizer.pad_token_id]).encode())
    return digest.hexdigest()


def settings_sha256(config: dict) -> str:
    return sha256_json({k: v for k, v in config.items() if k not in RESUME_MAY_CHANGE})


def run_signature(
    config: dict, policy, train_data: Sequence[Problem], eval_data: dict[str, Sequence[Problem]]
) -> dict:
    """What a resume must find unchanged (``config`` is ``TrainConfig.to_json()``)."""
    return {
        "format": RUN_FORMAT,
        "arm": config["arm"],
        "seed": config["seed"],
        "steps": config["steps"],
        "settings_sha256": settings_sha256(config),
        "model_sha256": policy_sha256(policy),
        "train_data": {"problems": len(train_data), "sha256": problems_sha256(train_data)},
        "eval_data": {name: problems_sha256(p) for name, p in sorted(eval_data.items())},
        "dtype": str(policy.dtype).removeprefix("torch."),
        "device": policy.device.type,
    }


def read_run_meta(out_dir: Path) -> dict | None:
    """config.json when it carries a run signature, else None."""
    try:
        meta = read_json(RunLayout(out_dir).config, MAX_CONFIG_BYTES, "run config")
    except (OSError, ValueError):
        return None
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get(RUN_KEY), dict)
        or not isinstance(meta.get("config"), dict)
    ):
        return None
    return meta


def holds_only_leftovers(out_dir: Path) -> bool:
    """Nothing, or what a start of ours killed before config.json leaves: its lock file and
    temp files of our writers (the lock file is the signature that makes them ours)."""
    names = [entry.name for entry in out_dir.iterdir()]
    return not names or (
        LOCK_NAME in names and all(n == LOCK_NAME or is_temp_name(n) for n in names)
    )


def open_run_directory(
    out_dir: Path, signature: dict, config: dict, train_data: Sequence[Problem], resume: bool
) -> tuple[dict | None, DirectoryLock]:
    """Check that the run may start (or resume) in ``out_dir``, take its lock and clean up
    after killed writers; returns the recorded config.json when resuming a run (None when
    starting one) and the lock, which the writer checks before each write. Nothing is written
    when a check fails; the checks run again once the lock is held, since another writer may
    have started in between."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirectoryError(f"{out_dir}: exists and is not a directory")
    if not out_dir.exists():
        if resume:
            raise RunDirectoryError(f"{out_dir}: no such run directory to resume")
        make_directory(out_dir)
    elif not os.access(out_dir, os.W_OK | os.X_OK):
        raise RunDirectoryError(f"{out_dir}: not writable")
    else:
        check_may_open(out_dir, signature, config, train_data, resume)
    try:
        lock = lock_directory(out_dir, remove=True)
    except DirectoryLockedError as err:
        raise RunDirectoryError(str(err)) from None
    meta = check_may_open(out_dir, signature, config, train_data, resume)
    remove_stale_files(lock, swapped_directories(out_dir))
    return meta, lock


def swapped_directories(out_dir: Path) -> tuple[str, ...]:
    """The directories of ``out_dir`` that a run swaps in whole: final/, final_polyak/ and the
    checkpoint-N/ of --save-every (those whose swap a kill may have cut: a .checkpoint-N.old)."""
    checkpoints = [
        entry.name[1 : -len(OLD_SUFFIX)]
        for entry in out_dir.iterdir()
        if entry.name.startswith(f".{HF_CHECKPOINT_PREFIX}") and entry.name.endswith(OLD_SUFFIX)
    ]
    return SWAPPED_DIRECTORIES + tuple(checkpoints)


def check_may_open(
    out_dir: Path, signature: dict, config: dict, train_data: Sequence[Problem], resume: bool
) -> dict | None:
    meta = read_run_meta(out_dir)
    if meta is None:
        if not holds_only_leftovers(out_dir):
            raise RunDirectoryError(
                f"{out_dir}: not empty and not an rlvr_fast run directory (no config.json with "
                f"a {RUN_KEY!r} signature); choose a new or empty --out"
            )
        return None
    if not resume:
        raise RunDirectoryError(
            f"{out_dir}: already holds a run (use --resume to continue it, or a new --out)"
        )
    check_signature(out_dir, meta, signature, config, train_data)
    check_run_files(out_dir)
    return meta


def run_files(out_dir: Path) -> tuple[Path, ...]:
    """The files a resume reads before it writes; each must be a plain regular file, or a FIFO
    would hang the resume and a link to /dev/zero fill the memory."""
    layout = RunLayout(out_dir)
    return (layout.config, layout.summary, layout.ledger, layout.rollouts, layout.checkpoint)


def check_run_files(out_dir: Path) -> None:
    for path in run_files(out_dir):
        if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
            raise RunDirectoryError(f"{path}: not a regular file ({describe_entry(path)})")


def describe_entry(path: Path) -> str:
    if path.is_symlink():
        return f"a symlink to {os.readlink(path)}"
    return file_kind(path.stat().st_mode)


def make_directory(out_dir: Path) -> None:
    # exist_ok: a racing start that made it first is met by the lock and the checks after it.
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirectoryError(
            f"{out_dir}: cannot create the run directory ({err.strerror})"
        ) from None


def check_signature(
    out_dir: Path, meta: dict, signature: dict, config: dict, train_data: Sequence[Problem]
) -> None:
    """Refuse a resume that would train another run than the one recorded, naming what
    differs."""
    recorded, where = meta[RUN_KEY], RunLayout(out_dir).config
    if recorded.get("format") != RUN_FORMAT:
        raise RunDirectoryError(
            f"{where}: run format {recorded.get('format')!r}, this version "
            f"of rlvr_fast resumes format {RUN_FORMAT}"
        )
    for key in ("arm", "seed"):
        if recorded.get(key) != signature[key]:
            raise RunDirectoryError(
                f"{out_dir}: the run has {key} {recorded.get(key)!r}, "
                f"this command asks for {signature[key]!r}"
            )
    if recorded.get("settings_sha256") != signature["settings_sha256"]:
        raise RunDirectoryError(
            f"{out_dir}: the run was trained with other settings "
            f"({differing_setting(meta['config'], config)})"
        )
    if not isinstance(recorded.get("steps"), int) or signature["steps"] < recorded["steps"]:
        raise RunDirectoryError(
            f"{out_dir}: the run has {recorded.get('steps')!r} steps; a "
            f"resume may extend it, not shorten it to {signature['steps']}"
        )
    if recorded.get("model_sha256") != signature["model_sha256"]:
        raise RunDirectoryError(
            f"{out_dir}: the model (weights or tokenizer) differs from the "
            f"one the run started from ({meta.get('model')})"
        )
    if not same_training_problems(recorded, train_data):
        raise RunDirectoryError(f"{out_dir}: the training problems differ from the run's")
    if recorded.get("eval_data") != signature["eval_data"]:
        raise RunDirectoryError(
            f"{out_dir}: the evaluation sets differ from the run's "
            f"({', '.join(recorded.get('eval_data') or {}) or 'none'})"
        )
    for key in ("dtype", "device"):
        if recorded.get(key) != signature[key]:
            raise RunDirectoryError(
                f"{out_dir}: the run trained with {key} "
                f"{recorded.get(key)!r}, this command has {signature[key]!r}"
            )


def differing_setting(recorded: dict, config: dict) -> str:
    """The first setting whose recorded value differs, for the error message (config.json's
    settings may also have been edited by hand: then the hash alone tells)."""
    for name in sorted(set(recorded) | set(config)):
        if name not in RESUME_MAY_CHANGE and recorded.get(name) != config.get(name):
            return f"{name}: {recorded.get(name)!r} then, {config.get(name)!r} now"
    return "config.json's settings do not match its signature"


def same_training_problems(recorded: dict, train_data: Sequence[Problem]) -> bool:
    """The steps run so far see the same problems: the recorded ones are a prefix of the new
    ones (an extended run loads more), and a run that cycled through its problems (fewer than
    its steps) has exactly them, since step s trains on problem s mod count."""
    train = recorded.get("train_data")
    if not starts_with_problems(train_data, train):
        return False
    return len(train_data) == train["problems"] or recorded["steps"] <= train["problems"]


def starts_with_problems(train_data: Sequence[Problem], train) -> bool:
    """Whether ``train_data`` begins with the problems a signature's ``train_data`` entry
    ({"problems": count, "sha256": hash}) records."""
    if not isinstance(train, dict) or not isinstance(train.get("problems"), int):
        return False
    count = train["problems"]
    return len(train_data) >= count and problems_sha256(train_data[:count]) == train.get("sha256")


def whole_lines(path: Path, count: int) -> None:
    """Keep the first ``count`` lines of a step log (ledger.jsonl, rollouts.jsonl) for a
    resume at step ``count``: each must be a whole JSON line of its step. Later lines, and a
    partial last line, came after the checkpoint and are dropped (the steps run again)."""
    if not path.exists():
        if count:
            raise RunDirectoryError(f"{path}: missing, but the checkpoint is at step {count}")
        return
    try:
        text = read_text(path, MAX_STEP_LOG_BYTES, "step log")
    except UnreadableFileError as err:
        raise RunDirectoryError(str(err)) from None
    lines = text.split("\n")[:-1]
    if len(lines) < count:
        raise RunDirectoryError(
            f"{path}: {len(lines)} whole lines, but the checkpoint is at step {count}"
        )
    for number, line in enumerate(lines[:count]):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError, RecursionError):
            step = None
        if step != number:
            raise RunDirectoryError(f"{path}:{number + 1}: not the JSON line of step {number}")
    if len(lines) > count or (text and not text.endswith("\n")):
        write_text_atomic(path, "".join(line + "\n" for line in lines[:count]))
