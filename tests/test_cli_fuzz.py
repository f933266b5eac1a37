"""The command line's promise, fuzzed: whatever the arguments and files, a command either gets
to its real work or exits 2 with one line on stderr that names the problem, having written
nothing. Generated inputs: option values (numbers, text, JSON of any shape for --set), data
files and model directories with damaged contents, eval names, devices, output paths.
Training and decoding are stubbed out at the point where the real work starts, so an example
costs a policy load at most.

``pytest --hypothesis-profile=probe tests/test_cli_fuzz.py`` runs many more examples than CI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlvr_fast.arms import ARMS
from rlvr_fast.cli import main
from rlvr_fast.policy import TINY_MODEL_DIR
from rlvr_fast.trainer import TrainConfig

FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


class ReachedTheRealWork(Exception):
    pass


def reached(*args, **kwargs):
    raise ReachedTheRealWork


@pytest.fixture(autouse=True)
def stub_the_real_work(monkeypatch):
    monkeypatch.setattr("rlvr_fast.trainer.RLVRTrainer.train", reached)
    monkeypatch.setattr("rlvr_fast.evaluation.generate", reached)
    monkeypatch.setattr("rlvr_fast.select_data.sample_groups", reached)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6)
numbers = st.integers().map(str) | st.sampled_from(["0", "-1", "1e3", "2", "9" * 30, "abc", ""])
set_pairs = st.builds(lambda key, value: f"{key}={value}",
                      st.sampled_from(FIELDS) | st.text(max_size=10),
                      json_values.map(json.dumps) | st.text(max_size=10))
data_files = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(st.dictionaries(st.sampled_from(["problem", "question", "answer", "solution", "id",
                                              "level", "source"]), json_values, max_size=4),
             max_size=3).map(lambda rows: "\n".join(json.dumps(r) for r in rows).encode()))
MODEL_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json"]
model_damage = st.tuples(st.sampled_from(MODEL_FILES),
                         st.sampled_from(["truncate", "replace", "delete", "json"]),
                         st.integers(min_value=0, max_value=5000), json_values)
eval_names = st.sampled_from(["t", "../x", "a/b", "", ".h"]) | st.text(max_size=6)
eval_sources = st.sampled_from(["synthetic:test:2", "synthetic:test:0", "synthetic:bogus:2",
                                "synthetic:test:99999999", "DATA", "missing.jsonl"])
outs = st.sampled_from(["new", "new/nested", "file", "file/under", "model", "nonempty"])


def damage_model(directory: Path, damage) -> None:
    name, how, cut, value = damage
    path = directory / name
    if how == "delete":
        path.unlink(missing_ok=True)
    elif how == "truncate" and path.exists():
        path.write_bytes(path.read_bytes()[:cut])
    elif how == "json":
        raw = json.loads(path.read_text()) if name.endswith(".json") and path.exists() else {}
        if isinstance(raw, dict) and raw:
            raw[sorted(raw)[cut % len(raw)]] = value
        path.write_text(json.dumps(raw if raw else value))
    else:
        path.write_bytes(json.dumps(value).encode())


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def run_cli(argv: list[str]) -> tuple[int | str, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        except ReachedTheRealWork:
            code = "reached"
    return code, err.getvalue()


def assert_the_promise(sandbox: Path, argv: list[str], before: dict) -> None:
    code, err = run_cli(argv)
    if code == "reached":
        return
    assert code == 2, (argv, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlvr-fast: error: "), (argv, err)
    assert digest(sandbox) == before, (argv, err, "something was written")


def make_sandbox(data: bytes, damage, out_kind: str) -> tuple[Path, Path]:
    sandbox = Path(tempfile.mkdtemp(prefix="fuzz-"))
    (sandbox / "data.jsonl").write_bytes(data)
    shutil.copytree(TINY_MODEL_DIR, sandbox / "model")
    if damage is not None:
        damage_model(sandbox / "model", damage)
    (sandbox / "file").write_text("x")
    (sandbox / "nonempty").mkdir()
    (sandbox / "nonempty" / "notes.txt").write_text("mine")
    out = sandbox / ("model" if out_kind == "model" else out_kind)
    return sandbox, out


CI = settings(deadline=None, suppress_health_check=list(HealthCheck))


@CI
@given(arm=st.sampled_from(list(ARMS)) | st.text(max_size=8), steps=numbers, seed=numbers,
       sets=st.lists(set_pairs, max_size=3), data=data_files,
       train_data=st.sampled_from(["DATA", "synthetic:train", "synthetic:train:x"]),
       evals=st.lists(st.tuples(eval_names, eval_sources), max_size=2),
       model=st.sampled_from(["tiny", "MODEL", "missing"]), damage=st.none() | model_damage,
       device=st.sampled_from(["cpu", "cuda", "cuda:3", "bogus", "meta", "cpu:0"]),
       dtype=st.sampled_from(["auto", "fp32", "bf16", "fp8"]), out=outs,
       resume=st.booleans())
def test_train_keeps_the_cli_promise_for_generated_inputs(arm, steps, seed, sets, data,
                                                          train_data, evals, model, damage,
                                                          device, dtype, out, resume):
    sandbox, out_path = make_sandbox(data, damage, out)
    try:
        def path_of(spec):
            return str(sandbox / "data.jsonl") if spec == "DATA" else spec

        argv = ["train", "--arm", arm, "--steps", steps, "--seed", seed, "--quiet",
                "--train-data", path_of(train_data), "--device", device, "--dtype", dtype,
                "--model", str(sandbox / "model") if model == "MODEL" else model,
                "--out", str(out_path)]
        for pair in sets:
            argv += ["--set", pair]
        for name, source in evals:
            argv += ["--eval", f"{name}={path_of(source)}"]
        if resume:
            argv.append("--resume")
        assert_the_promise(sandbox, argv, digest(sandbox))
    finally:
        shutil.rmtree(sandbox)


@CI
@given(data=data_files, damage=st.none() | model_damage, max_new=numbers, max_batch=numbers,
       evals=st.lists(st.tuples(eval_names, eval_sources), min_size=1, max_size=2),
       device=st.sampled_from(["cpu", "cuda", "bogus"]), out=outs)
def test_eval_keeps_the_cli_promise_for_generated_inputs(data, damage, max_new, max_batch, evals,
                                                         device, out):
    sandbox, out_path = make_sandbox(data, damage, out)
    try:
        argv = ["eval", str(sandbox / "model"), "--max-new-tokens", max_new, "--max-batch",
                max_batch, "--device", device, "--out", str(out_path)]
        for name, source in evals:
            path = str(sandbox / "data.jsonl") if source == "DATA" else source
            argv += ["--eval", f"{name}={path}"]
        assert_the_promise(sandbox, argv, digest(sandbox))
    finally:
        shutil.rmtree(sandbox)


@CI
@given(data=data_files, damage=st.none() | model_damage, k=numbers, max_new=numbers,
       max_batch=numbers, batch_questions=numbers, limit=st.none() | numbers,
       passes=st.lists(st.sampled_from(["0", "0.5", "1", "-1", "2", "nan", "x"]), max_size=2),
       temperature=st.sampled_from(["0.8", "0", "-1", "inf", "nan", "x"]),
       source=eval_sources, device=st.sampled_from(["cpu", "cuda", "bogus"]),
       out=st.sampled_from(["sel.json", "sel.jsonl", "sel.txt", "file/sel.json",
                            "missing/sel.json", "nonempty"]))
def test_select_data_keeps_the_cli_promise_for_generated_inputs(data, damage, k, max_new,
                                                                max_batch, batch_questions,
                                                                limit, passes, temperature,
                                                                source, device, out):
    sandbox, _ = make_sandbox(data, damage, "new")
    try:
        path = str(sandbox / "data.jsonl") if source == "DATA" else source
        argv = ["select-data", "--model", str(sandbox / "model"), "--data", path, "--k", k,
                "--max-new-tokens", max_new, "--max-batch", max_batch, "--batch-questions",
                batch_questions, "--temperature", temperature, "--device", device, "--quiet",
                "--out", str(sandbox / out)]
        for flag, value in zip(("--min-pass", "--max-pass"), passes):
            argv += [flag, value]
        if limit is not None:
            argv += ["--limit", limit]
        assert_the_promise(sandbox, argv, digest(sandbox))
    finally:
        shutil.rmtree(sandbox)
