"""One file-mode policy for everything a run writes, and write errors that name the target,
never our temp file (issue 28, items 7 and 12): atomically written files used to be 0600 (the
temp file's mode) while the ledger and rollouts were 0644."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from rlvr_fast.utils.files import (
    append_line,
    atomic_path,
    files_into,
    replaced_directory,
    write_text_atomic,
)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=lambda u: f"umask {u:03o}")
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def test_every_writer_gives_the_mode_of_a_new_file(tmp_path, umask):
    file_mode, directory_mode = 0o666 & ~umask, 0o777 & ~umask
    write_text_atomic(tmp_path / "config.json", "{}")
    append_line(tmp_path / "ledger.jsonl", "{}")
    with atomic_path(tmp_path / "state.safetensors") as temp:
        save_file({"a": torch.zeros(2)}, str(temp))  # its own temp file is 0600
    with replaced_directory(tmp_path / "final") as staging:
        save_file({"a": torch.zeros(2)}, str(staging / "model.safetensors"))
        (staging / "config.json").write_text("{}")
    with files_into(tmp_path / "saved") as staging:
        save_file({"a": torch.zeros(2)}, str(staging / "model.safetensors"))
    files = ["config.json", "ledger.jsonl", "state.safetensors", "final/model.safetensors"]
    files += ["final/config.json", "saved/model.safetensors"]
    assert {name: oct(mode(tmp_path / name)) for name in files} == {
        name: oct(file_mode) for name in files
    }
    assert oct(mode(tmp_path / "final")) == oct(directory_mode)


def test_a_write_error_names_the_target_not_the_temp_file(tmp_path):
    target = tmp_path / "evals" / "t.jsonl"
    with pytest.raises(OSError) as caught, atomic_path(target) as temp:
        raise OSError(28, "No space left on device", str(temp))
    assert caught.value.filename == str(target)
    assert caught.value.strerror == "No space left on device"
    with pytest.raises(OSError) as caught, replaced_directory(tmp_path / "final") as staging:
        raise OSError(28, "No space left on device", str(staging / "model.safetensors"))
    assert caught.value.filename == str(tmp_path / "final" / "model.safetensors")
    with pytest.raises(FileNotFoundError) as caught, atomic_path(target):
        open(tmp_path / "source.txt")
    assert caught.value.filename == str(tmp_path / "source.txt"), "another file keeps its name"


FILL = """
import resource, signal, sys, torch
from rlvr_fast.run.state_file import save_state
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    save_state(sys.argv[1], {"weights": torch.zeros(1 << 16)})
except OSError as err:
    print(f"{type(err).__name__}|{err.errno}|{err.filename}|{err.strerror}")
"""


def test_a_full_disk_during_a_state_save_is_an_os_error_naming_the_file(tmp_path):
    """A real write past a file-size limit (EFBIG, what ENOSPC is to safetensors): the Rust
    error, which names its own temp file, comes out as an OSError naming the state file, and
    no temp file is left."""
    target = tmp_path / "checkpoint" / "state.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", FILL, str(target)], capture_output=True, text=True, timeout=300
    )
    assert done.stdout.strip() == f"OSError|27|{target}|File too large", done.stderr
    assert os.listdir(tmp_path / "checkpoint") == []
