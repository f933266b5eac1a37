"""tools= beside TRL 1.16: tool-calling rollouts on the engine from the same sampled tokens give
TRL's conversations, completion ids, tool masks, tools/* metrics and gradient (within 1e-5
relative), with a toy calculator tool and with grpo_agent.py's SQL tool.

The embedded model never writes a tool call, so its turns are scripted (``ScriptedTurns``: the
engine runs every pass, the drawn tokens are replaced by a script's); TRL's generation is given
the same turns, matched by the sequence it is asked to continue."""

from __future__ import annotations

import ast
import operator
import sqlite3

import pytest
import torch

from rlvr_fast.models.checkpoint import packed_to_hf
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer
from trl_side_by_side import QUIET_CPU_RUN, ScriptedTurns, tool_model_dir, trl_modules

# docs/trl.md: one tool-calling step of the calculator test, prefill tokens on the engine and
# re-prefilled at every turn (token counts: the same on every machine).
PREFILLED, REPREFILLED = 252, 1_387
SETTINGS = dict(
    max_steps=1,
    num_generations=4,
    per_device_train_batch_size=8,
    max_completion_length=256,
    temperature=0.8,
    learning_rate=1e-3,
    loss_type="grpo",
    **QUIET_CPU_RUN,
)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: The expression, e.g. "2 + 3".
    """

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    return str(value(ast.parse(expression, mode="eval").body))


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def double(n: int) -> int:
    """Double a number (an async tool: awaited after the turn's sync calls, as TRL does).

    Args:
        n: The number.
    """
    return 2 * n


CALCULATOR_SCRIPTS = [
    [call("calculator", expression="2 + 3"), "It is 5"],
    ["I think 7"],
    # A tool error (a syntax error the tool raises), then a second call in the next round.
    [call("calculator", expression="2 +"), call("calculator", expression="4 * 6"), "so 24"],
    [call("search", q="x"), "no such tool"],  # an unknown tool
    ['<tool_call>{"name": broken</tool_call>'],  # does not parse: plain text
    # Two calls in one turn, the async one first.
    [call("double", n=4) + call("calculator", expression="1 + 1"), "8 and 2"],
]


def question_rows() -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in ((2, 3), (4, 6), (7, 1), (5, 5))
    ]


class Recorder:
    """A reward function that records the completions it is called with."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append(dict(completions=completions, completion_ids=completion_ids))
        return [float(len(str(c)) % 5) for c in completions]


def our_run(model_dir, tools, scripts, rows, tmp_path, monkeypatch, eval_rows=None, **settings):
    """Our trainer's run (one step by default) with scripted turns: (trainer, recorder, first
    step's gradient, first log); ``trainer.steps`` holds every step's (gradient, weights)."""
    from datasets import Dataset

    recorder = Recorder()
    args = GRPOConfig(output_dir=str(tmp_path / "ours"), **{**SETTINGS, **settings})
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=recorder,
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=None if eval_rows is None else Dataset.from_list(eval_rows),
        tools=tools,
    )
    engine = trainer.trainer.engine
    before = engine.counters.prefill_run
    with monkeypatch.context() as patch:
        ScriptedTurns(trainer.processing_class, scripts).install(patch)
        trainer.steps = []
        clip = trainer.trainer.stepping.clip_gradients

        def capture():
            params = dict(trainer.policy.model.named_parameters())
            grads = {n: p.grad.clone() for n, p in params.items()}
            weights = {n: p.detach().clone() for n, p in params.items()}
            config = trainer.policy.config
            trainer.steps.append((packed_to_hf(grads, config), packed_to_hf(weights, config)))
            return clip()

        trainer.trainer.stepping.clip_gradients = capture
        trainer.train()
    trainer.prefilled = engine.counters.prefill_run - before  # the run's
    return trainer, recorder, trainer.steps[0][0], trainer.state.log_history[0]


def trl_run(
    trl, model_dir, tools, rows, prompt_ids, sequences, turns, tmp_path, at=None, **settings
):
    """TRL's trainer on the same rows, its generation given our turns: (trainer, recorder,
    gradient, prepared inputs); ``at``: (generation weights, update weights) of a second
    iteration on the generation (num_iterations 2), whose gradient it is then."""
    from datasets import Dataset

    recorder = Recorder()
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **{**SETTINGS, **settings})
    trainer = trl.GRPOTrainer(
        model=str(model_dir),
        reward_funcs=recorder,
        args=args,
        train_dataset=Dataset.from_list(rows),
        tools=tools,
    )
    calls = []

    def generate(prompt_ids_asked, *args, **kwargs):
        if not calls:  # the first turn of every row, in row order
            calls.append(len(prompt_ids_asked))
            return [
                seq[len(p) : len(p) + t[0]] for seq, p, t in zip(sequences, prompt_ids, turns)
            ], None
        calls.append(len(prompt_ids_asked))
        return [next_turn(asked, prompt_ids, sequences, turns) for asked in prompt_ids_asked], None

    trainer._generate_single_turn = generate
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    batch = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows for _ in range(4)]
    batch = batch[: args.per_device_train_batch_size]
    load(trainer, at[0] if at else None)
    trainer._step = 0
    inputs = trainer._prepare_inputs(batch)
    if at:  # a later iteration on the buffered generation, at the weights it reached
        load(trainer, at[1])
        trainer._step = 1
        inputs = trainer._prepare_inputs(batch)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    return trainer, recorder, grads, inputs


def load(trainer, weights) -> None:
    if weights is not None:
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                param.copy_(weights[name])


def next_turn(asked, prompt_ids, sequences, turns) -> list[int]:
    """Our sampled turn that follows ``asked`` (a prompt, its completion so far and a tool
    turn) in the row whose sequence it begins."""
    for sequence, prompt, row_turns in zip(sequences, prompt_ids, turns):
        if sequence[: len(asked)] != asked:
            continue
        done = len(prompt)
        for index, count in enumerate(row_turns):
            if done == len(asked) and index % 2 == 0:
                return sequence[done : done + count]
            done += count
    raise AssertionError("TRL asked to continue a sequence our rollouts do not have")


def assert_gradient_within(ours, theirs, rel: float) -> float:
    scale = max(float(g.abs().max()) for g in theirs.values())
    assert scale > 0
    worst = max(float((ours[n] - g).abs().max()) for n, g in theirs.items()) / scale
    assert worst <= rel, worst
    return worst


def side_by_side(tmp_path, monkeypatch, tools, scripts, rows, second=False, **settings):
    """Our step and TRL's from the same turns (``second``: the second update on the
    generation, num_iterations 2)."""
    trl = trl_modules()
    model_dir = tool_model_dir(tmp_path)
    ours, our_recorder, our_grad, logs = our_run(
        model_dir, tools, scripts, rows, tmp_path, monkeypatch, **settings
    )
    at = None
    if second:
        (_, first), (our_grad, later) = ours.steps
        at = (first, later)
    groups = ours.task.groups
    prompt_ids = [ours.task.encoded[g.row] for g in groups for _ in g.completion_ids]
    completions = [c for g in groups for c in g.completion_ids]
    sequences = [p + c for p, c in zip(prompt_ids, completions)]
    masks = [m for g in groups for m in g.masks]
    turns = [turns_of(mask) for mask in masks]
    from trl.trainer import grpo_trainer

    # One micro-batch: the order of its rows changes no figure; unshuffled, masks compare by row.
    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)
    theirs, their_recorder, their_grad, inputs = trl_run(
        trl, model_dir, tools, rows, prompt_ids, sequences, turns, tmp_path, at, **settings
    )
    (mine,), (their,) = our_recorder.calls, their_recorder.calls
    assert mine["completion_ids"] == their["completion_ids"]
    assert mine["completions"] == their["completions"]
    their_masks = [
        row[: len(ids)].tolist() for row, ids in zip(inputs["tool_mask"], their["completion_ids"])
    ]
    assert masks == their_masks
    for name in ("tools/call_frequency", "tools/failure_frequency"):
        assert logs[name] == pytest.approx(theirs._metrics["train"][name][0]), name
    worst = assert_gradient_within(our_grad, their_grad, 1e-5)
    # Each prompt prefilled once (its group forked), then each tool turn and the sampled token
    # before it: the conversation so far is never run again.
    prompts = [len(ours.task.encoded[g.row]) for g in groups]
    appended = [n for t in turns for n in t[1::2]]
    if second:
        return mine["completions"], masks, ours.state.log_history[1], worst
    assert ours.prefilled == sum(prompts) + sum(appended) + len(appended)
    row_prompts = [len(p) for p in prompt_ids]
    logs["reprefilled"] = reprefilled(row_prompts, masks)
    logs["prefilled"] = ours.prefilled
    return mine["completions"], masks, logs, worst


def reprefilled(prompt_lengths: list[int], masks: list[list[int]]) -> int:
    """The prefill of the same conversations when each turn prefills the whole sequence again
    (TRL's generate: each row's prompt, then at each later turn the prompt, the conversation so
    far and the tool turn)."""
    total = 0
    for prompt, mask in zip(prompt_lengths, masks):
        runs, done = turns_of(mask), 0
        total += prompt
        for index, count in enumerate(runs):
            done += count
            if index % 2 == 1 and index + 1 < len(runs):  # a tool turn, then a sampled one
                total += prompt + done
    return total


def turns_of(mask: list[int]) -> list[int]:
    """A mask's runs (sampled, appended, sampled, ...)."""
    runs, current, value = [], 0, 1
    for m in mask:
        if m != value:
            runs.append(current)
            current, value = 0, m
        current += 1
    return runs + [current]


def test_calculator_conversations_masks_and_gradient_are_trls(tmp_path, monkeypatch):
    completions, masks, logs, worst = side_by_side(
        tmp_path, monkeypatch, [calculator, double], CALCULATOR_SCRIPTS, question_rows()[:2]
    )
    first = completions[0]
    assert [m["role"] for m in first] == ["assistant", "tool", "assistant"]
    assert first[1] == {"role": "tool", "name": "calculator", "content": "5"}
    assert "error" in completions[2][1]["content"] and completions[2][3]["content"] == "24"
    assert completions[3][1]["content"] == "{'error': 'Tool search not found.'}"
    assert completions[4] == [
        {"role": "assistant", "content": '<tool_call>{"name": broken</tool_call>'}
    ]
    # The sync call's result first, then the async one's.
    assert [m.get("content") for m in completions[5][1:3]] == ["2", "8"]
    assert 0 in masks[0] and set(masks[1]) == {1}
    # 8 rows: 7 calls (rows 2 and 5 call twice), 2 failures (an error, an unknown tool).
    assert logs["tools/call_frequency"] == pytest.approx(7 / 8)
    assert logs["tools/failure_frequency"] == pytest.approx(2 / 7)
    # docs/trl.md's figures: the step's prefill on the engine and re-prefilled at every turn.
    assert (logs["prefilled"], logs["reprefilled"]) == (PREFILLED, REPREFILLED)


def test_a_second_iteration_clips_against_the_masked_old_logprobs_as_trls(tmp_path, monkeypatch):
    """num_iterations 2: the second update reuses the conversations and their old
    log-probabilities (of the sampled tokens only) at the first update's weights; TRL's
    gradient at the same weights within 1e-5, and the ratio moved enough to clip."""
    _, _, logs, _ = side_by_side(
        tmp_path,
        monkeypatch,
        [calculator, double],
        CALCULATOR_SCRIPTS,
        question_rows()[:2],
        second=True,
        num_iterations=2,
        max_steps=2,
        epsilon=0.02,
    )
    assert logs["clip_ratio/region_mean"] > 0, "the case clips nothing"


def test_a_tool_turn_past_the_completion_cap_is_left_out_as_trls(tmp_path, monkeypatch):
    """A cap that the first call's turn (74 tokens) fits and its tool turn passes: the
    conversation ends at the call, unanswered, as TRL's."""
    completions, masks, logs, _ = side_by_side(
        tmp_path,
        monkeypatch,
        [calculator, double],
        CALCULATOR_SCRIPTS,
        question_rows()[:2],
        max_completion_length=80,
    )
    assert [m["role"] for m in completions[0]] == ["assistant"]
    assert "tool_calls" in completions[0][0]
    assert all(set(mask) == {1} for mask in masks)
    # Rows of scripts 0, 2, 3 and 0 call, their tool turns left out; script 5's two calls are
    # cut by the cap inside the second, so its turn is text.
    assert logs["tools/call_frequency"] == pytest.approx(4 / 8)
    assert "tool_calls" not in completions[5][0]


def test_max_tool_calling_iterations_stops_the_rounds_as_trls(tmp_path, monkeypatch):
    completions, _, _, _ = side_by_side(
        tmp_path,
        monkeypatch,
        [calculator, double],
        CALCULATOR_SCRIPTS,
        question_rows()[:2],
        max_tool_calling_iterations=1,
    )
    # The row that calls twice stops after its first round: its second call is not run.
    assert [m["role"] for m in completions[2]] == ["assistant", "tool", "assistant"]
    assert "tool_calls" in completions[2][2]


def biogrid_database(path) -> None:
    """A stand-in of grpo_agent.py's BioGRID table: two interactions."""
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE interactions (Alt_IDs_Interactor_A TEXT, Alt_IDs_Interactor_B TEXT)"
        )
        conn.executemany(
            "INSERT INTO interactions VALUES (?, ?)", [("JNKK", "MAPK8"), ("TP53", "MDM2")]
        )


def test_grpo_agents_sql_tool_gives_trls_conversations_and_gradient(tmp_path, monkeypatch):
    database = tmp_path / "biogrid.db"
    biogrid_database(database)

    def query_biogrid(sql_command: str) -> list[tuple]:
        """Execute a read-only SQL command on the BioGRID database.

        Args:
            sql_command: The SQL command to execute.
        """
        conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
        try:
            return conn.execute(sql_command).fetchall()
        finally:
            conn.close()

    where = "SELECT * FROM interactions WHERE Alt_IDs_Interactor_A = 'TP53'"
    scripts = [
        [call("query_biogrid", sql_command=where), "*yes*"],
        [call("query_biogrid", sql_command="SELECT * FROM nowhere"), "*no*"],
        ["*no*"],
        [call("query_biogrid", sql_command="PRAGMA table_info(interactions)"), "done"],
    ]
    completions, masks, logs, worst = side_by_side(
        tmp_path, monkeypatch, [query_biogrid], scripts, question_rows()[:2]
    )
    assert completions[0][1]["content"] == [("TP53", "MDM2")]  # a list result is kept a list
    assert "no such table" in completions[1][1]["content"]
    assert logs["tools/failure_frequency"] == pytest.approx(2 / 6)


def test_what_tools_cannot_run_on_is_refused_by_name(tmp_path):
    """A template that cannot render a tool call (TRL's error), the study's arms and sum loss,
    its ledger, and prompts that are not conversations."""
    from datasets import Dataset

    from trl_side_by_side import chat_model_dir, text_rows

    rows = Dataset.from_list(question_rows())

    def build(model, train_dataset=rows, **settings):
        args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**SETTINGS, **settings})
        return GRPOTrainer(
            model=str(model),
            reward_funcs=Recorder(),
            args=args,
            train_dataset=train_dataset,
            tools=[calculator],
        )

    with pytest.raises(ValueError, match="does not support tool calling"):
        build(chat_model_dir(tmp_path))
    with pytest.raises(ValueError, match="tools= is not supported by rlvr_fast with arm="):
        build(tool_model_dir(tmp_path), loss_type="sum")
    with pytest.raises(ValueError, match="with ledger=True: the study's ledger"):
        build(tool_model_dir(tmp_path), ledger=True)
    with pytest.raises(ValueError, match="tools= needs conversational prompts"):
        build(tool_model_dir(tmp_path), train_dataset=Dataset.from_list(text_rows(8)))


def test_evaluation_runs_the_tool_loop_and_logs_its_own_tools_metrics(tmp_path, monkeypatch):
    """eval_dataset with tools: the evaluation's completions are conversations too (TRL runs
    the tool loop there), logged as eval_tools/*; the step's tools/* stay the training batch's.
    The scripts cycle on: training rows get scripts 0-5, 0, 1; evaluation rows 2-5, 0-3."""
    rows = question_rows()
    trainer, _, _, logs = our_run(
        tool_model_dir(tmp_path),
        [calculator, double],
        CALCULATOR_SCRIPTS,
        rows[:2],
        tmp_path,
        monkeypatch,
        eval_rows=rows[2:],
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=8,
    )
    evaluation = next(log for log in trainer.state.log_history if "eval_loss" in log)
    assert logs["tools/call_frequency"] == pytest.approx(7 / 8)
    # Calls 2, 1, 0, 2, 1, 0, 2, 1; failures: the bad expression twice, the unknown tool twice.
    assert evaluation["eval_tools/call_frequency"] == pytest.approx(9 / 8)
    assert evaluation["eval_tools/failure_frequency"] == pytest.approx(4 / 9)
    assert evaluation["eval_completions/max_length"] < 256


def test_async_tools_and_rewards_are_awaited_inside_a_running_event_loop():
    """In a notebook the thread's event loop already runs (asyncio.run refuses there): the
    coroutines are awaited on a worker thread's loop, an exception returned as TRL returns it."""
    import asyncio

    from rlvr_fast.trl_compat.rewards import await_all

    async def fails():
        raise ValueError("no")

    async def inside_a_loop():
        return await_all([double(3), double(4)]), await_all([fails()], return_exceptions=True)

    results, (error,) = asyncio.run(inside_a_loop())
    assert results == [6, 8] and isinstance(error, ValueError)
    assert await_all([double(5)]) == [10]
