"""Decode throughput: our batched KV-cached sampler vs ``transformers`` ``generate``.

Same checkpoint (the embedded tiny model), same batch (8 copies of one prompt, as a GRPO group),
same sampling settings (temperature 0.8, top-p 0.9, no top-k) and the same number of generated
tokens: end-of-sequence is disabled on both sides so every row decodes exactly ``NEW_TOKENS``.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import mark
from rlvr_fast.data import render_prompt, synthetic_problems
from rlvr_fast.engine.sampler import SamplingParams, generate
from rlvr_fast.policy import TINY_MODEL_DIR, load_policy

BATCH = 8
NEW_TOKENS = 128


@pytest.fixture(scope="module")
def prompt_ids():
    policy = load_policy("tiny")
    question = synthetic_problems("test", 1)[0].question
    return policy, [policy.tokenizer.encode(render_prompt(question))] * BATCH


def test_decode_rlvr_fast(benchmark, prompt_ids):
    policy, prompts = prompt_ids
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9)
    generator = torch.Generator().manual_seed(0)

    def run():
        out = generate(policy.model, prompts, params, eos_token_ids=[], generator=generator)
        assert out.generated_tokens == BATCH * NEW_TOKENS

    mark(benchmark, "decode", "fast", work=BATCH * NEW_TOKENS, unit="tokens")
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)


def test_decode_transformers_generate(benchmark, prompt_ids):
    transformers = pytest.importorskip("transformers")
    _, prompts = prompt_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    input_ids = torch.tensor(prompts)
    config = transformers.GenerationConfig(
        do_sample=True, temperature=0.8, top_p=0.9, top_k=0, max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)

    def run():
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=config)
        assert out.shape == (BATCH, input_ids.shape[1] + NEW_TOKENS)

    mark(benchmark, "decode", "eager", work=BATCH * NEW_TOKENS, unit="tokens")
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
