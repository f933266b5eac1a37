"""The two checks of ``check.sh --first`` that no test or benchmark makes at full size: one
CUDA-graph capture and replay against eager decode, and one decode step's time, on the checkpoint
stage 0 made (Qwen3-0.6B's shape).

    python3 benchmarks/gpu/first_contact.py graphs --model DIR [--device cuda] [--dtype bf16]
    python3 benchmarks/gpu/first_contact.py decode --model DIR [--device cuda] [--dtype bf16]

graphs: 4 rows of different prompts decoded 16 tokens (4 on a CPU) greedily by an engine with CUDA
graphs and by one without: the same tokens, row for row, and graphs captured and replayed (exit 1
when not).
On a CPU, which has no CUDA graphs, the same engines run the graphs' code (``DecodeGraphs``:
capture, static buffers, padded buckets, replay) on the test suite's graph runtime stand-in
(``tests/cuda_emulation.py``: a replay re-runs the recorded ATen operations and Triton launches),
in bf16 with the Triton paged-attention kernel in Triton's interpreter and the torch sampler, as
on CUDA (the stand-in cannot record the fp32 C++ kernels); it proves the plumbing and the
graphs' logic, not CUDA's capture (4 tokens: the interpreter takes about a second a launch).
decode: seconds per decode step at 64 rows, the time of 64 rows x 33 tokens less that of 64 rows x
1 token (prefill and the first draw) over the 32 decode steps, each after a warm-up run, with CUDA
graphs where the device has them. It prints one line a figure; nothing here is a benchmark's
ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton kernels in the interpreter; set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rlvr_fast.engine import RolloutEngine, SamplingParams  # noqa: E402
from rlvr_fast.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from rlvr_fast.models.policy import load_policy  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37], [41, 42, 43]]
DECODE_ROWS, DECODE_TOKENS = 64, 33
GRAPH_TOKENS = {"cuda": 16, "cpu": 4}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine(policy, graphs: bool) -> RolloutEngine:
    return RolloutEngine.for_policy(policy, cuda_graphs=graphs, max_batch=64, kv_blocks=2048)


EMULATED_MAX_MODEL_LEN = 256  # the stand-in's graphs' block tables: 16 blocks of 16


def emulated_engine(policy, graphs: bool) -> RolloutEngine:
    """On a CPU: an engine whose decode passes run as on CUDA (the Triton paged-attention kernel,
    the torch sampler), with ``DecodeGraphs`` on the graph runtime stand-in when ``graphs``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from cuda_emulation import EmulatedCuda

    made = RolloutEngine.for_policy(
        policy,
        cuda_graphs=False,
        max_batch=64,
        kv_blocks=2048,
        max_model_len=EMULATED_MAX_MODEL_LEN,
    )
    runner = made.runner
    runner.backend, runner.sampler = "triton", "torch"
    if graphs:
        runner.graphs = DecodeGraphs(
            made.model,
            made.storage,
            "triton",
            max_batch=64,
            table_width=EMULATED_MAX_MODEL_LEN // made.storage.block_size,
            cuda=EmulatedCuda(),
        )
    return made


def count_replays(graphs: DecodeGraphs, replays: list) -> None:
    """Appends to ``replays`` each decode step ``graphs`` replays (``torch.cuda.CUDAGraph``
    counts none itself)."""
    run = graphs.run

    def counted(inputs, params):
        replays.append(inputs.rows)
        return run(inputs, params)

    graphs.run = counted


def check_graphs(policy) -> int:
    emulated = policy.device.type != "cuda"
    params = SamplingParams.greedy(GRAPH_TOKENS["cpu" if emulated else "cuda"])
    completions = {}
    captured, replays = {}, []
    for graphs in (False, True):
        made = emulated_engine(policy, graphs) if emulated else engine(policy, graphs)
        if graphs and made.runner.graphs is not None:
            captured = made.runner.graphs.graphs
            count_replays(made.runner.graphs, replays)
        rows = [made.add(prompt) for prompt in PROMPTS]
        made.run(rows, params)
        completions[graphs] = [row.completion for row in rows]
    replays = len(replays)
    same = completions[True] == completions[False]
    where = "the graph runtime stand-in on the CPU (a dry run, not CUDA's)" if emulated else "CUDA"
    buckets = sorted({bucket for bucket, _ in captured})
    print(
        f"graphs captured on {where} for buckets {buckets}, {replays} replays; "
        f"same tokens as eager: {same}"
    )
    if not captured or not replays:
        print("no graph was captured and replayed")
        return 1
    if not same:
        for row, (eager, graphed) in enumerate(zip(completions[False], completions[True])):
            print(f"row {row}: eager {eager} graphs {graphed}")
    return 0 if same else 1


def time_decode(policy) -> int:
    made = engine(policy, graphs=True)
    device = torch.device(policy.device)

    def run(tokens: int) -> float:
        prompt = made.add(PROMPTS[0] * 8)
        rows = made.fork(prompt, n=DECODE_ROWS, seeds=list(range(DECODE_ROWS)))
        made.free(prompt)
        synchronize(device)
        start = time.perf_counter()
        made.run(rows, SamplingParams(max_new_tokens=tokens))
        synchronize(device)
        for row in rows:
            made.free(row)
        return time.perf_counter() - start

    run(DECODE_TOKENS)  # warm-up: Triton compiles, graph captures
    short, long = run(1), run(DECODE_TOKENS)
    step = (long - short) / (DECODE_TOKENS - 1)
    print(
        f"decode step at {DECODE_ROWS} rows: {step * 1e3:.2f} ms "
        f"({DECODE_ROWS} x {DECODE_TOKENS} tokens {long:.3f} s, x 1 token {short:.3f} s)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=["graphs", "decode"])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"first_contact: --device {args.device} but torch sees no CUDA device")
        return 2
    dtype = DTYPES[args.dtype]
    if args.check == "graphs" and not args.device.startswith("cuda") and dtype != torch.bfloat16:
        print(f"first_contact graphs on {args.device}: bf16, not {args.dtype} (see --help)")
        dtype = torch.bfloat16
    policy = load_policy(args.model, device=args.device, dtype=dtype)
    with torch.inference_mode():
        return check_graphs(policy) if args.check == "graphs" else time_decode(policy)


if __name__ == "__main__":
    sys.exit(main())
