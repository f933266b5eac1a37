"""``benchmarks/gpu/check.sh`` fits one device lease, read from the script itself: every stage has a
cap, the caps and the reserve sum to at most the budget (so no stage is ever cut short by an
earlier one's overrun of its share), the budget is at most 420 s and twice the budget plus a
machine's start fits a 15-minute lease (a full run and a rerun), the end-to-end arms run 10-20
steps within their stage's cap. ``--first`` (what a first lease runs first) has its own stages
and caps, as ``check.sh --first --list`` prints them: they and the reserve fit 240 s, install
included, so that a machine's start, the first run and a rerun fit a 15-minute lease; without nsys the full suite's profile stage gives its cap to end to end."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

CHECK_SH = Path(__file__).parents[2] / "benchmarks" / "gpu" / "check.sh"
LEASE_SECONDS = 15 * 60
# A machine's start, counted in the lease: "a minute or more" (the device notes).
MACHINE_START_SECONDS = 90
MOST_BUDGET_SECONDS = 420


def script() -> str:
    return CHECK_SH.read_text()


def integer(name: str) -> int:
    match = re.search(rf"^{name}=(\d+)\b", script(), re.M)
    assert match, f"check.sh sets no {name}"
    return int(match.group(1))


def bash_list(name: str) -> list[str]:
    match = re.search(rf"^{name}=\(([^)]*)\)", script(), re.M)
    assert match, f"check.sh sets no {name}=(...)"
    return match.group(1).split()


def stage_caps() -> dict[str, int]:
    match = re.search(r"^declare -A CAP_SECONDS=\(([^)]*)\)", script(), re.M)
    assert match, "check.sh declares no CAP_SECONDS"
    return {name: int(value) for name, value in re.findall(r"\[(\w+)\]=(\d+)", match.group(1))}


def test_every_stage_has_a_cap_and_the_caps_fit_the_budget():
    caps = stage_caps()
    assert set(caps) == set(bash_list("STAGES"))
    assert sum(caps.values()) + integer("RESERVE_SECONDS") <= integer("BUDGET_SECONDS"), caps
    assert all(cap >= integer("MIN_STAGE_SECONDS") for cap in caps.values()), caps


def test_the_budget_fits_a_lease_with_a_rerun():
    budget = integer("BUDGET_SECONDS")
    assert budget <= MOST_BUDGET_SECONDS
    assert MACHINE_START_SECONDS + 2 * budget <= LEASE_SECONDS


def test_end_to_end_arms_run_10_to_20_steps_within_their_stage():
    assert 10 <= integer("E2E_STEPS") <= 20
    arms = [int(seconds) for seconds in bash_list("E2E_ARM_SECONDS")]
    assert len(arms) == 2 and sum(arms) <= stage_caps()["e2e"], arms
    assert re.search(r"STEPS=\$E2E_STEPS\b", script()), "the GPU run takes E2E_STEPS"


def test_only_a_dry_run_gets_slack():
    assert re.search(r"^\s+DEVICE=cuda .*\bSLACK=1\b", script(), re.M)
    assert re.search(r"^\s+DEVICE=cpu .*\bSLACK=\$DRY_RUN_SLACK\b", script(), re.M)


def listed(*options: str) -> tuple[dict[str, int], int, int]:
    """``check.sh OPTIONS --list``: ({stage: cap}, budget, reserve)."""
    out = subprocess.run(
        ["bash", str(CHECK_SH), *options, "--list"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    caps = {line.split()[1]: int(line.split()[2]) for line in out[:-1]}
    budget, reserve = map(int, re.findall(r"(\d+) s", out[-1]))
    return caps, budget, reserve


def test_the_first_contact_run_fits_240_seconds_and_leaves_a_lease_room():
    caps, budget, reserve = listed("--first")
    assert list(caps) == ["env", "tests", "graphs", "e2e", "decode_step"]
    assert budget == integer("FIRST_BUDGET_SECONDS") <= 240
    assert sum(caps.values()) + reserve <= budget, caps
    assert all(cap >= integer("MIN_STAGE_SECONDS") for cap in caps.values()), caps
    assert caps["env"] >= 60, "the install and the C++ build (48 s of CPU) fit stage 0"
    arms = [int(seconds) for seconds in bash_list("FIRST_E2E_ARM_SECONDS")]
    assert len(arms) == 2 and sum(arms) <= caps["e2e"]
    assert MACHINE_START_SECONDS + 2 * budget <= LEASE_SECONDS, "a first run and a rerun"


def test_without_nsys_the_profile_stage_gives_its_time_to_end_to_end():
    """The listing under a PATH with no nsys (the GPU machine has none): no profile stage, and
    end to end gets its cap on top of its own."""
    caps, budget, _ = listed()
    if "profile" in caps:
        pytest.skip("this machine has nsys")
    declared = stage_caps()
    assert caps["e2e"] == declared["e2e"] + declared["profile"]
    assert sum(caps.values()) == sum(declared.values()) and budget == integer("BUDGET_SECONDS")
