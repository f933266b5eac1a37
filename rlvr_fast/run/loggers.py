"""Where a run's figures go besides its ledger (``--report-to``): TensorBoard event files under
RUN/tensorboard/ and a Weights & Biases run under RUN/wandb/, each step's figures
(``rlvr_fast.ledger.metrics``) as scalars at the number of steps done, tagged as TRL's
(Hugging Face's) integrations tag them: ``train/NAME`` for a training figure, ``eval/SET/NAME``
for an evaluation's. Either package is an optional extra (``pip install 'rlvr_fast[tensorboard]'``
or ``'rlvr_fast[wandb]'``): asking for one that is not installed fails before the run starts.

W&B runs offline (its files under RUN/wandb/, ``wandb sync`` uploads them) unless it has a login
(``WANDB_API_KEY``, or ``wandb login``'s entry in ~/.netrc) or ``WANDB_MODE`` says otherwise:
what wandb itself falls back to when a user declines to log in, without stopping at its prompt.
A resumed run continues the same W&B run (its id is derived from the run directory), and
TensorBoard hides what an earlier attempt logged past the step it resumes from."""

from __future__ import annotations

import hashlib
import importlib.util
import netrc
import os
from pathlib import Path
from typing import Protocol

REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}
WANDB_HOST = "api.wandb.ai"


def parse_report_to(text: str) -> tuple[str, ...]:
    """``--report-to``: "none", or comma-separated reporters, each installed."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if names == ["none"]:
        return ()
    for name in names:
        if name not in REPORTERS:
            raise ValueError(
                f"--report-to {name!r}: expected none or a comma-separated list of "
                f"{', '.join(REPORTERS)}"
            )
        if importlib.util.find_spec(REPORTERS[name]) is None:
            raise ValueError(
                f"--report-to {name}: the {REPORTERS[name]} package is not installed "
                f"(pip install 'rlvr_fast[{name}]')"
            )
    return tuple(dict.fromkeys(names))


class Logger(Protocol):
    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    def __init__(self, directory: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resume hides the events an earlier attempt wrote for the steps that run again.
        self.writer = SummaryWriter(
            str(directory), purge_step=start_step + 1 if start_step else None
        )

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, root: Path, name: str, config: dict) -> None:
        import wandb

        run_id = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            dir=str(root),
            name=name,
            id=run_id,
            resume="allow",
            config=config,
            mode=wandb_mode(),
            project=os.environ.get("WANDB_PROJECT", "rlvr_fast"),
        )

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_mode() -> str:
    """WANDB_MODE when set; else online with a login, offline without one."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        login = netrc.netrc().authenticators(WANDB_HOST)
    except (OSError, netrc.NetrcParseError):
        login = None
    return "online" if login else "offline"


def open_loggers(
    names: tuple[str, ...], root: Path, run_name: str, config: dict, start_step: int
) -> list[Logger]:
    loggers: list[Logger] = []
    for name in names:
        if name == "tensorboard":
            loggers.append(TensorBoardLogger(root / "tensorboard", start_step))
        else:
            loggers.append(WandbLogger(root, run_name, config))
    return loggers
