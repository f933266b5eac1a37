"""Where a run came from: package versions and the git commit, recorded in config.json."""

from __future__ import annotations

import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from rlvr_fast.run.directory import RESUME_MAY_CHANGE

# config.json's "rewards" on a run whose task is not the study's grading (reward functions of
# rlvr_fast.trl_compat, a custom task): verify takes the ledger's rewards as given and re-derives
# everything that follows from them.
REWARDS_KEY = "rewards"
REWARDS_RECORDED = "recorded (the task's own reward functions; not re-graded)"
PACKAGES = ("rlvr_fast", "torch", "triton", "transformers", "tokenizers", "safetensors")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return versions


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_meta(
    signature: dict,
    config: dict,
    recorded: dict | None,
    *,
    model: str,
    trainable_parameters: int,
    precision: str,
    world_size: int,
    at_step: int,
    rewards_recorded: bool = False,
) -> dict:
    """config.json: the run's signature, settings and provenance; a resume that changes a
    setting it may change (an extension) keeps the first start's provenance and lists the
    change made at step ``at_step``."""
    if recorded is None:
        meta = {
            "rlvr_fast_run": signature,
            "config": config,
            "model": model,
            "trainable_parameters": trainable_parameters,
            "precision": precision,
            "versions": package_versions(),
            "git_commit": git_commit(),
            "changes": [],
        }
        if world_size > 1:
            meta["world_size"] = world_size
        if rewards_recorded:
            meta[REWARDS_KEY] = REWARDS_RECORDED
        return meta
    change = {
        name: [recorded["config"].get(name), config.get(name)]
        for name in RESUME_MAY_CHANGE
        if recorded["config"].get(name) != config.get(name)
    }
    resumed = {**recorded, "rlvr_fast_run": signature, "config": config, "precision": precision}
    # A sharded run's checkpoint resumes on another number of ranks.
    if recorded.get("world_size", 1) != world_size:
        change["world_size"] = [recorded.get("world_size", 1), world_size]
    resumed.pop("world_size", None)
    if world_size > 1:
        resumed["world_size"] = world_size
    resumed["changes"] = [*recorded.get("changes", []), {"at_step": at_step, **change}]
    return resumed
