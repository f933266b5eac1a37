"""``tools=`` of TRL 1.16's GRPOTrainer on rlvr_fast's engine: tool-calling rollouts.

Each completion is a conversation. Its first turn is sampled as any completion; the turn is
parsed by the tokenizer's response parser (transformers' ``parse_response``, with the prompt
before it as ``prefix`` and the tools' schemas; a turn it cannot parse is plain text, decoded
without special tokens). When the turn calls tools, each call runs (a sync function, or an
``async def`` one: a row's coroutines are awaited together, their results after the sync ones'),
its result becomes a tool message ``{"role": "tool", "name": ..., "content": str(result)}`` (a
list result as it is), and an exception (an unknown tool, a call of another type, anything the
tool raises) becomes the content ``{'error': message}`` and counts as a failure. The tool
messages are rendered by the chat template as TRL renders them (the tool turn after a dummy
conversation, cut after the end-of-sequence token of the turn before) and appended to the live
sequence (``rlvr_fast.rollouts.turns``: an ``extend``, never a new prefill of the conversation),
and the completion continues from there, for at most ``max_tool_calling_iterations`` rounds.
A tool turn that would pass max_completion_length (or reach the model's length) is not
appended: the conversation ends there, without it. The appended tokens are out of the loss
(mask 0), as TRL's ``tool_mask``; the reward functions get each completion as its message list.
"""

from __future__ import annotations

import inspect
import sys

from rlvr_fast.ops.loss_types import loss_type
from rlvr_fast.rollouts.turns import TurnsOutput
from rlvr_fast.trl_compat.rewards import await_all

# What TRL checks a template renders: a tool call's name, argument and a tool message's content.
_SENTINELS = ("tool_name_s1", "tool_arg_key_s2", "tool_arg_value_s3", "tool_content_s4")


def renders_tool_calls(tokenizer) -> bool:
    """Whether the chat template renders a user -> assistant (tool call) -> tool exchange with
    every part of it in the text."""
    if tokenizer.chat_template is None:
        return False
    name, key, value, content = _SENTINELS
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [_call(name, {key: value})]},
        {"role": "tool", "name": name, "content": content},
    ]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # jinja2's TemplateError and the errors of templates that index content
        return False
    return all(s in rendered for s in _SENTINELS)


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def parse_turn(tokenizer, ids: list[int], prefix: list[int], tools: list) -> dict:
    """One sampled turn as an assistant message (module docstring): content always a string
    (the end-of-sequence text cut), tool calls checked; plain text when it does not parse."""
    try:
        if getattr(tokenizer, "response_template", None) is not None:
            parsed = tokenizer.parse_response(ids, prefix=prefix, tools=tools)
        else:
            parsed = tokenizer.parse_response(ids)
        if parsed is None:
            raise ValueError("nothing parsed")
        if isinstance(parsed.get("content"), str):
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            check_tool_calls(parsed["tool_calls"])
    except (ValueError, TypeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def check_tool_calls(calls) -> None:
    """ValueError on a malformed list of tool calls; missing arguments read as {}."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    for call in calls:
        if not isinstance(call, dict):
            raise ValueError("a tool call must be a dict")
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call needs a name")
        if function.get("arguments") is None:
            function["arguments"] = {}


def tool_calling(tools, tokenizer, args, policy) -> ToolCalling | None:
    """The run's ``ToolCalling`` (None without tools); refused by name with what it does not
    run on: the study's arms, tree rollouts and sum loss, whose rollouts are no conversations,
    and its ledger."""
    if not tools:
        return None
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of functions, got {type(tools).__name__}")
    if args.arm is not None or args.tree or not loss_type(args.loss_type).fused:
        raise ValueError(
            "GRPOTrainer: tools= is not supported by rlvr_fast with arm=, tree=True or "
            "loss_type='sum': tool calling runs on flat groups with TRL's loss types"
        )
    if args.ledger:
        raise ValueError(
            "GRPOTrainer: tools= is not supported by rlvr_fast with ledger=True: the study's "
            "ledger records single-turn completions (its laws count one sampled turn each, "
            "and verify re-derives no tool turn)"
        )
    return ToolCalling(list(tools), tokenizer, args, policy.config.max_position_embeddings)


class ToolCalling:
    """The tools of a run and the conversations of the rows sampled last (``begin`` a batch,
    ``next_turn`` as the engine's rows end their turns, ``end`` it); counts of calls and
    failures for TRL's tools/* metrics."""

    def __init__(self, tools: list, tokenizer, args, max_model_len: int) -> None:
        if not all(callable(tool) for tool in tools):
            raise TypeError("tools must be a list of functions")
        if not renders_tool_calls(tokenizer):
            raise ValueError(
                "The provided chat template does not support tool calling. The template must be "
                "able to render a full tool-calling conversation (user -> assistant with "
                "tool_calls -> tool)."
            )
        self.tokenizer, self.tools = tokenizer, list(tools)
        self.chat_template = _training_template(tokenizer)
        _add_response_parser(tokenizer)
        self.sync_tools = {t.__name__: t for t in tools if not inspect.iscoroutinefunction(t)}
        self.async_tools = {t.__name__: t for t in tools if inspect.iscoroutinefunction(t)}
        iterations = args.max_tool_calling_iterations
        self.max_rounds = sys.maxsize if iterations is None else iterations
        self.max_completion_length, self.max_model_len = args.max_completion_length, max_model_len
        self.template_kwargs = args.chat_template_kwargs or {}
        self.calls = self.failures = 0

    def encode_prompt(self, prompt: list[dict]) -> list[int]:
        """A conversational prompt's ids, the tools' schemas rendered in it."""
        if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            raise ValueError(
                "GRPOTrainer: tools= needs conversational prompts (lists of messages), got "
                f"{type(prompt).__name__}"
            )
        return list(
            self.tokenizer.apply_chat_template(
                [prompt],
                tools=self.tools or None,
                chat_template=self.chat_template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **self.template_kwargs,
            )["input_ids"][0]
        )

    # ------------------------------------------------------------------ a batch
    def begin(self, prompt_ids: list[list[int]], group: int):
        """Start a batch of ``group`` rows per prompt; returns ``next_turn`` for
        ``sample_turns``."""
        self.row_prompts = [p for p in prompt_ids for _ in range(group)]
        rows = len(self.row_prompts)
        self.conversations: list[list[dict]] = [[] for _ in range(rows)]
        self.turn_starts = [0] * rows  # where each row's current sampled turn starts
        self.parsed = [False] * rows  # whether that turn is in its conversation yet
        self.calls = self.failures = 0
        return self.next_turn

    def next_turn(self, row: int, completion: list[int]) -> list[int] | None:
        """Parse the row's turn; if it calls tools, run them and return the ids of the tool
        turn to append (None: the conversation ends)."""
        message = self._parse(row, completion)
        calls = message.get("tool_calls")
        if not calls:
            return None
        conversation = self.conversations[row]
        before = len(conversation)
        conversation += [
            {
                "role": "tool",
                "name": name,
                "content": content if isinstance(content, list) else str(content),
            }
            for name, content in self._run(calls)
        ]
        appended = self._tool_turn_ids(conversation[before:])
        length = len(completion) + len(appended)
        if (
            length > self.max_completion_length
            or len(self.row_prompts[row]) + length >= self.max_model_len
        ):
            del conversation[before:]
            return None
        self.turn_starts[row], self.parsed[row] = length, False
        return appended

    def end(self, out: TurnsOutput) -> list[list[dict]]:
        """The rows' conversations, each last sampled turn parsed (the rounds ran out, or it
        was the first and only)."""
        for row, completion in enumerate(out.tokens):
            if not self.parsed[row] and len(completion) > self.turn_starts[row]:
                self._parse(row, completion)
        self.masks = out.masks
        return self.conversations

    def metrics(self) -> dict[str, float]:
        """TRL's tools/* metrics of the batch: calls per completion, failures per call."""
        return {
            "tools/call_frequency": self.calls / len(self.row_prompts),
            "tools/failure_frequency": self.failures / self.calls if self.calls else 0.0,
        }

    def _parse(self, row: int, completion: list[int]) -> dict:
        start = self.turn_starts[row]
        message = parse_turn(
            self.tokenizer,
            completion[start:],
            self.row_prompts[row] + completion[:start],
            self.tools,
        )
        self.conversations[row].append(message)
        self.parsed[row] = True
        return message

    def _run(self, calls: list[dict]) -> list[tuple[str, object]]:
        """(name, result) of each call: the sync ones in order, then the async ones."""
        results, pending = [], []
        for call in calls:
            self.calls += 1
            if call.get("type") != "function":
                self.failures += 1
                results.append(
                    (
                        call.get("name", "unknown"),
                        {"error": f"Unsupported tool call type: {call.get('type')}"},
                    )
                )
                continue
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            try:
                if name in self.sync_tools:
                    results.append((name, self.sync_tools[name](**arguments)))
                elif name in self.async_tools:
                    pending.append((name, self.async_tools[name](**arguments)))
                else:
                    raise ValueError(f"Tool {name} not found.")
            except Exception as error:
                self.failures += 1
                results.append((name, {"error": str(error)}))
        if pending:
            outcomes = await_all([coroutine for _, coroutine in pending], return_exceptions=True)
            for (name, _), outcome in zip(pending, outcomes):
                if isinstance(outcome, Exception):
                    self.failures += 1
                    outcome = {"error": str(outcome)}
                results.append((name, outcome))
        return results

    def _tool_turn_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens the chat template puts after an assistant turn that called a tool: the
        tool messages and the next assistant header, rendered after a dummy conversation whose
        rendering is cut after its last end-of-sequence token."""
        dummy = [
            {"role": "user", "content": "dummy"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call(tool_messages[0]["name"], {})],
            },
        ]
        render = dict(
            tokenize=True,
            chat_template=self.chat_template,
            return_dict=False,
            **self.template_kwargs,
        )
        prefix = list(
            self.tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **render)
        )
        full = list(
            self.tokenizer.apply_chat_template(
                dummy + tool_messages, add_generation_prompt=True, **render
            )
        )
        ends = [i for i, token in enumerate(prefix) if token == self.tokenizer.eos_token_id]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError(
                "tools: the chat template renders the conversation before a tool message "
                "differently once the message follows (it is not prefix-preserving)"
            )
        return full[len(prefix) :]


def _training_template(tokenizer) -> str | None:
    """None (the tokenizer's own template) when it is prefix-preserving, as tool turns need;
    else TRL's training template for it (``trl.chat_template_utils``), refused by name without
    trl."""
    dummy = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": [_call("dummy", {})]},
    ]
    before = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False)
    after = tokenizer.apply_chat_template(
        dummy + [{"role": "tool", "name": "dummy", "content": "dummy"}],
        tokenize=True,
        return_dict=False,
        add_generation_prompt=True,
    )
    if list(after[: len(before)]) == list(before):
        return None
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        raise ValueError(
            "tools: the chat template is not prefix-preserving (a conversation renders "
            "differently once a tool message follows); give the tokenizer one that is, or "
            "install trl for its training templates"
        ) from None
    return get_training_chat_template(tokenizer)


def _add_response_parser(tokenizer) -> None:
    """A tokenizer without a response parser gets TRL's for its chat template
    (``trl.chat_template_utils.add_response_schema``), refused by name without trl."""
    if any(
        getattr(tokenizer, a, None) is not None for a in ("response_template", "response_schema")
    ):
        return
    try:
        from trl.chat_template_utils import add_response_schema
    except ImportError:
        raise ValueError(
            "tools: the tokenizer has no response_template to parse tool calls with; set one "
            "(transformers' response parsing) or install trl, which has them for known chat "
            "templates"
        ) from None
    add_response_schema(tokenizer)
