"""The launch budget of one graph-replayed decode step at Qwen3-0.6B shape, counted on the meta
device by ``benchmarks.decode_cost`` (no GPU, no weights): at most 400 kernels per step at
batch 64 and at most 3 passes of the sampler over the [B, V] logits."""

from __future__ import annotations

import pytest

from benchmarks import decode_cost
from rlvr_fast.engine import token_sampler

QWEN3 = decode_cost.load_config("qwen3-0.6b")


@pytest.mark.parametrize("batch", [8, 64, 256])
def test_a_decode_step_launches_at_most_400_kernels(batch):
    step = decode_cost.decode_step_cost(QWEN3, batch)
    assert step.kernels <= 400, "\n".join(decode_cost.table(step, step))
    # One GEMM per projection (4 per layer) and the LM head: nothing else multiplies matrices.
    assert step.calls["aten::mm"] == 4 * QWEN3.num_hidden_layers + 1


def test_the_sampler_reads_the_logits_at_most_three_times():
    sampler = decode_cost.sampler_cost(QWEN3, 64)
    assert sampler.wide_passes <= 3
    assert set(sampler.wide_calls) <= {
        "rlvr_fast::sampler_row_stats",
        "rlvr_fast::sampler_histogram",
        "rlvr_fast::sampler_draw",
    }


def test_top_k_and_min_p_keep_the_three_passes_and_the_penalty_adds_one_copy():
    """top_k and min_p only bound the draw pass's candidates; the repetition penalty copies the
    logits to float32 once, then gathers and scatters [B, history] elements of the copy."""
    filtered = decode_cost.sampler_cost(QWEN3, 64, top_k=50, min_p=0.05)
    assert filtered.wide_calls == decode_cost.sampler_cost(QWEN3, 64).wide_calls
    penalized = decode_cost.sampler_cost(QWEN3, 64, 512, repetition_penalty=1.1)
    extra = penalized.wide_calls - filtered.wide_calls
    assert extra == {"aten::_to_copy": 1, "aten::gather": 1, "aten::scatter_": 1}, extra


def test_the_counter_sees_the_reference_sampler_passes(monkeypatch):
    """The same count over the torch reference (a sort, a cumsum and the int64 hash over
    [B, V]): many passes, so the budget above is a measurement, not a constant."""
    reference = token_sampler.sample_tokens_reference
    monkeypatch.setattr(
        decode_cost,
        "sample_tokens",
        lambda logits, seeds, positions, t, p, greedy: reference(logits, seeds, positions, t, p),
    )
    sampler = decode_cost.sampler_cost(QWEN3, 64)
    assert sampler.wide_passes > 20
    assert sampler.calls["aten::sort"] == 1


def test_the_cli_prints_the_two_figures(capsys):
    decode_cost.main(["--config", "tiny", "--batch", "4"])
    out = capsys.readouterr().out
    assert "kernels per decode step: " in out and "sampler full-vocab passes: 3" in out
