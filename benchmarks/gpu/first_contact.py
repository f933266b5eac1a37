"""The two checks of ``check.sh --first`` that no test or benchmark makes at full size: one
CUDA-graph capture and replay against eager decode, and one decode step's time, on the checkpoint
stage 0 made (Qwen3-0.6B's shape).

    python3 benchmarks/gpu/first_contact.py graphs --model DIR [--device cuda] [--dtype bf16]
    python3 benchmarks/gpu/first_contact.py decode --model DIR [--device cuda] [--dtype bf16]

graphs: 4 rows of different prompts decoded 16 tokens greedily by an engine with CUDA graphs and
by one without: the same tokens, row for row, and every captured graph replayed (exit 1 when not;
on a CPU, where the engine makes no graphs, the comparison runs eager against eager and says so).
decode: seconds per decode step at 64 rows, the time of 64 rows x 33 tokens less that of 64 rows x
1 token (prefill and the first draw) over the 32 decode steps, each after a warm-up run, with CUDA
graphs where the device has them. It prints one line a figure; nothing here is a benchmark's
ratio.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.models.policy import load_policy

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37], [41, 42, 43]]
DECODE_ROWS, DECODE_TOKENS = 64, 33


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine(policy, graphs: bool) -> RolloutEngine:
    return RolloutEngine.for_policy(policy, cuda_graphs=graphs, max_batch=64, kv_blocks=2048)


def check_graphs(policy) -> int:
    params = SamplingParams.greedy(16)
    completions = {}
    for graphs in (False, True):
        made = engine(policy, graphs)
        rows = [made.add(prompt) for prompt in PROMPTS]
        made.run(rows, params)
        completions[graphs] = [row.completion for row in rows]
        if graphs:
            captured = made.runner.graphs.graphs if made.runner.graphs else {}
            replays = sum(graph.replays for graph, _ in captured.values()) if captured else 0
    same = completions[True] == completions[False]
    if not captured:
        print(f"no CUDA graphs on {policy.device}: eager against eager, same tokens: {same}")
    else:
        buckets = sorted({bucket for bucket, _ in captured})
        print(
            f"graphs captured for buckets {buckets}, {replays} replays; same tokens as eager: {same}"
        )
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
    policy = load_policy(args.model, device=args.device, dtype=DTYPES[args.dtype])
    with torch.inference_mode():
        return check_graphs(policy) if args.check == "graphs" else time_decode(policy)


if __name__ == "__main__":
    sys.exit(main())
