"""``rlvr-fast train --config FILE`` and ``--print-config``: a run's options and settings in one
YAML file, like TRL's ``TrlParser`` recipes and LightningCLI's ``--config``.

The file is one mapping. A key is a ``train`` option's name with ``_`` for ``-`` (``arm``,
``model``, ``train_data``, ``steps``, ``seed``, ``out``, ``precision``, ``device``, ...), or a
setting (``rlvr-fast train --help-settings``); ``eval`` maps names to data (``{test:
synthetic:test:200}``). Options given on the command line override the file's (``--eval`` adds
sets to the file's), and ``--set KEY=VALUE`` its settings. An unknown key is refused with the
nearest names, a value of the wrong type naming the type, before anything runs.
``--print-config`` writes the resolved run in this form, which ``--config`` reads back to the
same run signature.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import yaml

from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.fields import nearest_names
from rlvr_fast.train.settings_reference import settings

# A config file this large is not one.
MAX_CONFIG_FILE_BYTES = 1 << 20
# Options of the command that are about this invocation, not about the run.
NOT_IN_FILE = ("help", "config", "print_config", "help_settings", "set")
# YAML 1.1, which PyYAML reads, takes 1e-5 for a string; YAML 1.2 and JSON for a number.
FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$")


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats (``1e-5`` is a number)."""


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", FLOAT, list("-+0123456789."))


def config_path(argv: list[str]) -> Path | None:
    """The ``--config FILE`` of a ``train`` command line, read before the full parse (the file
    supplies defaults of that parse, --arm and --out among them)."""
    if not argv or argv[0] != "train":
        return None
    found = argparse.ArgumentParser(add_help=False)
    found.add_argument("--config", type=Path)
    return found.parse_known_args(argv[1:])[0].config


def read_config_file(path: Path) -> dict:
    """The file's mapping; a file that is not one is a one-line error naming it."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read(MAX_CONFIG_FILE_BYTES + 1)
    if len(text) > MAX_CONFIG_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CONFIG_FILE_BYTES:,} bytes: not a config file")
    try:
        values = yaml.load(text, Loader=ConfigLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}: not YAML{where}: {getattr(err, 'problem', err)}") from None
    if values is None:
        return {}
    if not isinstance(values, dict) or not all(isinstance(key, str) for key in values):
        raise ValueError(f"{path}: expected a mapping of option and setting names to values")
    return values


def apply_config_file(parser: argparse.ArgumentParser, path: Path) -> None:
    """Make the file's options the defaults of ``parser`` (the ``train`` parser) and its
    settings those of ``--set``; an option the file gives is no longer required."""
    values = read_config_file(path)
    actions = {a.dest: a for a in parser._actions if a.dest not in NOT_IN_FILE}
    setting_names = [s.name for s in settings()]
    options, file_settings = {}, {}
    for key, value in values.items():
        if key in actions:
            options[key] = option_value(actions[key], value, f"{path}: {key}")
            actions[key].required = False
        elif key in setting_names:
            file_settings[key] = list(value) if isinstance(value, tuple) else value
        else:
            nearest = nearest_names(key, [*actions, *setting_names])
            hint = f" (did you mean {' or '.join(nearest)}?)" if nearest else ""
            raise ValueError(f"{path}: unknown key {key!r}{hint}")
    parser.set_defaults(**options, config_settings=file_settings)


def option_value(action: argparse.Action, value, where: str):
    """A file's value for ``action`` as the command line would have given it."""
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        return eval_list(value, where)
    if value is None and action.default is None:
        return None  # null: the option not given
    kind = action.type or str
    accepted = {int: (int,), float: (int, float)}.get(kind, (str,))
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise ValueError(f"{where}: expected {TYPE_WORDS.get(kind, 'a string')}, got {value!r}")
    value = kind(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(
            f"{where}: expected one of {', '.join(map(str, action.choices))}, got {value!r}"
        )
    return value


TYPE_WORDS = {int: "an integer", float: "a number"}


def eval_list(value, where: str) -> list[str]:
    """``eval``: a mapping of names to data, or a list of NAME=DATA, as --eval takes them."""
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return [f"{name}={data}" for name, data in value.items()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ValueError(f"{where}: expected a mapping of names to data, got {value!r}")


def resolved_config_yaml(args: argparse.Namespace, config: TrainConfig) -> str:
    """The run ``args`` and ``config`` describe, as a file ``--config`` reads back: the options
    (those that are settings as the resolved ``config`` holds them), then every other setting
    by section."""
    names = [s.name for s in settings()]
    skipped = {*NOT_IN_FILE, "command", "config_settings", "no_cuda_graphs"}  # cuda_graphs below
    options = {
        dest: yaml_value(getattr(config, dest) if dest in names else value, dest)
        for dest, value in vars(args).items()
        if dest not in skipped
    }
    lines = [
        "# rlvr-fast train --config FILE runs this; options given on the command line",
        "# override the file's, --set KEY=VALUE its settings.",
        "# Options (rlvr-fast train --help):",
        dump(options),
        "# Settings (rlvr-fast train --help-settings):",
    ]
    section = None
    for setting in settings():
        if setting.name in options:
            continue
        if setting.section != section:
            section = setting.section
            lines.append(f"# {section}")
        lines.append(dump({setting.name: yaml_value(getattr(config, setting.name), setting.name)}))
    return "\n".join(lines) + "\n"


def yaml_value(value, name: str):
    if name == "eval":
        return dict(spec.partition("=")[::2] for spec in value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def dump(values: dict) -> str:
    """One ``key: value`` line per entry, each value in YAML's flow style."""
    return "\n".join(f"{key}: {flow(value)}" for key, value in values.items())


def flow(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return text.removesuffix("\n").removesuffix("\n...").strip()
