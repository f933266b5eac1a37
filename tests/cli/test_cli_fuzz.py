"""The command line's promise, fuzzed: whatever the arguments and files, a command either gets
to its real work or exits 2 with one line on stderr that names the problem, having written
nothing. Generated inputs: valid command lines with up to two options made wild (numbers, text, JSON
of any shape for --set, data files and model directories with damaged contents, eval names,
devices, output paths), so that examples get past the early checks to the deep ones.
Training and decoding are stubbed out at the point where the real work starts, so an example
costs a policy load at most.

``pytest --hypothesis-profile=probe tests/cli/test_cli_fuzz.py`` runs many more examples than CI.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rlvr_fast.train.arms import ARMS
from rlvr_fast.cli.main import main
from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.rollouts import evaluation, selection
from rlvr_fast.train.trainer import RLVRTrainer
from rlvr_fast.train.config import setting_fields

FIELDS = list(setting_fields())


class ReachedTheRealWork(Exception):
    pass


def reached(*args, **kwargs):
    raise ReachedTheRealWork


@pytest.fixture(autouse=True)
def stub_the_real_work(monkeypatch):
    monkeypatch.setattr(RLVRTrainer, "train", reached)
    monkeypatch.setattr(evaluation, "generate", reached)
    monkeypatch.setattr(selection, "sample_groups", reached)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
numbers = st.integers().map(str) | st.sampled_from(["0", "-1", "1e3", "2", "9" * 30, "abc", ""])
set_pairs = st.builds(
    lambda key, value: f"{key}={value}",
    st.sampled_from(FIELDS) | st.text(max_size=10),
    json_values.map(json.dumps) | st.text(max_size=10),
)
data_files = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(
        st.dictionaries(
            st.sampled_from(["problem", "question", "answer", "solution", "id", "level", "source"]),
            json_values,
            max_size=4,
        ),
        max_size=3,
    ).map(lambda rows: "\n".join(json.dumps(r) for r in rows).encode()),
)
MODEL_FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
]
model_damage = st.tuples(
    st.sampled_from(MODEL_FILES),
    st.sampled_from(["truncate", "replace", "delete", "json"]),
    st.integers(min_value=0, max_value=5000),
    json_values,
)
eval_names = st.sampled_from(["t", "../x", "a/b", "", ".h"]) | st.text(max_size=6)
eval_sources = st.sampled_from(
    [
        "synthetic:test:2",
        "synthetic:test:0",
        "synthetic:bogus:2",
        "synthetic:test:99999999",
        "DATA",
        "missing.jsonl",
    ]
)
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
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


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
    event("reached the real work" if code == "reached" else f"exit {code}")
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
VALID_DATA = "".join(
    json.dumps({"problem": f"What is {i} + 3?", "answer": str(i + 3)}) + "\n" for i in range(4)
).encode()


@st.composite
def inputs(draw, valid: dict, wild: dict) -> dict:
    """One value per option: a valid one, except for up to two options (often none) drawn from
    their wild values, so that examples reach every check, the deep ones included."""
    corrupt = draw(st.sets(st.sampled_from(sorted(wild)), max_size=2))
    return {name: draw(wild[name] if name in corrupt else valid[name]) for name in valid}


TRAIN_VALID = dict(
    arm=st.sampled_from(list(ARMS)),
    steps=st.sampled_from(["1", "3"]),
    seed=st.integers(0, 2**63 - 1).map(str),
    sets=st.sampled_from([[], ["max_new_tokens=16"], ["lr=1e-4", "group_size=4"]]),
    data=st.just(VALID_DATA),
    train_data=st.sampled_from(["DATA", "synthetic:train"]),
    evals=st.sampled_from([[], [("t", "synthetic:test:2")], [("t", "DATA")]]),
    model=st.sampled_from(["tiny", "MODEL"]),
    damage=st.none(),
    device=st.just("cpu"),
    dtype=st.sampled_from(["auto", "fp32"]),
    out=st.sampled_from(["new", "new/nested"]),
    resume=st.just(False),
)
TRAIN_WILD = dict(
    arm=st.text(max_size=8),
    steps=numbers,
    seed=numbers,
    sets=st.lists(set_pairs, min_size=1, max_size=3),
    data=data_files,
    train_data=st.just("synthetic:train:x") | st.just("DATA"),
    evals=st.lists(st.tuples(eval_names, eval_sources), min_size=1, max_size=2),
    model=st.just("missing"),
    damage=model_damage,
    device=st.sampled_from(["cuda", "cuda:3", "bogus", "meta", "cpu:0"]),
    dtype=st.sampled_from(["bf16", "fp8"]),
    out=outs,
    resume=st.just(True),
)


@CI
@given(args=inputs(TRAIN_VALID, TRAIN_WILD))
def test_train_keeps_the_cli_promise_for_generated_inputs(args):
    sandbox, out_path = make_sandbox(args["data"], args["damage"], args["out"])
    try:

        def path_of(spec):
            return str(sandbox / "data.jsonl") if spec == "DATA" else spec

        model = str(sandbox / "model") if args["model"] == "MODEL" else args["model"]
        argv = [
            "train",
            "--arm",
            args["arm"],
            "--steps",
            args["steps"],
            "--seed",
            args["seed"],
            "--quiet",
            "--train-data",
            path_of(args["train_data"]),
            "--device",
            args["device"],
            "--dtype",
            args["dtype"],
            "--model",
            model,
            "--out",
            str(out_path),
        ]
        for pair in args["sets"]:
            argv += ["--set", pair]
        for name, source in args["evals"]:
            argv += ["--eval", f"{name}={path_of(source)}"]
        if args["resume"]:
            argv.append("--resume")
        assert_the_promise(sandbox, argv, digest(sandbox))
    finally:
        shutil.rmtree(sandbox)


EVAL_VALID = dict(
    data=st.just(VALID_DATA),
    damage=st.none(),
    max_new=st.sampled_from(["8", "16"]),
    max_batch=st.sampled_from(["4", "256"]),
    evals=st.sampled_from([[("t", "synthetic:test:2")], [("t", "DATA")]]),
    device=st.just("cpu"),
    out=st.sampled_from(["new", "new/nested"]),
)
EVAL_WILD = dict(
    data=data_files,
    damage=model_damage,
    max_new=numbers,
    max_batch=numbers,
    evals=st.lists(st.tuples(eval_names, eval_sources), min_size=1, max_size=2),
    device=st.sampled_from(["cuda", "bogus"]),
    out=outs,
)


@CI
@given(args=inputs(EVAL_VALID, EVAL_WILD))
def test_eval_keeps_the_cli_promise_for_generated_inputs(args):
    sandbox, out_path = make_sandbox(args["data"], args["damage"], args["out"])
    try:
        argv = [
            "eval",
            str(sandbox / "model"),
            "--max-new-tokens",
            args["max_new"],
            "--max-batch",
            args["max_batch"],
            "--device",
            args["device"],
            "--out",
            str(out_path),
        ]
        for name, source in args["evals"]:
            path = str(sandbox / "data.jsonl") if source == "DATA" else source
            argv += ["--eval", f"{name}={path}"]
        assert_the_promise(sandbox, argv, digest(sandbox))
    finally:
        shutil.rmtree(sandbox)


SELECT_VALID = dict(
    data=st.just(VALID_DATA),
    damage=st.none(),
    k=st.sampled_from(["2", "8"]),
    max_new=st.sampled_from(["8", "512"]),
    max_batch=st.just("256"),
    batch_questions=st.sampled_from(["1", "16"]),
    limit=st.sampled_from([None, "2"]),
    passes=st.sampled_from([[], ["0", "1"], ["0.5"]]),
    temperature=st.just("0.8"),
    source=st.sampled_from(["DATA", "synthetic:test:2"]),
    device=st.just("cpu"),
    out=st.sampled_from(["sel.json", "sel.jsonl"]),
)
SELECT_WILD = dict(
    data=data_files,
    damage=model_damage,
    k=numbers,
    max_new=numbers,
    max_batch=numbers,
    batch_questions=numbers,
    limit=numbers,
    passes=st.lists(
        st.sampled_from(["0", "0.5", "1", "-1", "2", "nan", "x"]), min_size=1, max_size=2
    ),
    temperature=st.sampled_from(["0", "-1", "inf", "nan", "x"]),
    source=eval_sources,
    device=st.sampled_from(["cuda", "bogus"]),
    out=st.sampled_from(["sel.txt", "file/sel.json", "missing/sel.json", "nonempty"]),
)


@CI
@given(args=inputs(SELECT_VALID, SELECT_WILD))
def test_select_data_keeps_the_cli_promise_for_generated_inputs(args):
    sandbox, _ = make_sandbox(args["data"], args["damage"], "new")
    try:
        path = str(sandbox / "data.jsonl") if args["source"] == "DATA" else args["source"]
        argv = [
            "select-data",
            "--model",
            str(sandbox / "model"),
            "--data",
            path,
            "--k",
            args["k"],
            "--max-new-tokens",
            args["max_new"],
            "--max-batch",
            args["max_batch"],
            "--batch-questions",
            args["batch_questions"],
            "--temperature",
            args["temperature"],
            "--device",
            args["device"],
            "--quiet",
            "--out",
            str(sandbox / args["out"]),
        ]
        for flag, value in zip(("--min-pass", "--max-pass"), args["passes"]):
            argv += [flag, value]
        if args["limit"] is not None:
            argv += ["--limit", args["limit"]]
        assert_the_promise(sandbox, argv, digest(sandbox))
    finally:
        shutil.rmtree(sandbox)
