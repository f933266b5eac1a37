"""CPU decode of the embedded tiny model: the rollout engine vs ``transformers`` ``generate``,
interleaved round by round in one process (the same 8 rows x 128 sampled tokens as
``bench_engine.test_decode_cpu_tiny``), so that both sides see the same machine load.

    OMP_NUM_THREADS=1 python -m benchmarks.decode_vs_generate --rounds 7

prints each round's times, then the minimum of each side, their ratio and the load average.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.bench_engine import decode_on_engine, decode_with_generate, tiny_prompt
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.policy import TINY_MODEL_DIR, load_policy


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


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
    times: dict[str, list[float]] = {"engine": [], "generate": []}
    for round_ in range(args.rounds):
        times["engine"].append(seconds(engine))
        times["generate"].append(seconds(reference))
        print(
            f"round {round_}: engine {times['engine'][-1] * 1e3:.1f} ms, "
            f"generate {times['generate'][-1] * 1e3:.1f} ms"
        )
    best = {side: min(values) for side, values in times.items()}
    tokens = 8 * args.new_tokens
    print(
        f"min engine {best['engine'] * 1e3:.1f} ms ({tokens / best['engine']:,.0f} tok/s), "
        f"generate {best['generate'] * 1e3:.1f} ms ({tokens / best['generate']:,.0f} tok/s): "
        f"engine {best['generate'] / best['engine']:.2f}x generate; "
        f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
