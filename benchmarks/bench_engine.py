"""The rollout engine beside its references, in the same run.

1. Decode: 8 rows x 128 sampled tokens (T = 0.8, top-p 0.9, EOS off so both sides decode every
   token), the engine vs ``transformers`` ``generate`` on the same checkpoint. CPU: the embedded
   tiny model. CUDA: a Qwen3-0.6B-shaped model with random weights in bf16, 8 rows x 512 tokens
   after a 512-token prompt (context <= 1,024), CUDA graphs on and off; ``counts`` reports the
   mean decode step.
2. Evaluation: 200 held-out synthetic problems, greedy, cap 512, on the tiny model. Fast: the
   whole set continuously batched (a finished row's place goes to the next problem). Eager: the
   schedule the engine replaced, batches of 64 problems each decoded until its longest row ends.
3. A GRPO group (G = 8, cap 256): the prompt prefilled once and forked 8 times vs prefilled
   8 times; ``counts`` reports prefill tokens executed and peak KV blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlvr_fast
from benchmarks.harness import mark
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.rollouts.evaluation import evaluate
from rlvr_fast.rollouts.generation import generate, sample_group
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM
from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy

CUDA = torch.cuda.is_available()
ROWS = 8
QWEN3_0_6B = Path(rlvr_fast.__file__).parent / "assets" / "configs" / "qwen3-0.6b-base.json"


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny")


def tiny_prompt(policy) -> list[int]:
    return policy.tokenizer.encode(render_prompt(synthetic_problems("test", 1)[0].question))


# ---------------------------------------------------------------------- 1. decode
def decode_on_engine(engine: RolloutEngine, prompt: list[int], new_tokens: int):
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.8, top_p=0.9)
    generator = torch.Generator().manual_seed(0)

    def run():
        out = generate(engine, [prompt] * ROWS, params, generator=generator)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        assert out.generated_tokens == ROWS * new_tokens
        return out

    return run


def decode_with_generate(model, prompt: list[int], new_tokens: int):
    transformers = pytest.importorskip("transformers")
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt] * ROWS, device=device)
    config = transformers.GenerationConfig(
        do_sample=True,
        temperature=0.8,
        top_p=0.9,
        top_k=0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )

    def run():
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape == (ROWS, len(prompt) + new_tokens)

    return run


@pytest.mark.parametrize("role", ["eager", "fast"])
def test_decode_cpu_tiny(benchmark, tiny, role):
    new_tokens = 128
    prompt = tiny_prompt(tiny)
    if role == "fast":
        run = decode_on_engine(RolloutEngine(tiny.model, kv_blocks=2048), prompt, new_tokens)
    else:
        transformers = pytest.importorskip("transformers")
        hf = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
        run = decode_with_generate(hf, prompt, new_tokens)
    mark(
        benchmark,
        "decode, tiny model, CPU: engine vs generate",
        role,
        work=ROWS * new_tokens,
        unit="tokens",
    )
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)


@pytest.fixture(scope="module")
def qwen3_shape():
    """Our model at Qwen3-0.6B-Base's shape (random weights, bf16, on the GPU) and its
    ``transformers`` twin at the same shape."""
    transformers = pytest.importorskip("transformers")
    raw = json.loads(QWEN3_0_6B.read_text())
    torch.manual_seed(0)
    with torch.device("cuda"):
        ours = Qwen3ForCausalLM(ModelConfig.from_hf_dict(raw))
        for param in ours.parameters():
            torch.nn.init.normal_(param, std=0.02)
        ours = ours.to(torch.bfloat16).eval()
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**raw)).to(torch.bfloat16)
    return ours, hf.eval()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("side", ["generate", "engine, CUDA graphs", "engine, eager decode"])
def test_decode_cuda_qwen3_shape(benchmark, qwen3_shape, side):
    """The engine with graphs is the fast side of the generate comparison; without graphs it
    is timed in a group of its own (its time and ms per step set beside the graphs' figure)."""
    ours, hf = qwen3_shape
    new_tokens = 512
    prompt = torch.randint(1, 151_000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    if side == "generate":
        run = decode_with_generate(hf, prompt, new_tokens)
    else:
        engine = RolloutEngine(
            ours,
            kv_blocks=ROWS * 80,
            max_batch=ROWS,
            max_model_len=1024,
            cuda_graphs=side == "engine, CUDA graphs",
        )
        run = decode_on_engine(engine, prompt, new_tokens)
    group = "decode, Qwen3-0.6B shape, bf16, 8 x 512 tokens, CUDA"
    if side == "engine, eager decode":
        group += " (engine without CUDA graphs)"
    mark(
        benchmark,
        group,
        "eager" if side == "generate" else "fast",
        work=ROWS * new_tokens,
        unit="tokens",
    )
    benchmark.pedantic(run, rounds=2, warmup_rounds=0 if side == "generate" else 1)
    if benchmark.enabled:
        benchmark.extra_info["counts"] = {
            "ms_per_decode_step": benchmark.stats.stats.mean / new_tokens * 1e3
        }


# ---------------------------------------------------------------------- 2. evaluation
@pytest.mark.parametrize("role", ["eager", "fast"])
def test_evaluation_200_problems(benchmark, tiny, role):
    problems = synthetic_problems("test", 200, seed=1)
    engine = RolloutEngine.for_policy(tiny, kv_blocks=8192)

    def static_batches():
        for start in range(0, len(problems), 64):
            evaluate(
                tiny,
                problems[start : start + 64],
                max_new_tokens=512,
                progress=False,
                engine=engine,
            )

    def continuous():
        evaluate(tiny, problems, max_new_tokens=512, progress=False, engine=engine)

    mark(
        benchmark,
        "evaluation, 200 problems, cap 512: continuous vs batches of 64",
        role,
        work=len(problems),
        unit="problems",
    )
    benchmark.pedantic(continuous if role == "fast" else static_batches, rounds=2, warmup_rounds=0)


# ---------------------------------------------------------------------- 3. GRPO group
@pytest.mark.parametrize("role", ["eager", "fast"])
def test_grpo_group_prefill_once(benchmark, tiny, role):
    engine = RolloutEngine.for_policy(tiny, kv_blocks=2048)
    prompt = tiny_prompt(tiny)
    params = SamplingParams(max_new_tokens=256)

    def run():
        return sample_group(
            engine,
            prompt,
            8,
            params,
            reprefill=role == "eager",
            generator=torch.Generator().manual_seed(0),
        )

    mark(
        benchmark,
        "GRPO group G=8: one prefill + forks vs 8 prefills",
        role,
        work=8,
        unit="rollouts",
    )
    out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    benchmark.extra_info["counts"] = {
        "prefill_run": out.counters.prefill_run,
        "peak_kv_blocks": out.counters.peak_kv_blocks,
    }
