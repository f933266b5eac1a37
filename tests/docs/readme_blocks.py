"""The fenced blocks of README.md and docs/*.md and what each one's marker says to do with it.

Every fenced block of README.md and of each page of docs/ is preceded by a marker, an HTML comment (invisible in the
rendered page) holding one JSON object:

- ``{"run": "all"}`` or ``{"run": [1, 4]}``: run every command of the block, or those numbered
  (a command is a line with its ``\\`` continuations; ``# ...`` comments are dropped), in order,
  in one scratch directory; ``"append": {"1": "--steps 3"}`` adds arguments to a command, for
  tiny settings where the printed one takes minutes (or a wall-clock budget a CI machine busy
  with other tests needs to reach the verdicts README shows). ``make TARGET`` runs the target's recipe
  from the Makefile (the install it depends on is the test suite's own). Python blocks marked
  ``run`` execute in order in one namespace; ``"set": {"max_steps": 2}`` replaces the value of
  every keyword argument of that name in the block's calls.
- ``{"output": "make demo", "exact": [1, 2], "arithmetic": FINGERPRINT}``: the block is what the
  named command (of the run block before it, on the same page) prints. On a machine of that arithmetic
  (``tests/arithmetic.py``; without ``arithmetic``, on any machine: figures that no float sum
  decides) the lines numbered in ``exact`` must appear as printed; elsewhere, and for the other
  lines, with any number in place of each number. ``...`` matches anything in either.
- ``{"skip": "why"}``: the block is not run, for the reason given.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The pages whose blocks are run: README first, then docs/ (each page's blocks in its own order).
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- test: (\{.*\}) -->$")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: dict | None
    commands: list[str] = field(default_factory=list)
    page: Path = README

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(path: Path = README) -> list[Block]:
    """Every fenced block of ``path`` with the marker on the line before it (None: none)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if not lines[index].lstrip().startswith("```"):
            index += 1
            continue
        # A block inside a list item is indented: its lines lose the fence's indentation.
        indent = len(lines[index]) - len(lines[index].lstrip())
        start, lang = index, lines[index].strip()[3:].strip()
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("```"))
        previous = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        found = MARKER.match(previous.strip())
        marker = json.loads(found.group(1)) if found else None
        text = "\n".join(line[indent:] for line in lines[start + 1 : end])
        block = Block(start + 1, lang, text, marker, page=path)
        if lang == "bash":
            block.commands = shell_commands(text)
        blocks.append(block)
        index = end + 1
    return blocks


def shell_commands(text: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped; a
    redirection or pipe written as a word of its own (``> FILE``, ``| tee``) stays one."""
    commands, pending = [], ""
    for line in text.splitlines():
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        words = shlex.split(pending, comments=True)
        if words:
            commands.append(" ".join(w if w in SHELL_OPERATORS else shlex.quote(w) for w in words))
        pending = ""
    return commands


SHELL_OPERATORS = ("|", ">", ">>", "<")


def selected_commands(block: Block) -> list[str]:
    """The commands the block's marker runs, with their appended arguments."""
    run = block.marker["run"]
    numbers = range(1, len(block.commands) + 1) if run == "all" else run
    appended = block.marker.get("append", {})
    return [
        " ".join(filter(None, [block.commands[n - 1], appended.get(str(n), "")])) for n in numbers
    ]


def make_recipe(target: str, bin_dir: Path, makefile: Path = ROOT / "Makefile") -> list[str]:
    """The shell lines of ``target``'s recipe with ``$(BIN)`` as ``bin_dir``."""
    lines = makefile.read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if re.match(rf"^{re.escape(target)}:", line))
    recipe = []
    for line in lines[head + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    joined = " ".join(line.rstrip("\\").strip() for line in recipe)
    joined = joined.replace("$(BIN)", str(bin_dir))
    if "$(" in joined:
        raise ValueError(f"make {target}: recipe uses a variable this test does not expand")
    return [joined]


class KeywordSetter(ast.NodeTransformer):
    """Every call's keyword argument named in ``values`` set to that value."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        for keyword in node.keywords:
            if keyword.arg in self.values:
                keyword.value = ast.Constant(self.values[keyword.arg])
        return node


def python_source(block: Block) -> str:
    values = block.marker.get("set", {})
    tree = ast.parse(block.text, filename=block.where)
    return ast.unparse(KeywordSetter(values).visit(tree)) if values else block.text


def line_pattern(line: str, numbers_free: bool = True) -> re.Pattern:
    """``line`` with anything where it has ``...`` and, if ``numbers_free``, any number where it
    has a number."""
    parts = []
    for piece in re.split(r"(\.\.\.)", line.strip()):
        if piece == "...":
            parts.append(".*")
            continue
        if not numbers_free:
            parts.append(re.escape(piece))
            continue
        last = 0
        for number in NUMBER.finditer(piece):
            parts.append(re.escape(piece[last : number.start()]) + r"\d[\d,]*(?:\.\d+)?")
            last = number.end()
        parts.append(re.escape(piece[last:]))
    return re.compile("^" + "".join(parts) + "$")
