"""CPU decode of the embedded tiny model: the rollout engine vs ``transformers`` ``generate``,
interleaved round by round in one process (the same 8 rows x 128 sampled tokens as
``bench_engine.test_decode_cpu_tiny``), so that both sides see the same machine load.

    OMP_NUM_THREADS=1 python -m benchmarks.decode_vs_generate --rounds 7

prints each round's wall and CPU times, then the minimum of each side, their ratios and the load
average. On a shared machine the process's CPU time (``time.process_time``, one thread) is the
steadier figure: the wall time also counts the time the other jobs hold the cores.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.bench_engine import decode_on_engine, decode_with_generate, tiny_prompt
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy


def seconds(run) -> tuple[float, float]:
    """(wall, CPU) seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    import transformers

    tiny = load_policy("tiny")
    prompt = tiny_prompt(tiny)
    engine = decode_on_engine(RolloutEngine(tiny.model, kv_blocks=2048), prompt, args.new_tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    reference = decode_with_generate(hf, prompt, args.new_tokens)
    engine(), reference()  # warm-up
    times: dict[str, list[tuple[float, float]]] = {"engine": [], "generate": []}
    for round_ in range(args.rounds):
        times["engine"].append(seconds(engine))
        times["generate"].append(seconds(reference))
        print(
            f"round {round_}: "
            + ", ".join(
                f"{side} {values[-1][0] * 1e3:.1f} ms wall / {values[-1][1] * 1e3:.1f} ms CPU"
                for side, values in times.items()
            )
        )
    tokens = 8 * args.new_tokens
    for index, clock in enumerate(("wall", "CPU")):
        best = {side: min(v[index] for v in values) for side, values in times.items()}
        print(
            f"min {clock}: engine {best['engine'] * 1e3:.1f} ms "
            f"({tokens / best['engine']:,.0f} tok/s), generate {best['generate'] * 1e3:.1f} ms "
            f"({tokens / best['generate']:,.0f} tok/s): "
            f"engine {best['generate'] / best['engine']:.2f}x generate"
        )
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
