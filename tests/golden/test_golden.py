"""Golden outputs of every arm preset: 3 steps on the embedded model, trees from the first step.

What a run writes (final weights, rollouts, ledger and evaluations without timings, the summary
without its seconds) is hashed per arm. ``hashes.json`` keys the recorded hashes by the
fingerprint of the machine's arithmetic (``tests/arithmetic.py``: one thread, the same ops a
training step runs), not by the machine's name: two CPUs of one name can round differently.

- On a machine whose fingerprint has hashes, every arm's outputs are compared bit for bit. A
  change of code that should leave behaviour identical (a restructuring) keeps every hash.
- On any other machine, each arm runs twice and writes identical bytes both times (the run is
  deterministic there), ``rlvr-fast verify`` passes on it, and its figures match the figures
  recorded beside the hashes: counts, rewards, rollouts and the evaluation before training
  exactly, floating-point figures within a tolerance (``golden_runs.compare_figures``).

The path taken is printed once at the end of the session (``golden outputs: ...``).

A change that alters the arithmetic on purpose re-records, in a commit of its own that names
the cause:

    python tests/golden/test_golden.py --record

adds this machine's hashes beside the other machines' while this machine's figures match the
recorded ones under the tolerance; when they do not (the code changed what a run computes), the
other machines' hashes are stale and dropped, and this machine's figures replace the recorded.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)]

from arithmetic import arithmetic_fingerprint
from golden_runs import arm_names, compare_figures, run_digests, run_figures, train_arm

HASHES = Path(__file__).with_name("hashes.json")
FORMAT = 2
# The user property each test leaves for the session's closing line (tests/golden/conftest.py).
PATH_PROPERTY = "golden_path"


def load_golden() -> dict:
    """``{"format": 2, "arithmetic": {fingerprint: {"machine": ..., "arms": {arm: hashes}}},
    "figures": {arm: figures}}``; an empty record when there is none."""
    if not HASHES.exists():
        return {"format": FORMAT, "arithmetic": {}, "figures": {}}
    golden = json.loads(HASHES.read_text())
    if golden.get("format") != FORMAT:
        raise ValueError(f"{HASHES}: format {golden.get('format')!r}, expected {FORMAT}")
    return golden


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("arm", arm_names())
def test_every_arm_writes_its_golden_outputs(arm, tmp_path, one_thread, record_property):
    golden = load_golden()
    fingerprint = arithmetic_fingerprint()
    out = tmp_path / arm
    digests = run_digests(out, train_arm(arm, out))
    recorded = golden["arithmetic"].get(fingerprint)
    if recorded is not None:
        record_property(PATH_PROPERTY, f"arithmetic {fingerprint} has hashes: bit for bit")
        assert digests == recorded["arms"][arm]
        return
    if arm not in golden["figures"]:
        pytest.fail(f"{HASHES}: no figures recorded for {arm} (python {__file__} --record)")
    again = tmp_path / f"{arm}-again"
    assert run_digests(again, train_arm(arm, again)) == digests, "a second run wrote other bytes"
    from rlvr_fast.analysis.verify import verify_run

    verification = verify_run(out)
    assert verification.ok, "\n".join(verification.lines())
    problems, diverged = compare_figures(run_figures(out), golden["figures"][arm])
    assert not problems, "\n".join(problems[:20])
    record_property(
        PATH_PROPERTY,
        f"arithmetic {fingerprint} has no hashes (recorded: {', '.join(golden['arithmetic'])}): "
        "each arm deterministic, verified, figures within tolerance of the recorded ones",
    )
    if diverged is not None:
        record_property(f"{PATH_PROPERTY}_diverged", f"{arm} from step {diverged}")


def cpu_name() -> str:
    """The CPU's model name where Linux tells it (a note for readers; nothing is keyed by it)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor()


def record() -> None:
    torch.set_num_threads(1)
    golden = load_golden()
    fingerprint = arithmetic_fingerprint()
    hashes, figures = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arm_names():
            out = Path(tmp) / arm
            hashes[arm] = run_digests(out, train_arm(arm, out))
            figures[arm] = run_figures(out)
            print(f"{arm}: {hashes[arm]['final'][:12]}", flush=True)
    changed = [
        arm
        for arm in arm_names()
        if arm not in golden["figures"] or compare_figures(figures[arm], golden["figures"][arm])[0]
    ]
    if changed:
        print(f"figures changed ({', '.join(changed)}): the other machines' hashes are dropped")
        golden = {"format": FORMAT, "arithmetic": {}, "figures": figures}
    golden["arithmetic"][fingerprint] = {
        "machine": f"{platform.machine()} {cpu_name()}",
        "torch": torch.__version__,
        "arms": hashes,
    }
    HASHES.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"recorded arithmetic {fingerprint} in {HASHES}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/golden/test_golden.py --record")
    record()
