"""TRL's agent example: GRPO with a tool (SQL over the BioGRID database), multi-turn completions.

Source: huggingface/trl, examples/scripts/grpo_agent.py (TrlParser over ScriptArguments,
GRPOConfig and ModelConfig; qgallouedec/biogrid written to a SQLite file, qgallouedec/biogrid_qa's
"Does the gene ..." questions; tools=[query_biogrid]; correctness, structure and query rewards).
Adapted: both datasets are local directories under TRL_SCRIPT_DATA (biogrid/ and biogrid_qa/,
with the published columns); the model and sizes come from the command line.
"""

import os
import re
import signal
import sqlite3
import textwrap
from contextlib import contextmanager

from datasets import load_dataset
from trl import ModelConfig, ScriptArguments, TrlParser

from trl import GRPOConfig, GRPOTrainer  # drop-in: the line the tests swap


def query_reward(completions, answer, **kwargs):
    """Penalize more than 3 queries and generic ones, reward WHERE and supporting evidence."""
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        reward = 0.0
        sql_queries = []
        tool_results = []
        for turn in completion:
            if turn.get("tool_calls"):
                for call in turn["tool_calls"]:
                    sql = call["function"]["arguments"].get("sql_command", "").lower()
                    sql_queries.append(sql)
            if turn.get("role") == "tool" and turn.get("content"):
                tool_results.append(turn["content"])
        if len(sql_queries) > 3:
            reward -= 1.5
        where_count = 0
        for q in sql_queries:
            if "limit 1" in q:
                reward -= 1.0
            if " where " not in q:
                reward -= 0.5
            else:
                where_count += 1
        reward += min(where_count, 3) * 0.4
        combined_results = []
        error_detected = False
        for res in tool_results:
            if isinstance(res, dict) and "error" in res:
                error_detected = True
            elif isinstance(res, list):
                combined_results.extend(res)
        if error_detected:
            reward -= 2.0
        elif len(sql_queries) == 0:
            reward -= 1.5
        else:
            has_hits = len(combined_results) > 0
            correct_answer = ans.lower()
            if (has_hits and correct_answer == "yes") or (not has_hits and correct_answer == "no"):
                reward += 2.0
            else:
                reward -= 1.5
        rewards.append(reward)
    return rewards


def correctness_reward(completions, answer, **kwargs):
    """Reward a final *yes* or *no* that is right."""
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        raw = completion[-1]["content"].lower()
        match = re.search(r"\*(yes|no)\*", raw)
        guess = match.group(1) if match else None
        reward = 0.0
        if guess is None:
            reward -= 0.5
        elif guess == ans.lower():
            reward += 0.6
        else:
            reward -= 1.0
        rewards.append(reward)
    return rewards


def structure_reward(completions, **kwargs):
    """Reward a tool call followed by its response (and some text)."""
    rewards = []
    for completion in completions:
        has_call = False
        has_response = False
        has_other = False
        for turn in completion:
            role = turn.get("role")
            if role == "assistant" and turn.get("tool_calls"):
                has_call = True
            elif role == "tool":
                has_response = True
            else:
                content = turn.get("content")
                if content and content.strip() not in ["", "<think>"]:
                    has_other = True
        if has_call and has_response:
            reward = 0.1 if has_other else 0.05
        elif has_call and not has_response:
            reward = -0.15
        else:
            reward = 0.0
        rewards.append(reward)
    return rewards


class TimeoutError(Exception):
    """Raised when a function call times out."""


@contextmanager
def timeout(seconds):
    def timeout_handler(signum, frame):
        raise TimeoutError(f"Operation timed out after {seconds} seconds")

    signal.signal(signal.SIGALRM, timeout_handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def query_biogrid(sql_command: str) -> list[tuple]:
    """
    Execute a read-only SQL command on the BioGRID database.

    Args:
        sql_command: The SQL command to execute.

    Returns:
        A list of tuples containing the query results.
    """
    with timeout(5):
        conn = sqlite3.connect("file:biogrid.db?mode=ro", uri=True)
        cursor = conn.cursor()
        try:
            cursor.execute(sql_command)
            results = cursor.fetchall()
        finally:
            conn.close()
    return results


def format_example(example):
    question = example["question"]
    preamble = textwrap.dedent("""\
    You have access to the BioGRID SQLite database.
    Use SQL queries to retrieve only the information needed to answer the question.
    Final answer must be enclosed in stars, e.g. *Yes* or *No*.
    """)
    content = f"{preamble}\nQuestion: {question}"
    prompt = [{"role": "user", "content": content}]
    return {"prompt": prompt}


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()

    print("Creating biogrid.db...")
    biogrid_dataset = load_dataset(
        os.path.join(os.environ["TRL_SCRIPT_DATA"], "biogrid"), split="train"
    )
    df = biogrid_dataset.to_pandas()
    df.columns = [c.replace(" ", "_") for c in df.columns]
    conn = sqlite3.connect("biogrid.db")
    try:
        df.to_sql("interactions", conn, if_exists="replace", index=False)
        print(f"biogrid.db created. Rows stored: {len(df)}")
    finally:
        conn.close()

    dataset = load_dataset(os.path.join(os.environ["TRL_SCRIPT_DATA"], "biogrid_qa"), split="train")
    dataset = dataset.filter(lambda example: example["question"].startswith("Does the gene "))
    dataset = dataset.map(format_example, remove_columns=["question"])

    train_dataset = dataset
    eval_dataset = None

    training_args.chat_template_kwargs = {"enable_thinking": False}

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        tools=[query_biogrid],
        reward_funcs=[correctness_reward, structure_reward, query_reward],
        args=training_args,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
