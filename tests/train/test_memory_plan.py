"""The memory plan (``rlvr_fast.train.memory_plan``) against measurements, then on four cards.

Measured on the meta device (shapes, no compute) at Qwen3-0.6B / 1.7B / 4B shapes, one real
backward of 8 rows x 712 tokens: every storage an operation makes is tracked until it is freed
(``LiveBytes``). Attention runs as CUDA runs it for bf16 causal rows: flash attention, which keeps
q, k, v, its output and log-sum-exp (meta's own SDPA takes the math path and keeps the T x T
scores). What the forward keeps for backward (with the RoPE tables the model makes at its first
pass) matches the plan's per-token formula within 1%; the peak of forward + backward, net of
parameter gradients (a plan term of their own), lies within [measured, measured + 8%]. The
embedding is frozen there: its gradient is born whole, [V, H], before it becomes ``.grad`` (the
plan's gradients term). The Triton sampler's buffers per row are measured the same way, its
launches left out. Then the plan sizes or refuses every model x card x checkpointing case.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from benchmarks.harness import LiveBytes
from rlvr_fast.cli import plan as plan_command
from rlvr_fast.cli.main import main as rlvr_fast_main
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.engine import kv_storage
from rlvr_fast.engine.kv_storage import bytes_per_block
from rlvr_fast.engine.memory import (
    math_attention_bytes,
    prefill_bytes,
    prefill_pass_tokens,
    prefill_scores_bytes,
)
from rlvr_fast.models import attention as attention_module
from rlvr_fast.engine.token_sampler import sample_tokens
from rlvr_fast.kernels import top_p_sampling
from rlvr_fast.models import qwen3
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.lora import LoraSettings, adapter_parameters, apply_lora
from rlvr_fast.ops.weighted_nll import default_chunk_size
from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.train import memory_plan
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.trainer import engine_settings
from rlvr_fast.utils.sizes import parse_size
from rlvr_fast.train.memory_plan import (
    SAMPLER_BYTES_PER_ROW,
    PlanError,
    RunShape,
    activation_bytes,
    plan_for_training,
    plan_memory,
    rope_table_bytes,
    saved_bytes_per_token_layer,
)
from rlvr_fast.train.adafactor import Adafactor
from rlvr_fast.train.memory_terms import (
    adafactor_step_bytes,
    adamw_step_bytes,
    adapter_saved_bytes_per_token,
    checkpointed_layers,
    largest_parameter,
    tail_bytes_per_token,
)

CONFIGS = Path(memory_plan.__file__).parents[1] / "assets" / "configs"
MODELS = {name: CONFIGS / f"qwen3-{name}-base.json" for name in ("0.6b", "1.7b", "4b")}
MIB = 1 << 20
# Total memory as nvidia-smi reports it: RTX 4090, A100 40GB, H100 80GB, H200.
CARDS = {"24GB": 24564 * MIB, "40GB": 40960 * MIB, "80GB": 81559 * MIB, "141GB": 143771 * MIB}
ROWS, ROW_TOKENS = 8, 712


def config(name: str) -> ModelConfig:
    return ModelConfig.from_file(MODELS[name])


def flash_attention(q, k, v, mask):
    """What SDPA runs on CUDA for causal bf16 rows with no mask (GQA included)."""
    assert mask is None
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]


def measure_backward(
    monkeypatch, name: str, dtype, checkpointing: bool | int, attention=flash_attention
) -> tuple[int, int]:
    """(bytes kept after the forward, peak bytes net of gradients) of one forward + backward of
    ROWS x ROW_TOKENS tokens on the meta device, checkpointing every layer, none or the first
    that many, attending with ``attention``."""
    # The decoder's own name for SDPA: it imports dense_attention from rlvr_fast.models.attention.
    monkeypatch.setattr(qwen3, "dense_attention", attention)
    with torch.device("meta"):
        model = qwen3.Qwen3ForCausalLM(config(name)).to(dtype)
    model.model.checkpointed_layers = checkpointed_layers(model.config, checkpointing)
    model.model.embed_tokens.weight.requires_grad_(False)
    params = list(model.parameters())

    def gradients() -> int:
        return sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)

    tracker = LiveBytes(ignore=params, discount=gradients)
    ids = torch.zeros(ROWS, ROW_TOKENS, dtype=torch.long, device="meta")
    with tracker:
        hidden = model(ids, return_hidden=True)
        kept = tracker.live()
        hidden.backward(torch.empty_like(hidden))
    return kept, tracker.peak


@pytest.mark.parametrize("checkpointing", [False, True, 5])
@pytest.mark.parametrize(
    "name, dtype", [(name, torch.bfloat16) for name in MODELS] + [("0.6b", torch.float32)]
)
def test_activations_match_a_meta_device_measurement(monkeypatch, name, dtype, checkpointing):
    cfg, e = config(name), dtype.itemsize
    tokens = ROWS * ROW_TOKENS
    kept, peak = measure_backward(monkeypatch, name, dtype, checkpointing)
    recomputed = checkpointed_layers(cfg, checkpointing)
    layers = recomputed * e * cfg.hidden_size
    layers += (cfg.num_hidden_layers - recomputed) * saved_bytes_per_token_layer(cfg, e)
    tables = rope_table_bytes(cfg, e)
    planned_kept = tokens * (layers + tail_bytes_per_token(cfg, e))
    assert planned_kept + tables == pytest.approx(kept, rel=0.01)
    planned_peak = activation_bytes(cfg, e, tokens, checkpointing) + tables
    assert peak <= planned_peak <= 1.08 * peak, (peak / tokens, planned_peak / tokens)


def math_attention(q, k, v, mask):
    """What SDPA runs on CUDA for causal fp32 rows with grouped-query attention: its math path
    (the flash kernel takes bf16 / fp16 only, the memory-efficient one no enable_gqa)."""
    assert mask is None
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, None, 0.0, True, enable_gqa=q.shape[1] != k.shape[1]
    )[0]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fp32_attention_scores_are_planned_as_the_math_path_keeps_them(monkeypatch, checkpointing):
    """fp32 on CUDA stores T^2 attention scores the flash-attention activations leave out: the
    plan's fp32 activations plus its attention-scores term bound a meta-device forward +
    backward through SDPA's math path (0.6B, 8 x 712 tokens: 27 GB without checkpointing), and
    no bf16 plan counts the term."""
    cfg, tokens = config("0.6b"), ROWS * ROW_TOKENS
    _, peak = measure_backward(monkeypatch, "0.6b", torch.float32, checkpointing, math_attention)
    shape = RunShape(
        precision="fp32",
        group_size=ROWS,
        prompt_tokens=200,
        max_new_tokens=ROW_TOKENS - 200,
        activation_checkpointing=checkpointing,
    )
    scores = memory_plan.attention_scores_term(cfg, shape, 28 if checkpointing else 0).bytes
    planned = activation_bytes(cfg, 4, tokens, checkpointing) + rope_table_bytes(cfg, 4) + scores
    assert peak <= planned <= (1.35 if checkpointing else 1.08) * peak, (peak, planned)
    fp32_plan = plan_memory(cfg, CARDS["141GB"], shape)
    assert scores in {t.bytes for t in fp32_plan.terms if t.name.startswith("attention scores")}
    bf16_plan = plan_memory(cfg, CARDS["141GB"], RunShape(precision="bf16-mixed"))
    assert not [t for t in bf16_plan.terms if t.name.startswith("attention scores")]


def measure_prefill(
    monkeypatch, name: str, dtype, lengths: list[int], max_prefill_tokens: int = 8192
) -> tuple[int, list[int]]:
    """(peak bytes, padded tokens of each pass) of a fresh prefill of prompts of ``lengths``
    tokens through a meta-device engine (its KV cache, the weights and the RoPE tables left
    out: terms of their own), attending as CUDA does for ``dtype``."""
    attention = flash_attention if dtype == torch.bfloat16 else math_attention
    monkeypatch.setattr(attention_module, "dense_attention", attention)
    monkeypatch.setattr(kv_storage, "INITIAL_CPU_BLOCKS", 1 << 20)  # no growth mid-pass
    with torch.device("meta"):
        model = qwen3.Qwen3ForCausalLM(config(name)).to(dtype)
    blocks = sum(n // 16 + 1 for n in lengths) + max(lengths) // 16 + 1
    engine = RolloutEngine(
        model, kv_blocks=blocks, cuda_graphs=False, max_prefill_tokens=max_prefill_tokens
    )
    engine.prefill([engine.add(list(range(1, max(lengths) + 1)))])  # makes the RoPE tables
    seqs = [engine.add(list(range(1, n + 1))) for n in lengths]
    passes, run_pass = [], engine.runner.prefill
    monkeypatch.setattr(
        engine.runner,
        "prefill",
        lambda batch: (
            passes.append(len(batch.rows) * max(s.num_pending for s in batch.rows))
            or run_pass(batch)
        ),
    )
    tracker = LiveBytes(ignore=[*model.parameters(), engine.storage.data])
    with tracker:
        engine.prefill(seqs)
    return tracker.peak, passes


@pytest.mark.parametrize("name", ["0.6b", "4b"])
@pytest.mark.parametrize(
    "dtype, rows, tokens, most",
    [(torch.bfloat16, 1, 8192, 1.5), (torch.bfloat16, 16, 512, 1.5), (torch.float32, 16, 512, 2.2)],
)
def test_the_prefill_pass_terms_bound_a_meta_device_prefill(
    monkeypatch, name, dtype, rows, tokens, most
):
    """The engine's prefill-pass term (its own plan's and the training plan's) and, in fp32, its
    attention-scores term bound what one prefill pass takes on the meta device: one layer's
    intermediates (CUDA's fused ops) and the rows' logits, and in fp32 SDPA's math-path scores
    (the plan counts the scores and their softmax apart; 0.6B at 16 x 512 tokens: 206 MB in bf16
    for 307 planned, 646 MB in fp32 for 1,151)."""
    cfg, e = config(name), dtype.itemsize
    peak, _ = measure_prefill(monkeypatch, name, dtype, [tokens] * rows)
    planned = prefill_bytes(cfg, e, rows * tokens, rows)
    if dtype == torch.float32:
        planned += math_attention_bytes(cfg, rows, tokens)
    assert peak <= planned <= most * peak, (peak, planned)


@pytest.mark.parametrize("dtype, most", [(torch.bfloat16, 1.8), (torch.float32, 2.2)])
def test_the_prefill_terms_bound_passes_of_unequal_rows(monkeypatch, dtype, most):
    """The runner pads every row of a pass to its widest, so the engine admits rows while their
    number times the widest stays within max_prefill_tokens: with 2,048, one 512-token prompt
    and 40 of 16 tokens run as two passes, 4 x 512 and 37 x 16 padded tokens (their 1,152
    pending tokens would have run in one pass of 41 x 512), and the plan's prefill terms for rows of at most
    512 tokens, 2,048 padded tokens' intermediates and in fp32 the scores of 2,048 / 512 rows of
    512, bound the meta-device peak."""
    cfg, e, lengths = config("0.6b"), dtype.itemsize, [512] + [16] * 40
    peak, passes = measure_prefill(monkeypatch, "0.6b", dtype, lengths, max_prefill_tokens=2048)
    assert passes == [4 * 512, 37 * 16], "the long row and three short ones, then the rest"
    tokens = prefill_pass_tokens(2048, 512)
    planned = prefill_bytes(cfg, e, tokens, len(lengths))
    if dtype == torch.float32:
        planned += prefill_scores_bytes(cfg, 2048, 512, e)
    assert peak <= planned <= most * peak, (peak, planned)


def test_the_training_plan_counts_a_prefill_pass_as_a_phase_of_its_own(capsys):
    """The engine's prefill pass runs while the rollouts are drawn, never during backward or
    the optimizer step: the plan counts the largest of the three phases. Qwen3-0.6B at its
    defaults: backward outweighs the pass, which adds nothing; LoRA on one row of 8 + 8 tokens with
    the fused AdamW step: the pass (8,192 tokens' intermediates, 256 rows' logits, 0.35 GiB) is
    the peak, which the plan left out before;
    fp32 adds its attention scores to the pass."""
    cfg = config("0.6b")
    plan = plan_memory(cfg, CARDS["80GB"], RunShape())
    prefill = plan.phase_bytes("a prefill pass")
    assert prefill == prefill_bytes(cfg, 2, 8192, 256) < plan.phase_bytes("backward")
    run_long = sum(t.bytes for t in plan.terms if t.counted and t.phase is None)
    assert plan.fixed_bytes == run_long + plan.phase_bytes("backward")
    lora = LoraSettings(rank=16)  # a frozen head: the fused loss forms no dW
    small = RunShape(group_size=1, prompt_tokens=8, max_new_tokens=8, adamw_step="fused", lora=lora)
    small_plan = plan_memory(cfg, CARDS["80GB"], small)
    run_long = sum(t.bytes for t in small_plan.terms if t.counted and t.phase is None)
    assert (
        small_plan.fixed_bytes == run_long + prefill > run_long + small_plan.phase_bytes("backward")
    )
    fp32 = plan_memory(cfg, CARDS["80GB"], RunShape(precision="fp32"))
    assert (
        fp32.phase_bytes("a prefill pass")
        == prefill_bytes(cfg, 4, 8192, 256)
        + math_attention_bytes(cfg, 8192 // 712, 712)
        + 2 * 16 * (8192 % 712) * 712 * 4
    )
    assert plan_command.main(["--model", str(MODELS["0.6b"]), "--device-memory", "24GiB"]) == 0
    assert "| engine prefill pass | (0.35) | during a prefill pass: 8,192 padded tokens" in (
        capsys.readouterr().out
    )


@pytest.mark.cuda
def test_on_cuda_fp32_grouped_query_attention_has_only_the_math_path():
    """The premise of the fp32 attention-scores terms, checked where it can be: at Qwen3-0.6B's
    heads (16 query, 8 key/value) causal SDPA finds no flash or memory-efficient kernel for fp32
    rows, and finds the flash kernel for bf16 ones."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(dtype):
        q = torch.randn(2, 16, 64, 128, device="cuda", dtype=dtype)
        kv = torch.randn(2, 8, 64, 128, device="cuda", dtype=dtype)
        return torch.nn.functional.scaled_dot_product_attention(
            q, kv, kv, is_causal=True, enable_gqa=True
        )

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        with pytest.raises(RuntimeError):
            attend(torch.float32)
        assert attend(torch.bfloat16).dtype == torch.bfloat16


class NoLaunch:
    """A Triton kernel that takes its grid and its arguments and runs nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def sampler_peak(logits, draw) -> int:
    """Peak bytes ``draw`` makes on the meta device beyond its inputs (the positions included)."""
    seeds = torch.zeros(logits.shape[0], dtype=torch.long, device="meta")
    scalar = torch.ones((), device="meta")
    positions = seeds + 1
    tracker = LiveBytes(ignore=(logits, seeds, positions, scalar))
    with torch.inference_mode(), tracker:
        draw(logits, seeds, positions, scalar, scalar)
    return tracker.peak


@pytest.mark.parametrize("vocab", [151_936, 32_000])
def test_the_sampler_constant_is_what_the_sampler_takes(monkeypatch, vocab):
    """The three passes' own buffers, launches left out (the draw's candidate slots are made
    inside its custom op, which the op's meta fake does not show); and the op path on the meta
    device, which makes the passes' outputs and nothing per logit."""
    for kernel in ("_row_stats_kernel", "_histogram_kernel", "_draw_kernel"):
        monkeypatch.setattr(top_p_sampling, kernel, NoLaunch())
    rows = 16
    logits = torch.empty(rows, vocab, dtype=torch.bfloat16, device="meta")

    def triton_path(logits, seeds, positions, temperature, top_p):
        # top-k and min-p as the engine gives them, 0-d device buffers (on the meta device their
        # values do not matter): the sampler makes none of its own
        return top_p_sampling.sample_top_p_triton(
            logits, seeds, positions, temperature, top_p, top_k=top_p, min_p=top_p
        )

    assert sampler_peak(logits, triton_path) == rows * SAMPLER_BYTES_PER_ROW

    def op_path(*args):
        return sample_tokens(*args, greedy=False)

    assert 0 < sampler_peak(logits, op_path) < rows * SAMPLER_BYTES_PER_ROW


# (model, precision, checkpointing, torch's AdamW) -> the cards it fits, of 24, 40, 80 and 141 GB.
FITS = {
    ("0.6b", "bf16-mixed", False, "foreach"): {"24GB", "40GB", "80GB", "141GB"},
    ("0.6b", "bf16-mixed", True, "foreach"): {"24GB", "40GB", "80GB", "141GB"},
    ("0.6b", "bf16-true", False, "foreach"): {"24GB", "40GB", "80GB", "141GB"},
    ("1.7b", "bf16-mixed", False, "foreach"): {"80GB", "141GB"},
    ("1.7b", "bf16-mixed", True, "foreach"): {"40GB", "80GB", "141GB"},
    ("1.7b", "bf16-true", True, "foreach"): {"24GB", "40GB", "80GB", "141GB"},
    ("4b", "bf16-mixed", False, "foreach"): {"141GB"},
    # foreach's square roots of 4.0B fp32 moments (15 GiB) are what 80 GB lacks; fused has none.
    ("4b", "bf16-mixed", True, "foreach"): {"141GB"},
    ("4b", "bf16-mixed", True, "fused"): {"80GB", "141GB"},
    ("4b", "bf16-true", True, "foreach"): {"40GB", "80GB", "141GB"},
    ("4b", "fp32", True, "foreach"): {"80GB", "141GB"},
}


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("case", FITS, ids=lambda case: "-".join(map(str, case)))
def test_the_plan_sizes_or_refuses_each_card(case, card):
    name, precision, checkpointing, adamw_step = case
    run = RunShape(
        precision=precision, activation_checkpointing=checkpointing, adamw_step=adamw_step
    )
    plan = plan_memory(config(name), CARDS[card], run)
    if card in FITS[case]:
        assert plan.check() is plan
        assert plan.rows_at_full_length >= 1
        assert plan.fixed_bytes + plan.kv_bytes <= CARDS[card]
        assert plan.kv_bytes <= run.kv_memory_fraction * (CARDS[card] - plan.fixed_bytes)
    else:
        largest = max(plan.summed_terms, key=lambda t: t.bytes)
        with pytest.raises(PlanError, match=re.escape(f"largest term is {largest.name}")):
            plan.check()


def test_precisions_keep_the_copies_they_name():
    cfg = config("0.6b")
    params = cfg.num_parameters(untied=False)

    def terms(precision):
        plan = plan_memory(cfg, CARDS["141GB"], RunShape(precision=precision))
        return {t.name: t.bytes for t in plan.terms}

    mixed, true, fp32 = terms("bf16-mixed"), terms("bf16-true"), terms("fp32")
    assert mixed["weights (bf16)"] == 2 * params and mixed["fp32 master weights"] == 4 * params
    assert mixed["AdamW moments (fp32)"] == 8 * params and mixed["gradients (fp32)"] == 4 * params
    assert "fp32 master weights" not in true and true["AdamW moments (bf16)"] == 4 * params
    assert "fp32 master weights" not in fp32 and fp32["weights (fp32)"] == 4 * params


def test_the_kv_cache_takes_what_is_left_or_what_it_is_told():
    cfg = config("0.6b")
    sized = plan_memory(cfg, CARDS["80GB"], RunShape(activation_checkpointing=True))
    told = plan_memory(cfg, CARDS["80GB"], RunShape(activation_checkpointing=True, kv_blocks=500))
    assert told.kv_blocks == 500 and told.fixed_bytes == sized.fixed_bytes
    judged = plan_memory(cfg, CARDS["80GB"], RunShape(activation_checkpointing=True), judge=cfg)
    names = {t.name for t in judged.terms}
    assert {"judge weights", "judge KV cache"} <= names and judged.kv_blocks < sized.kv_blocks
    assert judged.check() is judged
    too_many = plan_memory(cfg, CARDS["24GB"], RunShape(kv_blocks=10**6))
    with pytest.raises(PlanError, match="does not fit"):
        too_many.check()


def test_more_questions_per_step_add_a_gradient_sum_and_rows():
    cfg = config("0.6b")
    one = plan_memory(cfg, CARDS["80GB"], RunShape())
    four = plan_memory(cfg, CARDS["80GB"], RunShape(questions_per_step=4))
    gradient = cfg.num_parameters(untied=False) * 4
    assert four.fixed_bytes - one.fixed_bytes == gradient
    assert four.rows_wanted == 4 * one.rows_wanted


def test_a_kl_reference_model_costs_its_bf16_weights_and_nothing_under_lora():
    cfg = config("0.6b")
    plain = plan_memory(cfg, CARDS["80GB"], RunShape(precision="fp32"))
    kl = plan_memory(cfg, CARDS["80GB"], RunShape(precision="fp32", reference_model=True))
    assert kl.fixed_bytes - plain.fixed_bytes == 2 * cfg.num_parameters(untied=False)
    lora = LoraSettings(rank=8, targets="all-linear")
    shapes = [RunShape(lora=lora, reference_model=ref) for ref in (False, True)]
    lora_plain, lora_kl = (plan_memory(cfg, CARDS["80GB"], shape) for shape in shapes)
    assert lora_kl.fixed_bytes == lora_plain.fixed_bytes  # the frozen base, shared


def test_the_eager_loss_costs_the_full_logits():
    cfg = config("0.6b")
    eager = plan_memory(cfg, CARDS["141GB"], RunShape(eager_loss=True))
    fused = plan_memory(cfg, CARDS["141GB"], RunShape())
    loss = {t.name: t.bytes for t in eager.terms}["eager loss (logits)"]
    assert loss == ROWS * 512 * cfg.vocab_size * 16
    assert eager.fixed_bytes > fused.fixed_bytes


@pytest.mark.parametrize(
    "text, size",
    [("24GiB", 24 << 30), ("141GB", 141 * 10**9), ("80 GiB", 80 << 30), ("1e9", 10**9)],
)
def test_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["24G", "lots", "-1GB", ""])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match="a size is a number and a unit"):
        parse_size(text)


def test_the_command_prints_the_table_or_one_line(capsys):
    """rlvr-fast plan, and python -m rlvr_fast.train.memory_plan, its module's own."""
    model = str(MODELS["0.6b"])
    assert rlvr_fast_main(["plan", "--model", model, "--device-memory", "141GB"]) == 0
    table = capsys.readouterr().out
    assert "| KV cache |" in table and "| **total** |" in table
    untied = ["--model", model, "--untie", "--device-memory", "24564MiB"]
    assert rlvr_fast_main(["plan", *untied]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "largest term is activations, largest backward (no checkpointing)" in captured.err
    assert "activation checkpointing would make it" in captured.err
    assert plan_command.main([*untied, "--activation-checkpointing"]) == 0


def test_the_command_reads_a_checkpoint_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(MODELS["0.6b"].read_text())
    assert plan_command.main(["--model", str(tmp_path), "--device-memory", "80GB"]) == 0
    assert plan_command.main(["--model", str(tmp_path / "none"), "--device-memory", "80GB"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_the_trainer_plans_from_its_settings():
    """What a CUDA run checks before its engine is made: a TrainConfig's settings, the study's
    untied Qwen3-0.6B on a 24 GB card, which fits with activation checkpointing alone."""
    config = ModelConfig.from_file(MODELS["0.6b"])
    config.tie_word_embeddings = False
    settings = dict(max_new_tokens=512, loss_order="token_weighted")
    with pytest.raises(PlanError, match="largest term is activations"):
        plan_for_training(config, TrainConfig(**settings), "bf16-mixed", 200, CARDS["24GB"]).check()
    checkpointed = TrainConfig(activation_checkpointing=True, kv_blocks=500, **settings)
    plan = plan_for_training(config, checkpointed, "bf16-mixed", 200, CARDS["24GB"]).check()
    assert plan.kv_blocks == 500
    assert plan_for_training(config, checkpointed, "fp32", 200, CARDS["141GB"]).fits
    fused = TrainConfig(
        activation_checkpointing=True, adamw_fused=True, fused_zero_grad_step=False, **settings
    )
    steps = [
        {t.name: t.bytes for t in plan_for_training(config, c, "bf16-mixed", 200, 1 << 40).terms}
        for c in (checkpointed, fused)
    ]
    assert steps[0]["AdamW step temporaries"] > 0 == steps[1]["AdamW step temporaries"]
    # Arm 1's sum-then-scale loss goes through the fused op too: no [N, V] logits.
    arm_one = TrainConfig(activation_checkpointing=True, max_new_tokens=512)
    arm_one_plan = plan_for_training(config, arm_one, "bf16-mixed", 200, CARDS["24GB"])
    assert arm_one.loss_order == "sum_then_scale"
    assert [t.name for t in arm_one_plan.terms if "loss" in t.name] == ["fused loss"]


def test_auto_checkpoints_the_fewest_layers_that_leave_every_row_its_room():
    """activation_checkpointing="auto" on Qwen3-0.6B, G = 16 rows of 200 + 2,048 tokens in fp32:
    none on a card with room to spare, all where only that fits, and in between the fewest
    layers whose plan keeps G full-length rows in the KV cache (one layer fewer does not); an
    explicit true or false is the plan's as given."""
    cfg = config("0.6b")
    settings = dict(group_size=16, max_new_tokens=2048)

    def auto(memory: int):
        return plan_for_training(
            cfg, TrainConfig(activation_checkpointing="auto", **settings), "fp32", 200, memory
        )

    assert auto(1 << 40).checkpointed_layers == 0
    assert "0 of 28 layers checkpointed" in auto(1 << 40).render()
    assert auto(CARDS["24GB"]).checkpointed_layers == 28
    chosen = auto(CARDS["80GB"])
    k = chosen.checkpointed_layers
    assert 0 < k < 28 and chosen.rows_at_full_length >= chosen.rows_wanted == 16
    fewer = plan_memory(
        cfg,
        CARDS["80GB"],
        RunShape(
            precision="fp32",
            group_size=16,
            prompt_tokens=200,
            max_new_tokens=2048,
            max_batch=TrainConfig().max_batch,
            activation_checkpointing=k - 1,
            kv_memory_fraction=TrainConfig().kv_memory_fraction,
            adamw_step="foreach",
        ),
    )
    assert fewer.rows_at_full_length < 16
    names = [t.name for t in chosen.summed_terms if t.name.startswith("activations")]
    assert names == [f"activations, largest backward (checkpointing {k} of 28 layers)"]
    for explicit, layers in ((True, 28), (False, 0)):
        given = TrainConfig(activation_checkpointing=explicit, **settings)
        assert plan_for_training(cfg, given, "fp32", 200, 1 << 40).checkpointed_layers == layers
    with pytest.raises(ValueError, match='activation_checkpointing must be true, false or "auto"'):
        TrainConfig(activation_checkpointing="yes")


def test_auto_on_the_cpu_plans_on_the_hosts_memory(monkeypatch):
    """A CPU run under "auto" checkpoints what the plan on the host's memory says: none with
    room to spare, every layer when nothing fits (1 GiB: the plan's runtime allowance alone)."""
    from rlvr_fast.train import trainer as trainer_module

    def trainer(memory: int):
        monkeypatch.setattr(trainer_module, "host_memory", lambda: memory)
        config = TrainConfig.from_arm(
            "baseline", steps=1, max_new_tokens=8, activation_checkpointing="auto"
        )
        problems = synthetic_problems("train", 1)
        return trainer_module.RLVRTrainer(load_policy("tiny"), config, problems, progress=False)

    roomy, tight = trainer(1 << 40), trainer(1 << 30)
    assert roomy.policy.model.model.checkpointed_layers == 0
    assert tight.policy.model.model.checkpointed_layers == 4


def test_the_engine_takes_the_plans_kv_cache():
    """When the plan ran, plan and engine agree: the engine holds the plan's blocks, each of the
    plan's bytes; without a plan the engine sizes its cache from the settings."""
    policy = load_policy("tiny")
    config = TrainConfig(max_new_tokens=32, max_batch=4)
    plan = plan_for_training(policy.config, config, "fp32", 20, 2 << 30).check()
    engine = RolloutEngine.for_policy(policy, **engine_settings(config, plan))
    assert engine.num_blocks == plan.kv_blocks
    assert bytes_per_block(policy.config, 16, torch.float32) == plan.block_bytes
    assert engine_settings(TrainConfig(kv_blocks=7), None)["kv_blocks"] == 7


def adamw_step_peak(params: list[torch.nn.Parameter], **options) -> int:
    """Peak bytes torch's AdamW step makes beyond the parameters, their gradients and its own
    moments: its second step (the first makes the moments)."""
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(params, weight_decay=0.1, **options)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values()]
    tracker = LiveBytes(ignore=[*params, *(p.grad for p in params), *state])
    with tracker:
        optimizer.step()
    return tracker.peak


@pytest.mark.parametrize("lora", [None, LoraSettings(rank=16, targets="all-linear")])
@pytest.mark.parametrize("step, options", [("foreach", {"foreach": True}), ("single-tensor", {})])
def test_the_adamw_step_term_is_what_torch_takes(step, options, lora):
    """The masters of Qwen3-0.6B cut to 2 layers (fp32, meta device), all of them or LoRA's
    adapters: foreach takes a square root of every second moment at once, single-tensor (the
    CPU's default) two temporaries of one parameter beside the previous one's denominator; the
    fused kernel, run on the CPU (it has no meta kernel), none."""
    cfg = config("0.6b")
    cfg.num_hidden_layers = 2  # the formulas hold per tensor: two layers show them
    with torch.device("meta"):
        model = qwen3.Qwen3ForCausalLM(cfg)
    if lora is not None:
        apply_lora(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    trained = sum(p.numel() for p in params)
    plain = cfg.num_parameters(untied=False)
    assert trained == (plain if lora is None else adapter_parameters(cfg, lora))
    largest = max(p.numel() for p in params)
    assert largest == math.prod(largest_parameter(cfg, lora))
    peak, planned = adamw_step_peak(params, **options), adamw_step_bytes(step, trained, largest, 4)
    # Single-tensor: 2 x the embedding (smaller tensors follow it); 3 x LoRA's largest (the
    # previous one's denominator, of the same size, is still held).
    exact = step == "foreach" or lora is not None
    assert 0 < peak <= planned and (peak == planned if exact else planned == 1.5 * peak)
    tiny = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((300, 64), (64,))]
    assert adamw_step_peak(tiny, fused=True) == adamw_step_bytes("fused", 19264, 19200, 4) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_adafactor_step_term_is_what_our_adafactor_takes(dtype):
    """Adafactor (``rlvr_fast.train.adafactor``) over Qwen3-0.6B's tensors cut to 2 layers on
    the meta device: g^2 + eps, the update and the factors at the largest tensor (the
    embedding), and over bf16 weights (bf16-true) their fp32 weight and gradient besides."""
    cfg = config("0.6b")
    cfg.num_hidden_layers = 2
    with torch.device("meta"):
        model = qwen3.Qwen3ForCausalLM(cfg).to(dtype)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = Adafactor(named, cfg, lr=1e-3, weight_decay=0.1)
    optimizer.step()
    state = [t for s in optimizer.state.values() for part in s["parts"] for t in part.values()]
    tracker = LiveBytes(ignore=[*params, *(p.grad for p in params), *state])
    with tracker:
        optimizer.step()
    planned = adafactor_step_bytes(largest_parameter(cfg), dtype.itemsize)
    assert tracker.peak == planned


def test_backward_and_the_optimizer_step_do_not_add(capsys):
    """Backward's activations and fused loss are freed before the step: the plan sums the larger
    phase. Qwen3-0.6B, checkpointing, 24 GB: foreach's square roots (2.2 GiB) outweigh backward
    (1.8 GiB); the fused kernel leaves backward's."""
    cfg = config("0.6b")
    run = RunShape(activation_checkpointing=True)
    foreach = plan_memory(cfg, CARDS["24GB"], run)
    fused = plan_memory(
        cfg, CARDS["24GB"], RunShape(activation_checkpointing=True, adamw_step="fused")
    )
    run_long = sum(t.bytes for t in foreach.terms if t.counted and t.phase is None)
    backward, step = foreach.phase_bytes("backward"), foreach.phase_bytes("optimizer step")
    assert step == 4 * cfg.num_parameters(untied=False) > backward > 0
    assert foreach.fixed_bytes == run_long + step and fused.fixed_bytes == run_long + backward
    assert fused.rows_at_full_length > foreach.rows_at_full_length
    command = ["--model", str(MODELS["0.6b"]), "--device-memory", "24GiB"]
    assert plan_command.main([*command, "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "| fused loss | (0.89) | during backward:" in out
    assert "| AdamW step temporaries | 2.22 | during optimizer step:" in out
    with pytest.raises(SystemExit):
        plan_command.main([*command, "--adamw-step", "sideways"])


def lora_model(cfg: ModelConfig, settings: LoraSettings, dtype=torch.bfloat16):
    """Our decoder with LoRA on the meta device, and its adapters."""
    with torch.device("meta"):
        model = qwen3.Qwen3ForCausalLM(cfg).to(dtype)
    return model, apply_lora(model, settings)


def test_the_plan_under_lora_holds_the_base_once_and_trains_only_the_adapters(capsys):
    """Qwen3-0.6B under bf16-mixed with LoRA (all-linear, r 16), counted on the meta device: the
    plan's base weights, adapters and merged projections are the bytes the model and its
    engine twin hold; the plan is smaller than full training by the fp32 masters, gradients and
    AdamW moments of the frozen base and the fused loss's dW of the frozen head, and larger by
    the adapters, the twin and what the adapted projections keep for backward."""
    cfg = config("0.6b")
    settings = LoraSettings(rank=16, targets="all-linear")
    model, adapters = lora_model(cfg, settings)
    own = {id(p) for p in model.parameters()}
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    twin = sum(p.numel() for p in adapters.decoder.parameters() if id(p) not in own)
    full = plan_memory(cfg, CARDS["141GB"], RunShape())
    lora = plan_memory(cfg, CARDS["141GB"], RunShape(lora=settings))
    terms = {t.name: t.bytes for t in lora.terms}
    assert terms["weights (bf16)"] == 2 * frozen
    assert terms["LoRA adapters (bf16)"] == 2 * adapter == 2 * adapter_parameters(cfg, settings)
    assert terms["merged adapted projections for the engine (bf16)"] == 2 * twin
    assert terms["fp32 master weights"] == 4 * adapter
    assert terms["AdamW moments (fp32)"] == 8 * adapter and terms["gradients (fp32)"] == 4 * adapter
    tokens, vh = ROWS * 512, cfg.vocab_size * cfg.hidden_size
    chunk = default_chunk_size(tokens, cfg.vocab_size, 2)
    nh = 2 * tokens * cfg.hidden_size
    head_dw = (
        4 * vh + max(chunk * cfg.vocab_size * 2, 2 * vh + nh) - max(chunk * cfg.vocab_size * 2, nh)
    )
    kept = ROWS * 712 * adapter_saved_bytes_per_token(cfg, settings, 2)
    saved = (frozen - adapter) * (4 + 8 + 4) + head_dw - 2 * adapter - 2 * twin - kept
    assert full.fixed_bytes - lora.fixed_bytes == saved > 0
    lora_options = ["--lora-r", "16", "--lora-target-modules", "all-linear"]
    command = ["--model", str(MODELS["0.6b"]), "--device-memory", "141GB", *lora_options]
    assert plan_command.main(command) == 0
    assert "| LoRA adapters (bf16) |" in capsys.readouterr().out


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_plans_lora_activations_bound_a_meta_device_measurement(monkeypatch, dropout):
    """At the embedded model's shape on the meta device, what a LoRA forward keeps for backward
    is at most what the full model keeps plus the plan's adapter term (B's inputs; with dropout
    each part's dropped input and mask): the frozen projections keep no input for a dW."""
    monkeypatch.setattr(qwen3, "dense_attention", flash_attention)
    cfg = ModelConfig.from_file(TINY_MODEL_DIR / "config.json")
    settings = LoraSettings(rank=4, dropout=dropout, targets=("q_proj", "k_proj", "down_proj"))
    ids = torch.zeros(2, 24, dtype=torch.long, device="meta")

    def kept(model) -> int:
        model.train()
        model.model.embed_tokens.weight.requires_grad_(False)
        tracker = LiveBytes(ignore=list(model.parameters()))
        with tracker:
            hidden = model(ids, return_hidden=True)
            return tracker.live() - hidden.untyped_storage().nbytes()

    with torch.device("meta"):
        plain = qwen3.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    adapter_term = ids.numel() * adapter_saved_bytes_per_token(cfg, settings, 2)
    assert adapter_term > 0
    assert kept(lora_model(cfg, settings)[0]) <= kept(plain) + adapter_term
