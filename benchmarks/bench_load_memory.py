"""Peak resident memory of loading a checkpoint at Qwen3-0.6B's shape: rlvr_fast's ``load_policy``
beside ``transformers.AutoModelForCausalLM.from_pretrained``, each in a fresh process.

The checkpoint is written once to ``--checkpoint`` (default /tmp/qwen3-0.6b-fp32): the published
Qwen3-0.6B-Base configuration with its LM head untied (751.6M parameters, as the study counts
them) in float32, 3.0 GB of seeded random weights and a byte-level tokenizer
(``scripts/make_checkpoint.py``'s tokenizer). Each loader runs in a child process, which reports its resident
set after the imports, its peak (``VmHWM``) while loading and its resident set after; the figure
that matters is the peak above the imports minus the weights' bytes (a loader that copies the
weights shows a second copy there; the file pages a memory-mapped read touches count too).

    flock /tmp/bigmem.lock python -m benchmarks.bench_load_memory           # about 7 GB at peak
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]
DEFAULT_CHECKPOINT = Path("/tmp/qwen3-0.6b-fp32")
LOADERS = ("rlvr_fast", "transformers")
PROC_STATUS = Path("/proc/self/status")


def status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    for line in PROC_STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from {PROC_STATUS}")


def reset_peak() -> None:
    """Start VmHWM again from the current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


def ensure_checkpoint(directory: Path, *, layers: int | None = None, tied: bool = False) -> Path:
    """The benchmark's checkpoint at ``directory``, written unless a config.json is there: each
    tensor drawn and written on its own (N(0, 0.02), norms 1), so writing takes one tensor of
    memory, not the model. Qwen3-0.6B-Base's shape, untied unless ``tied``, with ``layers``
    decoder layers instead of its 28 when given."""
    if (directory / "config.json").is_file():
        return directory
    import torch

    from rlvr_fast.models.checkpoint import empty_model, hf_layout
    from rlvr_fast.models.config import ModelConfig

    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", REPO / "scripts" / "make_checkpoint.py"
    )
    make_checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_checkpoint)
    raw = json.loads(make_checkpoint.NAMED_CONFIGS["qwen3-0.6b"].read_text())
    raw.update(tie_word_embeddings=tied, torch_dtype="float32")
    if layers is not None:
        raw["num_hidden_layers"] = layers
    config = ModelConfig.from_hf_dict(raw)
    shapes = {name: slot.shape for name, slot in hf_layout(empty_model(config)).items()}
    directory.mkdir(parents=True, exist_ok=True)
    write_streamed(directory / "model.safetensors", shapes, torch.Generator().manual_seed(0))
    make_checkpoint.write_tokenizer(directory, config)
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return directory


def write_streamed(path: Path, shapes: dict[str, tuple[int, ...]], generator) -> None:
    """A float32 safetensors file of ``shapes``, one tensor in memory at a time."""
    import torch

    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                tensor = torch.ones(shape)
            else:
                tensor = torch.empty(shape).normal_(0.0, 0.02, generator=generator)
            file.write(tensor.numpy().tobytes())


def load(loader: str, directory: Path):
    if loader == "rlvr_fast":
        from rlvr_fast.models.policy import load_policy

        return load_policy(directory).model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype="auto")


def child(loader: str, directory: Path) -> dict:
    """Runs in the child: import, reset the peak, load; the resident set at each point."""
    import torch

    if loader == "rlvr_fast":
        import rlvr_fast.models.policy  # noqa: F401
    else:
        import transformers  # noqa: F401
    torch.set_num_threads(1)
    imported = status_bytes("VmRSS")
    reset_peak()
    model = load(loader, directory)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "loader": loader,
        "imported": imported,
        "peak": status_bytes("VmHWM"),
        "after": status_bytes("VmRSS"),
        "weights": weights,
    }


def measure(loader: str, directory: Path) -> dict:
    """``child`` in a fresh interpreter (a process's peak never comes down)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_load_memory", "--child", loader, str(directory)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def gb(size: int) -> str:
    return f"{size / 1e9:.2f}"


def report(rows: list[dict]) -> str:
    lines = [
        "| loader | weights GB | peak above imports GB | beyond the weights GB | after GB |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        peak = row["peak"] - row["imported"]
        lines.append(
            f"| {row['loader']} | {gb(row['weights'])} | {gb(peak)} | "
            f"{gb(peak - row['weights'])} | {gb(row['after'] - row['imported'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--child", nargs=2, metavar=("LOADER", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return
    directory = ensure_checkpoint(args.checkpoint)
    print(f"{directory}, load average before: {os.getloadavg()[0]:.2f}")
    print(report([measure(loader, directory) for loader in args.loaders.split(",")]))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
