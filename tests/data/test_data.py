"""Tests for rlvr_fast.data.problems: prompt template, loaders, save/load, synthetic task."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from rlvr_fast.data.problems import DataError, Problem, load_problems, render_prompt, save_problems
from rlvr_fast.data.synthetic import synthetic_problems, worked_solution

GATE = 30  # the study keeps a completion only if text.rfind("\\boxed") >= 30
STEP_LINE = re.compile(r"(\d+) ([+\-*]) (\d+) = (\d+)")


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def evaluate(expression: str) -> int:
    # Synthetic expressions are digits, + - *, parentheses and spaces only.
    assert re.fullmatch(r"[\d+\-* ()]+", expression), expression
    return eval(expression)  # noqa: S307 - input checked just above


# --- prompt -----------------------------------------------------------------


def test_render_prompt_is_the_seed_template_exactly() -> None:
    assert render_prompt("What is 2 + 2?") == (
        "You are a helpful math assistant.\n"
        "Answer the question and write the final result on a new line as:\n"
        "\\boxed{ANSWER}\n\n"
        "Question:\nWhat is 2 + 2?\n\nAnswer:"
    )


# --- loaders ------------------------------------------------------------------


def test_math_rows_with_answer_keep_level_and_solution(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "math_train.jsonl",
        [
            {
                "problem": "Find x.",
                "answer": "\\frac{1}{2}",
                "solution": "So \\boxed{\\frac12}.",
                "level": "Level 3",
                "unique_id": "test/algebra/1.json",
            },
            {"problem": "Find y.", "answer": 7, "level": 5},
            {"problem": "Find z.", "answer": "2", "level": "Level ?"},
        ],
    )
    first, second, third = load_problems(path)
    assert first == Problem(
        id="test/algebra/1.json",
        question="Find x.",
        answer="\\frac{1}{2}",
        source="math_train.jsonl",
        level=3,
        solution="So \\boxed{\\frac12}.",
    )
    assert (second.id, second.answer, second.level, second.solution) == (
        "math_train-1",
        "7",
        5,
        None,
    )
    assert third.level is None


def test_subject_comes_from_subject_or_a_string_type(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"problem": "A?", "answer": "1", "subject": "Algebra", "type": "ignored"},
            {"problem": "B?", "answer": "2", "type": "Number Theory"},
            {"question": "C?", "answer": "3", "type": 4},
        ],
    )
    assert [p.subject for p in load_problems(path)] == ["Algebra", "Number Theory", None]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "A?", "answer": "1", "subject": 3}])
    with pytest.raises(DataError, match="bad.jsonl:1: field 'subject' must be a string"):
        load_problems(bad)


def test_math_row_with_boxed_solution_only_takes_last_box(tmp_path: Path) -> None:
    solution = "First \\boxed{1}, then $\\boxed{\\frac{3}{4}}$."
    path = write_jsonl(tmp_path / "math.jsonl", [{"problem": "Q?", "solution": solution}])
    (problem,) = load_problems(path)
    assert problem.answer == "\\frac{3}{4}"
    assert problem.solution == solution


def test_gsm8k_answer_after_hashes_without_commas(tmp_path: Path) -> None:
    text = "She sells 1,000 + 234 = <<1000+234=1234>>1,234 eggs.\n#### 1,234 "
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "How many eggs?", "answer": text}])
    (problem,) = load_problems(path)
    assert problem == Problem(
        id="gsm8k-0", question="How many eggs?", answer="1234", source="gsm8k.jsonl", solution=text
    )


@pytest.mark.parametrize(("raw", "gold"), [(36.0, "36"), (7, "7"), (2.5, "2.5"), (" 1/2 ", "1/2")])
def test_amc_answers_become_strings(tmp_path: Path, raw: object, gold: str) -> None:
    path = write_jsonl(tmp_path / "amc.jsonl", [{"id": 3, "problem": "AMC?", "answer": raw}])
    (problem,) = load_problems(path)
    assert (problem.id, problem.answer) == ("3", gold)


def test_question_rows_with_short_answer_are_amc_style(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "aime.jsonl", [{"question": "AIME?", "answer": "204", "idx": 0}])
    (problem,) = load_problems(path)
    assert (problem.id, problem.answer, problem.solution) == ("0", "204", None)


def test_json_array_wrapped_array_and_jsonl_give_the_same_problems(tmp_path: Path) -> None:
    rows = [{"problem": f"P{i}?", "answer": str(i)} for i in range(3)]
    (tmp_path / "set.json").write_text(json.dumps(rows), encoding="utf-8")
    (tmp_path / "wrapped").mkdir()
    (tmp_path / "wrapped" / "set.json").write_text(
        json.dumps({"version": 1, "data": rows}), encoding="utf-8"
    )
    (tmp_path / "set.jsonl").write_text(
        "\n".join(["", *map(json.dumps, rows), "", ""]), encoding="utf-8"
    )
    from_array = load_problems(tmp_path / "set.json")
    assert load_problems(tmp_path / "wrapped" / "set.json") == from_array
    assert load_problems(tmp_path / "set.jsonl") == [
        Problem(id=p.id, question=p.question, answer=p.answer, source="set.jsonl")
        for p in from_array
    ]
    assert [p.id for p in from_array] == ["set-0", "set-1", "set-2"]


def test_limit_stops_reading_early(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"problem": "A?", "answer": "1"}) + "\n{broken\n", encoding="utf-8")
    assert [p.answer for p in load_problems(path, limit=1)] == ["1"]
    assert load_problems(path, limit=0) == []


def lines(*rows: object) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


GOOD = {"problem": "A?", "answer": "1"}

# (file name, content, fragments the DataError message must contain)
MALFORMED = {
    "bad JSON line": ("a.jsonl", lines(GOOD) + '\n{"problem": \n', ["a.jsonl:3", "invalid JSON"]),
    "bad JSON array": (
        "a.json",
        '[\n{"problem": "A?",\n "answer": }\n]',
        ["a.json:3", "invalid JSON"],
    ),
    "missing answer": (
        "math_train.jsonl",
        lines(GOOD, {"problem": "B?"}),
        ["math_train.jsonl:2", "missing field 'answer'", "boxed 'solution'"],
    ),
    "missing question": ("a.json", '[{"answer": "1"}]', ["a.json:item 1", "'problem'"]),
    "gsm8k without ####": (
        "gsm8k.jsonl",
        lines({"question": "Q?", "answer": "It is 5.\nSo 5."}),
        ["gsm8k.jsonl:1", "'answer'", "####"],
    ),
    "unbalanced box": (
        "math.json",
        json.dumps({"data": [GOOD, {"problem": "B?", "solution": "\\boxed{\\frac{1}{2}"}]}),
        ["math.json:item 2", "'solution'", "boxed"],
    ),
    "no box": (
        "math.jsonl",
        lines({"problem": "B?", "solution": "It is 2."}),
        ["math.jsonl:1", "'solution'"],
    ),
    "duplicate id": (
        "dup.jsonl",
        lines({"id": "x", **GOOD}, {"id": "x", "problem": "B?", "answer": "2"}),
        ["dup.jsonl:2", "'id'", "'x'", "dup.jsonl:1"],
    ),
    "row not an object": ("a.jsonl", "[1, 2]\n", ["a.jsonl:1", "expected a JSON object"]),
    "empty question": (
        "a.jsonl",
        lines({"question": "  ", "answer": "1"}),
        ["a.jsonl:1", "'question'", "empty"],
    ),
    "answer wrong type": (
        "a.json",
        json.dumps([{"problem": "A?", "answer": [1]}]),
        ["a.json:item 1", "'answer'"],
    ),
    "answer is boolean": (
        "a.jsonl",
        lines({"problem": "A?", "answer": True}),
        ["a.jsonl:1", "'answer'"],
    ),
    "problem wrong type": (
        "a.jsonl",
        lines({"problem": 5, "answer": "5"}),
        ["a.jsonl:1", "'problem'"],
    ),
    "id wrong type": ("a.jsonl", lines({"problem_id": [1], **GOOD}), ["a.jsonl:1", "'problem_id'"]),
    "level wrong type": ("a.jsonl", lines({"level": [3], **GOOD}), ["a.jsonl:1", "'level'"]),
    "no single list": (
        "a.json",
        json.dumps({"a": [], "b": []}),
        ["a.json", "exactly one list-valued key"],
    ),
    "unknown suffix": ("a.csv", "problem,answer\n", ["a.csv", "unsupported file type"]),
}


@pytest.mark.parametrize("case", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_input_names_file_location_and_field(
    tmp_path: Path, case: tuple[str, str, list[str]]
) -> None:
    name, content, expected = case
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as caught:
        load_problems(tmp_path / name)
    for fragment in expected:
        assert fragment in str(caught.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        load_problems(tmp_path / "nope.jsonl")


def test_data_error_is_a_value_error() -> None:
    assert issubclass(DataError, ValueError)


# --- save / load ----------------------------------------------------------------


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    problems = [
        *synthetic_problems("train", 8),
        Problem(
            id="g-1",
            question="Eggs?\u2028Really?",
            answer="1234",
            source="gsm8k.jsonl",
            solution="Some text.\n#### 1,234",
        ),
        Problem(
            id="m-1",
            question="Find x.",
            answer="\\frac{1}{2}",
            source="math.jsonl",
            level=3,
            solution="So $\\boxed{\\frac{1}{2}}$.",
            subject="Algebra",
        ),
        Problem(id="a-1", question="AMC?", answer="36", source="amc.json"),
    ]
    path = tmp_path / "saved.jsonl"
    save_problems(problems, path)
    assert load_problems(path) == problems
    assert [p.name for p in tmp_path.iterdir()] == ["saved.jsonl"]  # no temp file left behind


def test_save_rejects_non_jsonl_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="jsonl"):
        save_problems([], tmp_path / "out.json")


# --- synthetic task ------------------------------------------------------------


@pytest.fixture(scope="module")
def large_splits() -> dict[str, list[Problem]]:
    return {split: synthetic_problems(split, 2000) for split in ("train", "val", "test")}


def test_synthetic_is_deterministic_per_seed() -> None:
    assert synthetic_problems("train", 50, seed=1) == synthetic_problems("train", 50, seed=1)
    assert synthetic_problems("train", 50, seed=1) != synthetic_problems("train", 50, seed=2)


def test_synthetic_splits_are_disjoint_and_distinct(large_splits: dict[str, list[Problem]]) -> None:
    expressions = {
        split: [p.solution for p in problems] for split, problems in large_splits.items()
    }
    for split, exprs in expressions.items():
        assert len(exprs) == len(set(exprs)) == 2000, split
    assert not set(expressions["train"]) & set(expressions["val"])
    assert not set(expressions["train"]) & set(expressions["test"])
    assert not set(expressions["val"]) & set(expressions["test"])


def test_splits_are_disjoint_across_seeds() -> None:
    train = {p.solution for seed in range(3) for p in synthetic_problems("train", 300, seed=seed)}
    test = {p.solution for seed in range(3) for p in synthetic_problems("test", 100, seed=seed)}
    assert not train & test


def test_synthetic_fields_and_correct_answers(large_splits: dict[str, list[Problem]]) -> None:
    for split, problems in large_splits.items():
        for index, problem in enumerate(problems):
            assert problem.id == f"syn-{split}-{index:05d}"
            assert problem.source == "synthetic"
            assert problem.answer == str(evaluate(problem.solution))
            assert problem.question.isascii() and "×" not in problem.question


def test_levels_are_mixed_round_robin(large_splits: dict[str, list[Problem]]) -> None:
    assert Counter(p.level for p in large_splits["train"]) == {1: 500, 2: 500, 3: 500, 4: 500}
    assert [p.level for p in synthetic_problems("test", 8, levels=(2, 4))] == [2, 4] * 4


def test_small_levels_run_out_and_the_rest_fill_in(large_splits: dict[str, list[Problem]]) -> None:
    # Level 3 has 421 test expressions: at n=2000 it runs out and the other levels fill in.
    level_3_in_test = sum(p.level == 3 for p in large_splits["test"])
    assert level_3_in_test == 421
    assert len(large_splits["test"]) == 2000
    with pytest.raises(ValueError, match="distinct 'test' problems"):
        synthetic_problems("test", 422, levels=(3,))


def test_level_shapes() -> None:
    shapes = {
        1: r"\d\d\d [+-] \d\d\d",
        2: r"\d\d \+ \d\d [+-] \d\d",
        3: r"\d\d\d? \* [2-9]",
        4: r"\(\d\d \+ \d\d\) \* [2-9]",
    }
    for level, shape in shapes.items():
        for problem in synthetic_problems("train", 200, levels=(level,), seed=level):
            assert problem.level == level and re.fullmatch(shape, problem.solution), problem
            assert int(problem.answer) >= 0


def test_questions_use_several_templates_and_word_problems() -> None:
    questions = [p.question for p in synthetic_problems("train", 400, levels=(1, 2))]
    assert any(q.startswith("What is") for q in questions)
    assert any(q.startswith("Compute") for q in questions)
    assert any(" has " in q for q in questions)


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_derivations_are_correct_line_by_line(level: int) -> None:
    for problem in synthetic_problems("train", 500, levels=(level,), seed=7):
        text = worked_solution(problem, "derive")
        assert text.startswith(" ") and not text.startswith("  ")
        *body, last = text.split("\n")
        assert last == f"\\boxed{{{problem.answer}}}"
        results = []
        for line in body:
            step = STEP_LINE.fullmatch(line)
            if step:
                x, op, y, z = step.groups()
                assert evaluate(f"{x} {op} {y}") == int(z), (problem, line)
                results.append(int(z))
        assert results[-1] == int(problem.answer)
        assert text.rfind("\\boxed") >= GATE


def test_guess_is_the_bare_box_below_the_gate() -> None:
    for problem in synthetic_problems("train", 40):
        text = worked_solution(problem, "guess")
        assert text == f" \\boxed{{{problem.answer}}}"
        assert text.rfind("\\boxed") < GATE


def synthetic(level: int, expression: str) -> Problem:
    answer = str(evaluate(expression))
    return Problem(
        id="s",
        question=f"What is {expression}?",
        answer=answer,
        source="synthetic",
        level=level,
        solution=expression,
    )


def test_worked_solution_examples() -> None:
    assert worked_solution(synthetic(1, "347 + 258"), "derive") == (
        " Let's solve it step by step.\nWe add by place value.\n300 + 200 = 500\n40 + 50 = 90\n"
        "7 + 8 = 15\n500 + 90 = 590\n590 + 15 = 605\nThe final answer is:\n\\boxed{605}"
    )
    assert worked_solution(synthetic(3, "23 * 7"), "derive") == (
        " Let's solve it step by step.\nSplit 23 into 20 + 3.\n20 * 7 = 140\n3 * 7 = 21\n"
        "140 + 21 = 161\nThe final answer is:\n\\boxed{161}"
    )
    assert (
        "\nSplit 943 into 900 + 40 + 3.\n900 * 9 = 8100\n40 * 9 = 360\n3 * 9 = 27\n"
        "8100 + 360 = 8460\n8460 + 27 = 8487\n"
        in worked_solution(synthetic(3, "943 * 9"), "derive")
    )
    assert "\n100 * 8 = 800\nThe final" in worked_solution(synthetic(4, "(60 + 40) * 8"), "derive")
    assert "\n473 - 100 = 373\n373 - 40 = 333\n333 - 8 = 325\n" in worked_solution(
        synthetic(1, "473 - 148"), "derive"
    )
    assert "\n58 - 30 = 28\n28 - 7 = 21\n" in worked_solution(
        synthetic(2, "19 + 39 - 37"), "derive"
    )
    assert worked_solution(synthetic(4, "(23 + 45) * 7"), "guess") == " \\boxed{476}"


def test_worked_solution_survives_save_and_load(tmp_path: Path) -> None:
    problems = synthetic_problems("val", 12)
    save_problems(problems, tmp_path / "val.jsonl")
    loaded = load_problems(tmp_path / "val.jsonl")
    assert [worked_solution(p, "derive") for p in loaded] == [
        worked_solution(p, "derive") for p in problems
    ]


def test_invalid_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="train, val, test"):
        synthetic_problems("dev", 3)
    with pytest.raises(ValueError, match="level"):
        synthetic_problems("train", 3, levels=(5,))
    problem = synthetic_problems("train", 1)[0]
    with pytest.raises(ValueError, match="derive, guess"):
        worked_solution(problem, "explain")
    with pytest.raises(ValueError, match="not a synthetic problem"):
        worked_solution(Problem(id="x", question="Q?", answer="1", source="math.jsonl"), "derive")
    tampered = Problem(
        id="t", question="Q?", answer="5", source="synthetic", level=1, solution="123 + 450"
    )
    with pytest.raises(ValueError, match="answer"):
        worked_solution(tampered, "derive")
