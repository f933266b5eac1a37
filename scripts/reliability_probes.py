"""Hostile-user probes of issue 28, run against a source tree and classified.

    python scripts/reliability_probes.py --tree . --out probes.json [--only NAME,...]

Each probe sets up a scratch directory, runs real commands (`python -m rlvr_fast.cli ...`, or a
short `python -c` for API cases) with the tree on PYTHONPATH, and sorts the outcome into one of:
clean (the right result, or one error line with the right exit code and nothing of anyone's
lost), traceback, hang (still running at its time limit), data lost (a file of someone else's
deleted, replaced or moved, or two writers' output mixed), security (a file from outside a model
directory copied into a run), other (bad input accepted silently, an error naming no file or our
temp file, output half-written before an error). Memory-hungry probes run under an address-space
limit so that a regression fails instead of taking the machine. The table groups probes by
family; the JSON keeps each probe's outcome and evidence.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLEAN, TRACEBACK, HANG, LOST, SECURITY, OTHER = (
    "clean",
    "traceback",
    "hang",
    "data lost",
    "security",
    "other",
)
CATEGORIES = (CLEAN, TRACEBACK, HANG, LOST, SECURITY, OTHER)
TRAIN = ["train", "--arm", "zg_flat", "--quiet", "--train-data", "synthetic:train:2"]
SHORT = ["--set", "max_new_tokens=8", "--set", "eval_max_new_tokens=8"]
PROBES: list[tuple[str, str, object]] = []


def probe(family: str):
    def register(function):
        PROBES.append((family, function.__name__, function))
        return function

    return register


class Env:
    def __init__(self, tree: Path, scratch: Path) -> None:
        self.tree, self.scratch = tree, scratch
        self.environ = {
            **os.environ,
            "PYTHONPATH": str(tree),
            "OMP_NUM_THREADS": "1",
            "TRITON_INTERPRET": "1",
        }
        self.tiny = tree / "rlvr_fast" / "assets" / "tiny"

    def run(self, args, *, timeout=180, memory_gb=None, code=None, wait=True, file_bytes=None):
        command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "rlvr_fast.cli"]
        command += [str(a) for a in args]
        if memory_gb:
            limit = int(memory_gb * 2**30)
            command = ["prlimit", f"--as={limit}", "--", *command]
        if file_bytes:  # a disk that fills: writes past it fail with EFBIG (Python ignores SIGXFSZ)
            command = ["prlimit", f"--fsize={file_bytes}", "--", *command]
        process = subprocess.Popen(
            command,
            cwd=self.scratch,
            env=self.environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if not wait:
            return process
        try:
            out, err = process.communicate(timeout=timeout)
            return process.returncode, out, err, False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            return None, out, err, True

    def model_copy(self, name="model") -> Path:
        target = self.scratch / name
        shutil.copytree(self.tiny, target)
        return target

    def finished_run(self, name="run", *extra) -> Path:
        out = self.scratch / name
        rc, _, err, _ = self.run(
            [*TRAIN, "--steps", "1", *SHORT, "--eval", "t=synthetic:test:2", "--out", out, *extra]
        )
        assert rc == 0, err
        return out


def error_outcome(result, *, expect_rc=2, must_name: str | None = None) -> tuple[str, str]:
    """A probe whose right answer is one error line with ``expect_rc``."""
    rc, out, err, hung = result
    if hung:
        return HANG, "still running at the time limit"
    if "Traceback" in err or "Traceback" in out:
        return TRACEBACK, last_line(err)
    if rc == expect_rc and err.strip().count("\n") == 0 and err.strip():
        if must_name is not None and must_name not in err:
            return OTHER, f"one line naming no {must_name!r}: {err.strip()}"
        return CLEAN, err.strip()
    if rc == expect_rc and expect_rc == 1:
        return CLEAN, last_line(out)
    return OTHER, f"exit {rc}: {last_line(err) or last_line(out)}"


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def api(env: Env, code: str, *, memory_gb=None, timeout=180):
    return env.run([], code=code, memory_gb=memory_gb, timeout=timeout)


def api_outcome(result) -> tuple[str, str]:
    """An API probe prints CLEAN or OTHER and a note on its last line."""
    rc, out, err, hung = result
    if hung:
        return HANG, "still running at the time limit"
    if "Traceback" in err:
        return TRACEBACK, last_line(err)
    verdict, _, note = last_line(out).partition(" ")
    return (verdict.lower() if verdict.lower() in CATEGORIES else OTHER), note


# ------------------------------------------------------------------ run directories
def ledger_steps(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().split("\n")[:-1]]


@probe("run directory")
def resume_while_the_run_runs(env: Env):
    out = env.scratch / "run"
    args = [*TRAIN, "--steps", "100000", *SHORT, "--set", "checkpoint_every=1", "--out", out]
    first = env.run(args, wait=False)
    deadline = time.monotonic() + 240
    while not ledger_steps(out / "ledger.jsonl") and time.monotonic() < deadline:
        time.sleep(0.5)
    second = env.run([*args, "--resume"], timeout=40)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    steps = ledger_steps(out / "ledger.jsonl")
    if steps != list(range(len(steps))):
        return LOST, f"ledger steps {steps[:12]}... ({len(steps)} lines)"
    return error_outcome(second, must_name="in use by process")


@probe("run directory")
def two_fresh_trains_at_once(env: Env):
    both = 0
    for trial in range(3):
        out = env.scratch / f"run{trial}"
        args = [*TRAIN, "--steps", "2", *SHORT, "--out", out]
        a, b = env.run(args, wait=False), env.run(args, wait=False)
        codes = (a.wait(timeout=300), b.wait(timeout=300))
        both += codes == (0, 0)
        a.communicate(), b.communicate()
    return (LOST, f"both ran in {both} of 3 trials") if both else (CLEAN, "one refused each time")


@probe("run directory")
def out_of_foreign_temp_looking_names(env: Env):
    out = env.scratch / "out"
    (out / ".backup.tmp" / "deep").mkdir(parents=True)
    (out / ".backup.tmp" / "deep" / "thesis.tex").write_text("chapter 1")
    (out / ".notes.tmp").write_text("notes")
    (out / ".tmpAB12CD").write_text("mine")
    result = env.run([*TRAIN, "--steps", "1", *SHORT, "--out", out])
    kept = [(out / n).exists() for n in (".backup.tmp/deep/thesis.tex", ".notes.tmp", ".tmpAB12CD")]
    if not all(kept):
        return LOST, f"deleted {kept.count(False)} of 3, exit {result[0]}"
    return error_outcome(result, must_name="not empty")


@probe("run directory")
def foreign_dot_old_and_tmp_in_a_run_resumed(env: Env):
    run = env.finished_run()
    (run / ".thesis.old").mkdir()
    (run / ".thesis.old" / "a.tex").write_text("mine")
    (run / ".tmpQW12ER").write_text("my notes")
    rc, _, err, _ = env.run(
        [*TRAIN, "--steps", "2", *SHORT, "--eval", "t=synthetic:test:2", "--out", run, "--resume"]
    )
    if not (run / ".thesis.old" / "a.tex").exists() or not (run / ".tmpQW12ER").exists():
        return LOST, "a foreign .thesis.old or .tmpQW12ER moved or deleted"
    return (CLEAN, "both kept") if rc == 0 else (OTHER, last_line(err))


@probe("run directory")
def kill_then_resume_takes_the_lock_over(env: Env):
    out = env.scratch / "run"
    args = [*TRAIN, "--steps", "6", *SHORT, "--set", "checkpoint_every=1", "--out", out]
    first = env.run(args, wait=False)
    deadline = time.monotonic() + 240
    while not ledger_steps(out / "ledger.jsonl") and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    rc, _, err, hung = env.run([*args, "--resume"], timeout=300)
    if hung:
        return HANG, "resume hung"
    verified = env.run(["verify", out])
    if rc == 0 and verified[0] == 0:
        return CLEAN, "resumed and verified"
    return OTHER, f"resume exit {rc}: {last_line(err)}; verify exit {verified[0]}"


@probe("run directory")
def resume_with_summary_json_a_fifo(env: Env):
    run = env.finished_run()
    (run / "summary.json").unlink()
    os.mkfifo(run / "summary.json")
    args = [*TRAIN, "--steps", "1", *SHORT, "--eval", "t=synthetic:test:2", "--out", run]
    return error_outcome(env.run([*args, "--resume"], timeout=90), must_name="summary.json")


@probe("run directory")
def resume_with_the_checkpoint_a_fifo(env: Env):
    run = env.finished_run()
    (run / "checkpoint" / "state.safetensors").unlink()
    os.mkfifo(run / "checkpoint" / "state.safetensors")
    args = [*TRAIN, "--steps", "2", *SHORT, "--eval", "t=synthetic:test:2", "--out", run]
    return error_outcome(env.run([*args, "--resume"], timeout=90), must_name="state.safetensors")


@probe("run directory")
def resume_with_the_ledger_linked_to_dev_zero(env: Env):
    run = env.finished_run()
    (run / "ledger.jsonl").unlink()
    os.symlink("/dev/zero", run / "ledger.jsonl")
    args = [*TRAIN, "--steps", "2", *SHORT, "--eval", "t=synthetic:test:2", "--out", run]
    result = env.run([*args, "--resume"], timeout=120, memory_gb=4)
    return error_outcome(result, must_name="ledger.jsonl")


@probe("run directory")
def file_modes_of_a_run(env: Env):
    run = env.finished_run()
    modes = {n: oct((run / n).stat().st_mode & 0o777) for n in ("config.json", "ledger.jsonl")}
    modes["final/model.safetensors"] = oct((run / "final/model.safetensors").stat().st_mode & 0o777)
    return (CLEAN, str(modes)) if len(set(modes.values())) == 1 else (SECURITY, str(modes))


@probe("run directory")
def disk_full_during_a_state_save_names(env: Env):
    code = """
import resource, signal, sys, torch
from rlvr_fast.run.state_file import save_state
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    save_state("checkpoint/state.safetensors", {"w": torch.zeros(1 << 16)})
except OSError as err:
    print("CLEAN" if str(err.filename).endswith("checkpoint/state.safetensors") else "OTHER", err)
except Exception as err:
    print("OTHER", type(err).__name__, str(err)[:200])
"""
    return api_outcome(api(env, code))


@probe("run directory")
def train_with_the_disk_full_at_the_checkpoint(env: Env):
    out = env.scratch / "r"
    args = [*TRAIN, "--steps", "2", *SHORT, "--set", "checkpoint_every=1", "--out", out]
    result = env.run(args, file_bytes=1 << 20, timeout=300)
    outcome = error_outcome(result, must_name="state.safetensors")
    if outcome[0] != CLEAN:
        return outcome
    rc, _, err, _ = env.run([*args, "--resume"], timeout=300)
    return (CLEAN, outcome[1]) if rc == 0 else (OTHER, f"resume after it: exit {rc}: {err}")


# ------------------------------------------------------------------ model directories
@probe("model directory")
def vocab_json_linked_outside(env: Env):
    model = env.model_copy()
    secret = env.scratch / "secret.txt"
    secret.write_text("SECRET")
    for name in ("vocab.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
        os.symlink(secret, model / name)
    out = env.scratch / "run"
    result = env.run([*TRAIN, "--steps", "1", *SHORT, "--model", model, "--out", out])
    copied = [p for p in out.rglob("*") if p.is_file() and p.read_bytes() == b"SECRET"]
    if copied:
        return SECURITY, f"copied into {copied[0].relative_to(out)}"
    return error_outcome(result, must_name="outside")


def model_with(env: Env, name: str, kind: str) -> Path:
    model = env.model_copy()
    (model / name).unlink()
    if kind == "fifo":
        os.mkfifo(model / name)
    else:
        os.symlink(kind, model / name)
    return model


def eval_of(env: Env, model: Path, memory_gb=None, timeout=90):
    args = ["eval", model, "--eval", "t=synthetic:test:1", "--max-new-tokens", "4"]
    return env.run(args, timeout=timeout, memory_gb=memory_gb)


@probe("model directory")
def config_json_a_fifo(env: Env):
    return error_outcome(
        eval_of(env, model_with(env, "config.json", "fifo")), must_name="config.json"
    )


@probe("model directory")
def model_safetensors_a_fifo(env: Env):
    model = model_with(env, "model.safetensors", "fifo")
    return error_outcome(eval_of(env, model), must_name="model.safetensors")


@probe("model directory")
def tokenizer_json_a_fifo(env: Env):
    model = model_with(env, "tokenizer.json", "fifo")
    return error_outcome(eval_of(env, model), must_name="tokenizer.json")


@probe("model directory")
def config_json_linked_to_dev_zero(env: Env):
    model = model_with(env, "config.json", "/dev/zero")
    return error_outcome(eval_of(env, model, memory_gb=4), must_name="config.json")


SPARSE_Q_PROJ = """
import json, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
model = Path(sys.argv[1])
name = "model.layers.0.self_attn.q_proj.weight"
tensors = load_file(model / "model.safetensors")
del tensors[name]
save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
nbytes = 1 << 32
header = json.dumps({name: {"dtype": "F32", "shape": [1 << 23, 128], "data_offsets": [0, nbytes]}})
header += " " * (-len(header) % 8)
with open(model / "model-2.safetensors", "wb") as f:
    f.write(len(header).to_bytes(8, "little") + header.encode())
    f.truncate(8 + len(header) + nbytes)
"""


@probe("model directory")
def sparse_4_gib_q_proj(env: Env):
    model = env.model_copy()
    api(env, SPARSE_Q_PROJ.replace("sys.argv[1]", repr(str(model))))
    return error_outcome(eval_of(env, model, memory_gb=3, timeout=180), must_name="q_proj")


@probe("model directory")
def a_tensor_in_two_shards(env: Env):
    model = env.model_copy()
    code = f"""
from safetensors.torch import load_file, save_file
t = load_file({str(model / "model.safetensors")!r})
name = "model.layers.0.self_attn.q_proj.weight"
save_file({{name: t[name] + 1}}, {str(model / "model-2.safetensors")!r})
"""
    api(env, code)
    result = eval_of(env, model)
    if result[0] == 0:
        return OTHER, "loaded silently (one copy wins)"
    return error_outcome(result, must_name="also in")


@probe("model directory")
def an_integer_weight(env: Env):
    model = env.model_copy()
    code = f"""
from safetensors.torch import load_file, save_file
import torch
p = {str(model / "model.safetensors")!r}
t = load_file(p)
name = "model.layers.0.self_attn.q_proj.weight"
t[name] = t[name].to(torch.int64)
save_file(t, p)
"""
    api(env, code)
    result = eval_of(env, model)
    if result[0] == 0:
        return OTHER, "an I64 weight loaded silently"
    return error_outcome(result, must_name="I64")


@probe("model directory")
def tokenizer_larger_than_the_vocabulary(env: Env):
    model = env.scratch / "small"
    code = f"""
import shutil
from rlvr_fast.models.checkpoint import save_model
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM
config = ModelConfig.from_file({str(env.tiny / "config.json")!r})
config.vocab_size = 40
save_model(Qwen3ForCausalLM(config), {str(model)!r})
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy({str(env.tiny)!r} + "/" + name, {str(model)!r} + "/" + name)
"""
    api(env, code)
    out = env.scratch / "run"
    result = env.run([*TRAIN, "--steps", "1", *SHORT, "--model", model, "--out", out])
    if out.exists():
        return OTHER, f"failed after writing {sorted(p.name for p in out.iterdir())}"
    return error_outcome(result, must_name="vocab")


@probe("model directory")
def hugging_face_cache_snapshot(env: Env):
    repo = env.scratch / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in env.tiny.iterdir():
        shutil.copy(file, blobs / file.name)
        os.symlink(Path("..", "..", "blobs", file.name), snapshot / file.name)
    rc, _, err, hung = eval_of(env, snapshot, timeout=180)
    return (CLEAN, "loads") if rc == 0 else (HANG if hung else OTHER, last_line(err))


# ------------------------------------------------------------------ data files
def train_on(env: Env, path: Path, **kw):
    return env.run([*TRAIN[:-1], path, "--steps", "1", *SHORT, "--out", env.scratch / "run"], **kw)


@probe("data file")
def lone_surrogate_in_a_question(env: Env):
    path = env.scratch / "set.jsonl"
    path.write_text('{"problem": "x \\ud800 y", "answer": "2"}\n')
    return error_outcome(train_on(env, path), must_name="set.jsonl:1")


@probe("data file")
def endoftext_inside_a_question(env: Env):
    code = f"""
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.models.policy import load_policy
p = load_policy({str(env.tiny)!r})
ids = p.tokenizer.encode(render_prompt("What is 1 <|endoftext|> + 2?"))
print("OTHER an EOS inside the prompt" if set(ids) & set(p.tokenizer.eos_token_ids) else "CLEAN text")
"""
    return api_outcome(api(env, code))


@probe("data file")
def integer_of_4301_digits(env: Env):
    path = env.scratch / "set.jsonl"
    path.write_text('{"problem": "big", "answer": ' + "7" * 4301 + "}\n")
    return error_outcome(train_on(env, path), must_name="set.jsonl")


@probe("data file")
def eval_file_a_fifo(env: Env):
    os.mkfifo(env.scratch / "fifo.jsonl")
    args = [*TRAIN, "--steps", "1", *SHORT, "--eval", "t=fifo.jsonl", "--out", env.scratch / "r"]
    return error_outcome(env.run(args, timeout=90), must_name="fifo.jsonl")


@probe("data file")
def json_of_150_mb_of_empty_objects(env: Env):
    path = env.scratch / "big.json"
    with open(path, "w") as file:
        file.write("[" + ", ".join(["{}"] * 37_500_000) + "]")
    return error_outcome(train_on(env, path, memory_gb=3, timeout=300), must_name="big.json")


@probe("data file")
def problem_with_answer_none(env: Env):
    code = """
from rlvr_fast.data.problems import Problem
try:
    Problem(id="p", question="q", answer=None, source="api")
    print("OTHER accepted")
except ValueError as err:
    print("CLEAN", err)
"""
    return api_outcome(api(env, code))


# ------------------------------------------------------------------ output paths
def select(env: Env, data, out, *extra):
    args = ["select-data", "--data", data, "--k", "1", "--max-new-tokens", "8", "--out", out]
    return env.run([*args, "--quiet", *extra])


@probe("output path")
def select_data_out_on_its_input(env: Env):
    data = env.scratch / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
            for i in range(8)
        )
    )
    before = data.read_bytes()
    result = select(env, data, data)
    if data.read_bytes() != before:
        return LOST, f"input now {len(data.read_bytes())} bytes"
    return error_outcome(result, must_name="train.jsonl")


@probe("output path")
def select_data_out_on_a_ledger(env: Env):
    ledger = env.scratch / "ledger.jsonl"
    ledger.write_text('{"step": 0}\n')
    result = select(env, "synthetic:train:2", ledger)
    if ledger.read_text() != '{"step": 0}\n':
        return LOST, "ledger replaced"
    return error_outcome(result, must_name="ledger.jsonl")


@probe("output path")
def select_data_rates_of_changed_questions(env: Env):
    data = env.scratch / "train.jsonl"
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1), "id": f"q{i}"} for i in range(2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = env.scratch / "zpd.jsonl"
    assert select(env, data, out, "--min-pass", "0")[0] == 0
    rows[0]["problem"] = "What is 40 * 40?"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = select(env, data, out, "--min-pass", "0")
    if result[0] == 0:
        return OTHER, "stale rates reused for changed questions"
    return error_outcome(result, must_name="rates")


@probe("output path")
def report_out_in_a_foreign_directory(env: Env):
    run = env.finished_run()
    mine = env.scratch / "mine"
    mine.mkdir()
    (mine / "accuracy.png").write_bytes(b"my figure")
    result = env.run(["report", run, "--out", mine], timeout=300)
    if (mine / "accuracy.png").read_bytes() != b"my figure":
        return LOST, "accuracy.png replaced"
    return error_outcome(result, must_name="mine")


@probe("output path")
def sweep_out_in_a_foreign_directory(env: Env):
    out = env.scratch / "mine"
    out.mkdir()
    (out / "compare.md").write_text("my table")
    args = [
        "sweep",
        "--arms",
        "zg_flat",
        "--seeds",
        "1",
        "--out",
        out,
        "--steps",
        "1",
        "--train-data",
        "synthetic:train:2",
        "--eval",
        "t=synthetic:test:2",
        "--quiet",
        *SHORT,
    ]
    result = env.run(args, timeout=400)
    if (out / "compare.md").read_text() != "my table":
        return LOST, "compare.md replaced"
    return error_outcome(result, must_name="compare.md")


@probe("output path")
def eval_out_into_a_finished_run(env: Env):
    run = env.finished_run()
    before = [(run / n).read_bytes() for n in ("summary.json", "ledger.jsonl")]
    env.run(
        ["eval", run, "--eval", "ledger=synthetic:test:1", "--out", run, "--max-new-tokens", "4"]
    )
    if [(run / n).read_bytes() for n in ("summary.json", "ledger.jsonl")] != before:
        return LOST, "summary.json or ledger.jsonl of the run replaced"
    return CLEAN, "refused or written under evals/"


@probe("output path")
def eval_with_a_good_and_a_bad_set(env: Env):
    long = env.scratch / "long.jsonl"
    long.write_text(json.dumps({"problem": "1 + " * 20_000 + "1", "answer": "20001"}) + "\n")
    out = env.scratch / "ev"
    args = ["eval", "tiny", "--eval", "good=synthetic:test:1", "--eval", f"bad={long}"]
    result = env.run([*args, "--out", out, "--max-new-tokens", "4"])
    if out.exists():
        return OTHER, f"wrote {sorted(p.name for p in out.iterdir())} before failing"
    return error_outcome(result, must_name="long.jsonl")


@probe("output path")
def nproc_3_with_a_bogus_arm(env: Env):
    rc, out, err, hung = env.run([*TRAIN, "--nproc", "3", "--arm", "bogus", "--out", "r"])
    if err.count("bogus") > 1:
        return OTHER, f"the error printed {err.count('bogus')} times (ranks started)"
    return error_outcome((rc, out, err, hung), must_name="bogus")


FACADE = """
import math, subprocess, sys, torch
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer
ROWS = [{"prompt": render_prompt(p.question)} for p in synthetic_problems("train", 2, seed=5)]
S = dict(max_steps=2, num_generations=4, per_device_train_batch_size=4,
         max_completion_length=8, use_cpu=True, disable_tqdm=True, save_strategy="no")
def varied(completion_ids, **kw):
    return [float(sum(i) % 7) for i in completion_ids]
def nothing(completions, **kw):
    return [None] * len(completions)
"""


@probe("api")
def grpo_trainer_with_a_nan_weight(env: Env):
    code = (
        FACADE
        + """
t = GRPOTrainer(model=str(TINY_MODEL_DIR), reward_funcs=varied,
                args=GRPOConfig(output_dir="out", **S), train_dataset=ROWS)
with torch.no_grad():
    next(t.policy.model.parameters())[0, 0] = math.nan
try:
    t.train()
    print("OTHER trained on a NaN weight")
except ValueError as err:
    try:
        t.save_model()
        print("OTHER save_model wrote non-finite weights")
    except ValueError:
        print("CLEAN", err)
"""
    )
    return api_outcome(api(env, code, timeout=300))


@probe("api")
def grpo_trainer_ledger_verifies(env: Env):
    code = (
        FACADE
        + """
for name, reward in (("varied", varied), ("none", nothing)):
    t = GRPOTrainer(model=str(TINY_MODEL_DIR), reward_funcs=reward,
                    args=GRPOConfig(output_dir=name, ledger=True, **S), train_dataset=ROWS)
    t.train()
    done = subprocess.run([sys.executable, "-m", "rlvr_fast.cli", "verify", f"{name}/ledger"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print("OTHER", name, "ledger:", done.stdout.strip().splitlines()[-1])
        break
else:
    print("CLEAN both ledgers pass verify")
"""
    )
    return api_outcome(api(env, code, timeout=400))


# ------------------------------------------------------------------ analysis
@probe("analysis")
def verify_summary_json_a_list(env: Env):
    run = env.finished_run()
    (run / "summary.json").write_text("[1, 2]")
    return error_outcome(env.run(["verify", run]), expect_rc=1)


@probe("analysis")
def verify_summary_json_nested_100000_deep(env: Env):
    run = env.finished_run()
    (run / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    return error_outcome(env.run(["verify", run]), expect_rc=1)


@probe("analysis")
def verify_ledger_a_fifo(env: Env):
    run = env.finished_run()
    (run / "ledger.jsonl").unlink()
    os.mkfifo(run / "ledger.jsonl")
    return error_outcome(env.run(["verify", run], timeout=90), expect_rc=1)


@probe("analysis")
def verify_ledger_linked_to_dev_zero(env: Env):
    run = env.finished_run()
    (run / "ledger.jsonl").unlink()
    os.symlink("/dev/zero", run / "ledger.jsonl")
    return error_outcome(env.run(["verify", run], timeout=120, memory_gb=4), expect_rc=1)


@probe("analysis")
def compare_of_one_arm_on_two_models(env: Env):
    other = env.model_copy("other")
    code = f"""
from safetensors.torch import load_file, save_file
p = {str(other / "model.safetensors")!r}
t = load_file(p)
t["lm_head.weight"] = t["lm_head.weight"] * 1.01
save_file(t, p, metadata={{"format": "pt"}})
"""
    api(env, code)
    env.finished_run("runs/s1", "--seed", "1")
    env.finished_run("runs/s2", "--seed", "2", "--model", other)
    result = env.run(["compare", env.scratch / "runs"])
    if result[0] == 0:
        return OTHER, "pooled runs of two models into one row"
    return error_outcome(result, must_name="model")


@probe("analysis")
def compare_of_one_arm_on_two_eval_contents(env: Env):
    for seed, eval_seed in ((1, 1), (2, 9)):
        data = env.scratch / f"eval{seed}.jsonl"
        rows = [
            {
                "problem": f"What is {i + eval_seed} + 1?",
                "answer": str(i + eval_seed + 1),
                "id": f"q{i}",
            }
            for i in range(2)
        ]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = env.scratch / "runs" / f"s{seed}"
        rc, _, err, _ = env.run(
            [*TRAIN, "--steps", "1", *SHORT, "--eval", f"t={data}", "--seed", seed, "--out", out]
        )
        assert rc == 0, err
    result = env.run(["compare", env.scratch / "runs"])
    if result[0] == 0:
        return OTHER, "pooled runs evaluated on other questions under the same ids"
    return error_outcome(result, must_name="evaluation")


@probe("analysis")
def verify_output_into_a_closed_pipe(env: Env):
    run = env.finished_run()
    command = f"{sys.executable} -m rlvr_fast.cli verify {run} | true"
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"],
        env=env.environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "Traceback" in done.stderr:
        return TRACEBACK, last_line(done.stderr)
    return CLEAN, f"exit {done.returncode}"


# ------------------------------------------------------------------ engine and memory
@probe("engine")
def train_under_a_2_5_gb_address_limit(env: Env):
    args = [
        *TRAIN,
        "--steps",
        "1",
        *SHORT,
        "--eval",
        "t=synthetic:test:2",
        "--out",
        env.scratch / "r",
    ]
    rc, out, err, hung = env.run(args, memory_gb=2.5, timeout=300)
    return (CLEAN, "ran") if rc == 0 else error_outcome((rc, out, err, hung))


@probe("engine")
def max_batch_65536_under_2_5_gb(env: Env):
    args = [*TRAIN, "--steps", "1", *SHORT, "--set", "max_batch=65536", "--out", env.scratch / "r"]
    rc, out, err, hung = env.run(args, memory_gb=2.5, timeout=300)
    return (CLEAN, "ran") if rc == 0 else error_outcome((rc, out, err, hung))


@probe("engine")
def fork_of_ten_million(env: Env):
    code = """
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.models.policy import load_policy
engine = RolloutEngine.for_policy(load_policy("tiny"))
seq = engine.add(list(range(1, 30)), keep_cache=True)
engine.prefill([seq])
try:
    engine.fork(seq, n=10**7)
    print("OTHER forked")
except ValueError as err:
    left = engine.manager.num_sequences
    print(("CLEAN" if left == 1 else "OTHER"), f"{err} ({left} registered)")
except MemoryError:
    print("TRACEBACK MemoryError,", engine.manager.num_sequences, "sequences left registered")
"""
    return api_outcome(api(env, code, memory_gb=4, timeout=400))


@probe("engine")
def kv_blocks_of_10_to_the_12(env: Env):
    code = """
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.models.policy import load_policy
try:
    RolloutEngine.for_policy(load_policy("tiny"), kv_blocks=10**12)
    print("OTHER accepted")
except ValueError as err:
    print("CLEAN", err)
"""
    return api_outcome(api(env, code, memory_gb=4))


@probe("engine")
def group_size_4096_under_2_5_gb(env: Env):
    args = [
        *TRAIN,
        "--steps",
        "1",
        "--set",
        "max_new_tokens=64",
        "--set",
        "group_size=4096",
        "--out",
        env.scratch / "r",
    ]
    rc, out, err, hung = env.run(args, memory_gb=2.5, timeout=400)
    if rc == 0:
        return CLEAN, "ran"
    outcome, note = error_outcome((rc, out, err, hung))
    return outcome, note + (
        " (the trainer's CPU loss mask: phase 2)" if outcome == TRACEBACK else ""
    )


# ------------------------------------------------------------------ grading
@probe("grading")
def grade_with_a_nan_timeout(env: Env):
    code = """
import math
from rlvr_fast.grading import grade
try:
    print("OTHER returned", grade("x^2", "x*x", timeout=math.nan))
except ValueError as err:
    print("CLEAN", err)
"""
    return api_outcome(api(env, code))


@probe("grading")
def grade_with_a_1e300_timeout(env: Env):
    code = """
from rlvr_fast.grading import grade
try:
    print("OTHER returned", grade("x^2", "x*x", timeout=1e300))
except ValueError as err:
    print("CLEAN", err)
"""
    return api_outcome(api(env, code))


# ------------------------------------------------------------------ the driver
def run_probes(tree: Path, only: set[str] | None) -> list[dict]:
    results = []
    for family, name, function in PROBES:
        if only and name not in only:
            continue
        scratch = Path(tempfile.mkdtemp(prefix=f"probe-{name[:20]}-"))
        started = time.monotonic()
        try:
            outcome, note = function(Env(tree, scratch))
        except Exception as err:  # a probe's own set-up failed: report it, go on
            outcome, note = OTHER, f"probe failed: {type(err).__name__}: {err}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        results.append(
            dict(
                family=family,
                probe=name,
                outcome=outcome,
                note=note,
                seconds=round(time.monotonic() - started, 1),
            )
        )
        print(f"{family:16} {name:45} {outcome:10} {note[:120]}", flush=True)
    return results


def table(results: list[dict]) -> str:
    families = list(dict.fromkeys(r["family"] for r in results))
    lines = [
        "| family | probes | " + " | ".join(CATEGORIES) + " |",
        "|---" * (len(CATEGORIES) + 2) + "|",
    ]
    for family in families + ["all"]:
        rows = [r for r in results if family in ("all", r["family"])]
        counts = [sum(r["outcome"] == c for r in rows) for c in CATEGORIES]
        lines.append(f"| {family} | {len(rows)} | " + " | ".join(map(str, counts)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default=None, help="comma-separated probe names")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    results = run_probes(args.tree.resolve(), only)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
