"""The memory plan: what one GRPO run holds on one device, term by term, computed from the model's
shape and the run's settings before anything is allocated, and the KV cache sized from what is
left (instead of half of whatever is free when the engine starts, which leaves no room for the
first backward).

Terms, in bytes, for P parameters, compute dtype size e (4 fp32, 2 bf16):
- weights P*e: what the forward runs on and the rollout engine decodes from (under bf16-mixed the
  bf16 copy of the fp32 masters that the engine's CUDA graphs hold);
- the RoPE cos / sin tables, every position below ``max_position_embeddings`` in the compute
  dtype, which the model makes at its first pass and keeps (training and the engine share them);
- fp32 master weights 4P (bf16-mixed and fp16-mixed only); AdamW moments 2P times their dtype
  (fp32, bf16 under bf16-true), or with ``optimizer="adafactor"`` its factored fp32 state, rows
  + columns of each Hugging Face matrix and every element of a vector
  (``adafactor_state_elements``); gradients P times theirs; one more gradient-sized sum when
  questions_per_step > 1 (the unit-gradient average keeps it beside each question's gradient);
  the frozen reference model of kl_beta > 0, 2P (bf16 on CUDA, ``rlvr_fast.train.policy``;
  under LoRA the frozen base itself, nothing more);
- activations of the largest backward, G rows of prompt + completion tokens in one pass: what our
  decoder saves per token per layer (``saved_bytes_per_token_layer``: the tensors autograd keeps,
  by storage, flash attention's q, k, v, output and log-sum-exp as CUDA saves them), plus the
  final norm and each token's cos / sin rows, plus backward's working set
  (``backward_bytes_per_token``); with activation checkpointing one hidden state per layer
  instead, plus one layer recomputed (checkpointing the first k layers: those k hold a hidden
  state, the others all they save; ``activation_checkpointing="auto"`` takes the fewest k that
  leave the KV cache room for every row of a step, ``rlvr_fast.train.checkpointing``). In fp32 on
  CUDA, SDPA's math path also keeps each layer's attention softmax [G, Hq, T, T] and backward
  forms two more (CUDA's flash kernel takes bf16 / fp16 only, its memory-efficient one no
  grouped-query attention; ``attention_scores_term``).
  Verified on the meta device at Qwen3 shapes (tests/train/test_memory_plan.py);
- the fused loss (every loss order the trainer runs): dW accumulated in fp32 [V, H] by the GEMM,
  the hidden states and their gradient [N, H], then the larger of the forward's [chunk, V]
  logits tile and backward's dW cast to the compute dtype beside the scaled hidden gradient;
  or, with ``eager_loss`` (the eager reference ``grpo_loss``, which no arm trains with), the
  [N, V] logits, their fp32 copy, the saved log-softmax and the logits' gradients;
- the decode working set: ``max_batch`` rows of V logits in the compute dtype and the Triton
  sampler's buffers per row (``SAMPLER_BYTES_PER_ROW``, measured; they do not grow with V),
  which the CUDA graphs' private pool keeps;
- the engine's prefill pass, as its own plan counts it (``rlvr_fast.engine.memory``) for rows of
  at most prompt + completion tokens: max(``max_prefill_tokens``, that) padded tokens of one
  layer's intermediates and ``max_batch`` rows' logits, and in fp32 on CUDA the attention
  scores of the pass's rows (at most 2 x Hq x its padded tokens x the row length); held only
  while the rollouts prefill, when no backward or optimizer step runs, so it is a phase of its
  own beside those two (measured on the meta device);
- with LoRA (``lora``, ``rlvr_fast.models.lora``): the weights term is the frozen base, held
  once; beside it the adapters in the compute dtype and the merged copy of each adapted
  projection module that the engine decodes from; masters, moments and gradients (and the
  unit-gradient sum) are the adapters' alone; the LM head is frozen, so the fused loss forms no
  dW; the activations add what the adapted projections keep (B's input, and with dropout each
  part's dropped input and mask) to the full model's, an upper bound (a frozen projection keeps
  no input for a dW; measured on the meta device);
- the optimizer step's temporaries (``adamw_step_bytes``): under torch's foreach AdamW (its
  default on CUDA) a square root of every second moment at once, as large as the moments;
  single-tensor (the CPU's default) at most three times the largest trained tensor; the fused
  kernel (``adamw_fused``) none; Adafactor's (``adafactor_step_bytes``) two fp32 copies of the
  largest tensor and its factors (four copies over bf16 weights). Backward's terms (activations, the fused loss) are freed before
  the step, so the two phases do not add: the larger counts (and a prefill pass, below, is a third);
- a judge model's weights and its own engine's KV cache;
- an allowance for the CUDA context, library workspaces and allocator slack (not a measurement);
- the KV cache: ``kv_blocks`` if given, else ``kv_memory_fraction`` of what is left, at most what
  ``max_batch`` rows of ``max_model_len`` tokens could use (the engine's own cap).

The plan fails (``PlanError``, one line naming the largest term) when the terms leave no room for
one full-length row in the KV cache.

``rlvr-fast plan`` (``rlvr_fast.cli.plan``) prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlvr_fast.engine.memory import (
    DEFAULT_MAX_PREFILL_TOKENS,
    SAMPLER_BYTES_PER_ROW,
    flash_attention_takes,
    math_attention_bytes,
    prefill_bytes,
    prefill_pass_tokens,
    prefill_scores_bytes,
    sampler_bytes,
)
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.lora import adapter_parameters
from rlvr_fast.train.run_shape import RunShape
from rlvr_fast.train.memory_terms import (
    PRECISIONS,
    activation_bytes,
    adamw_step_bytes,
    adafactor_state_elements,
    adafactor_step_bytes,
    adapter_saved_bytes_per_token,
    checkpointed_layers,
    eager_loss_bytes,
    fused_loss_bytes,
    kv_block_bytes,
    largest_parameter,
    merged_twin_parameters,
    rope_table_bytes,
    saved_bytes_per_token_layer,
)

GIB = 1 << 30
RUNTIME_ALLOWANCE = 1 * GIB
DEFAULT_MAX_MODEL_LEN = 16384  # the engine's default cap on max_position_embeddings


class PlanError(ValueError):
    """The run cannot fit the device; the message names the largest term."""


BACKWARD, OPTIMIZER_STEP, PREFILL = "backward", "optimizer step", "a prefill pass"
PHASES = (BACKWARD, OPTIMIZER_STEP, PREFILL)  # one at a time: the largest counts


@dataclass(frozen=True)
class Term:
    """``counted`` False: an alternative the run does not take (shown, never summed);
    ``phase``: held only during backward, the optimizer step or a prefill pass (None: for the
    whole run)."""

    name: str
    bytes: int
    how: str
    counted: bool = True
    phase: str | None = None


@dataclass
class MemoryPlan:
    device_memory: int
    terms: list[Term]
    kv_blocks: int
    block_bytes: int
    row_blocks: int
    rows_wanted: int
    header: str = ""
    notes: list[str] = field(default_factory=list)
    checkpointed_layers: int = 0  # the decoder layers that recompute in backward

    def phase_bytes(self, phase: str) -> int:
        return phase_bytes(self.terms, phase)

    @property
    def summed_terms(self) -> list[Term]:
        return summed_terms(self.terms)

    @property
    def fixed_bytes(self) -> int:
        return sum(term.bytes for term in self.summed_terms)

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.block_bytes

    @property
    def rows_at_full_length(self) -> int:
        """Rollout rows of prompt + completion tokens the KV cache holds at once."""
        return self.kv_blocks // self.row_blocks

    @property
    def fits(self) -> bool:
        return self.rows_at_full_length >= 1 and self.fixed_bytes + self.kv_bytes <= (
            self.device_memory
        )

    def check(self) -> "MemoryPlan":
        """The plan itself, or ``PlanError`` naming the largest term when it does not fit."""
        if self.fits:
            return self
        largest = max(self.summed_terms, key=lambda t: t.bytes)
        need = self.fixed_bytes + self.row_blocks * self.block_bytes
        raise PlanError(
            f"does not fit in {gib(self.device_memory)} GiB: {gib(need)} GiB needed with one "
            f"row in the KV cache; the largest term is {largest.name}, {gib(largest.bytes)} GiB"
            + _advice(self.terms, largest)
        )

    def render(self) -> str:
        """The plan as a Markdown table."""
        lines = [self.header, "", "| term | GiB | how |", "|---|---:|---|"]
        summed = self.summed_terms
        for term in self.terms:
            size = gib(term.bytes) if term in summed else f"({gib(term.bytes)})"
            during = f"during {term.phase}: " if term.phase else ""
            lines.append(f"| {term.name} | {size} | {during}{term.how} |")
        phases = ", ".join(f"{p} {gib(self.phase_bytes(p))}" for p in PHASES)
        lines.append(
            f"| **before the KV cache** | **{gib(self.fixed_bytes)}** | the run-long terms and "
            f"the largest phase ({phases} GiB) |"
        )
        lines.append(
            f"| KV cache | {gib(self.kv_bytes)} | {self.kv_blocks:,} blocks of "
            f"{self.block_bytes / (1 << 20):.2f} MiB: {self.rows_at_full_length:,} rows at full "
            f"length ({self.rows_wanted:,} sampled at once) |"
        )
        total = self.fixed_bytes + self.kv_bytes
        lines.append(
            f"| **total** | **{gib(total)}** | of {gib(self.device_memory)} GiB, "
            f"{gib(self.device_memory - total)} GiB free |"
        )
        return "\n".join(lines + [""] + self.notes)


def phase_bytes(terms: list[Term], phase: str) -> int:
    return sum(t.bytes for t in terms if t.counted and t.phase == phase)


def summed_terms(terms: list[Term]) -> list[Term]:
    """What the device holds at its peak: the run-long terms and the largest phase's."""
    peak = max(PHASES, key=lambda phase: phase_bytes(terms, phase))
    return [t for t in terms if t.counted and t.phase in (None, peak)]


def gib(size: int) -> str:
    return f"{size / GIB:.2f}"


def _advice(terms: list[Term], largest: Term) -> str:
    if largest.name.startswith("activations") and "no checkpointing" in largest.name:
        other = next(t for t in terms if not t.counted and t.name.startswith("activations"))
        return f" (activation checkpointing would make it {gib(other.bytes)} GiB)"
    return ""


# ---------------------------------------------------------------------- the plan


DEFAULT_RUN = RunShape()  # plan_memory's run when none is given


def plan_memory(
    config: ModelConfig,
    device_memory: int,
    run: RunShape = DEFAULT_RUN,
    *,
    judge: ModelConfig | None = None,
    runtime_allowance: int = RUNTIME_ALLOWANCE,
) -> MemoryPlan:
    """Every term of a run of ``config`` on a device with ``device_memory`` bytes (see the module
    docstring); ``plan.check()`` raises when it does not fit."""
    if device_memory < 1:
        raise ValueError(f"memory plan: device_memory must be >= 1 byte, got {device_memory}")
    precision = PRECISIONS[run.precision]
    e = precision.compute
    terms = training_terms(config, run) + engine_terms(config, run)
    if run.shard is not None:
        from rlvr_fast.train.memory_sharded import sharded_terms  # which imports Term

        terms = sharded_terms(config, run, terms)
    if judge is not None:
        terms.append(
            Term(
                "judge weights", judge.num_parameters(untied=False) * e, f"{_count(judge)} x {e} B"
            )
        )
    terms.append(Term("CUDA context, workspaces, allocator slack", runtime_allowance, "allowance"))
    block_bytes = kv_block_bytes(config, run.block_size, e)
    row_blocks = -(-run.row_tokens // run.block_size)
    fixed = sum(t.bytes for t in summed_terms(terms))
    left = max(0, device_memory - fixed)
    kv_blocks = run.kv_blocks or _kv_blocks(config, run, left, block_bytes)
    if judge is not None:
        judge_block = kv_block_bytes(judge, run.block_size, e)
        judge_kv = int((left - kv_blocks * block_bytes) * run.kv_memory_fraction)
        judge_kv -= judge_kv % judge_block
        terms.append(Term("judge KV cache", judge_kv, "kv_memory_fraction of what is left"))
    plan = MemoryPlan(
        device_memory,
        terms,
        kv_blocks,
        block_bytes,
        row_blocks,
        run.group_size * run.questions_per_step,
        header=_header(config, run, device_memory),
        checkpointed_layers=checkpointed_layers(config, run.activation_checkpointing),
    )
    return plan


def training_terms(config: ModelConfig, run: RunShape) -> list[Term]:
    precision = PRECISIONS[run.precision]
    e = precision.compute
    params = config.num_parameters(untied=run.untied)
    count = _count(config, run.untied)
    terms = [Term(f"weights ({_dtype(e, run)})", params * e, f"{count} x {e} B")]
    trained, trained_count = params, count
    if run.lora is not None:
        terms += lora_terms(config, run)
        trained = adapter_parameters(config, run.lora)
        trained_count = f"{trained / 1e6:,.2f}M adapter"
    rope = f"2 x {config.max_position_embeddings:,} positions x {config.head_dim} x {e} B"
    terms.append(Term("RoPE cos / sin tables", rope_table_bytes(config, e), rope))
    if precision.master:
        terms.append(Term("fp32 master weights", trained * 4, f"{trained_count} x 4 B"))
    if run.optimizer == "adafactor":
        terms.append(adafactor_term(config, run))
    else:
        moments = f"2 x {trained_count} x {precision.moment} B"
        terms.append(
            Term(
                f"AdamW moments ({_dtype(precision.moment, run)})",
                2 * trained * precision.moment,
                moments,
            )
        )
    gradient = trained * precision.gradient
    how = f"{trained_count} x {precision.gradient} B"
    terms.append(Term(f"gradients ({_dtype(precision.gradient, run)})", gradient, how))
    if run.questions_per_step > 1:
        steps = f"questions_per_step {run.questions_per_step}"
        terms.append(Term("unit-gradient sum", gradient, steps))
    if run.reference_model and run.lora is None:  # under LoRA: the frozen base, shared
        terms.append(Term("reference model (bf16)", params * 2, f"{_millions(params)} x 2 B"))
    terms += activation_terms(config, run)
    terms.append(loss_term(config, run))
    terms.append(optimizer_step_term(config, run, trained, trained_count))
    return terms


def optimizer_step_term(config: ModelConfig, run: RunShape, trained: int, count: str) -> Term:
    precision = PRECISIONS[run.precision]
    moment, shape = precision.moment, largest_parameter(config, run.lora)
    largest = math.prod(shape)
    if run.optimizer == "adafactor":
        size = adafactor_step_bytes(shape, precision.gradient)
        how = f"tensor by tensor, at the largest: {shape[0]:,} x {shape[1]:,} in fp32"
        return Term("Adafactor step temporaries", size, how, phase=OPTIMIZER_STEP)
    how = {
        "foreach": f"torch's foreach AdamW: sqrt of {count} second moments x {moment} B",
        "single-tensor": f"torch's single-tensor AdamW: at most 3 x the largest, "
        f"{_millions(largest)} x {moment} B",
        "fused": "torch's fused AdamW: in place",
    }[run.adamw_step]
    size = adamw_step_bytes(run.adamw_step, trained, largest, moment)
    return Term("AdamW step temporaries", size, how, phase=OPTIMIZER_STEP)


def adafactor_term(config: ModelConfig, run: RunShape) -> Term:
    """Adafactor's factored second moments, float32 whatever the precision."""
    elements = adafactor_state_elements(config, run.untied, run.lora)
    return Term("Adafactor state (fp32)", 4 * elements, f"{_millions(elements)} x 4 B")


def lora_terms(config: ModelConfig, run: RunShape) -> list[Term]:
    """LoRA's (``rlvr_fast.models.lora``): the adapters in the compute dtype beside the frozen
    base weights, and the merged copy of each adapted projection the engine decodes from."""
    e = PRECISIONS[run.precision].compute
    adapters = adapter_parameters(config, run.lora)
    twin = merged_twin_parameters(config, run.lora)
    rank = f"r = {run.lora.rank}"
    return [
        Term(
            f"LoRA adapters ({_dtype(e, run)})",
            adapters * e,
            f"{_millions(adapters)} x {e} B, {rank}",
        ),
        Term(
            f"merged adapted projections for the engine ({_dtype(e, run)})",
            twin * e,
            f"{_millions(twin)} x {e} B",
        ),
    ]


def activation_terms(config: ModelConfig, run: RunShape) -> list[Term]:
    """The activations of the checkpointing the run takes (counted), then those of checkpointing
    no layer and every layer (shown)."""
    layers = config.num_hidden_layers
    chosen = checkpointed_layers(config, run.activation_checkpointing)
    alternatives = [chosen] + [k for k in (0, layers) if k != chosen]
    terms = [activation_term(config, run, k, counted=k == chosen) for k in alternatives]
    if not flash_attention_takes(PRECISIONS[run.precision].compute, "cuda"):
        terms.append(attention_scores_term(config, run, chosen))
    return terms


def activation_term(config: ModelConfig, run: RunShape, checkpointed: int, counted: bool) -> Term:
    """The activations of the largest backward with the first ``checkpointed`` layers
    recomputed."""
    e = PRECISIONS[run.precision].compute
    tokens, layers = run.backward_tokens, config.num_hidden_layers
    rows = f"{run.group_size} x {run.row_tokens} tokens"
    adapters = 0
    if run.lora is not None:
        # What the adapted projections keep, in the layers that keep it (one recomputed).
        kept_layers = layers - checkpointed + (1 if checkpointed else 0)
        adapters = tokens * adapter_saved_bytes_per_token(config, run.lora, e) * kept_layers
        adapters //= layers
    if checkpointed == layers:
        name = "activations, largest backward (checkpointing)"
        how = f"{rows}: one hidden state per layer, one layer recomputed"
    elif checkpointed == 0:
        name = "activations, largest backward (no checkpointing)"
        how = (
            f"{rows} x {layers} layers, "
            f"{saved_bytes_per_token_layer(config, e) / 1024:.1f} KiB per token per layer"
        )
    else:
        name = f"activations, largest backward (checkpointing {checkpointed} of {layers} layers)"
        how = (
            f"{rows}: one hidden state in each of the first {checkpointed} layers, one of them "
            f"recomputed; the other {layers - checkpointed} keep their activations"
        )
    size = activation_bytes(config, e, tokens, checkpointed) + adapters
    return Term(name, size, how, counted=counted, phase=BACKWARD)


def attention_scores_term(config: ModelConfig, run: RunShape, checkpointed: int) -> Term:
    """fp32 on CUDA: SDPA's math path (``rlvr_fast.engine.memory``) keeps for backward each
    layer's softmax [G, Hq, T, T] and its keys and values expanded to the query heads (in the
    layers that keep their activations, and the one recomputed), and backward forms the gradients of the scores and
    of their softmax, two more [G, Hq, T, T] (an upper bound with checkpointing, where the
    recomputed layer's MLP can be the larger; measured on the meta device)."""
    rows, tokens = run.group_size, run.row_tokens
    layers = config.num_hidden_layers - checkpointed + (1 if checkpointed else 0)
    scores = math_attention_bytes(config, rows, tokens) // 2
    expanded = 2 * 4 * rows * tokens * config.num_attention_heads * config.head_dim
    return Term(
        "attention scores (fp32: SDPA's math path)",
        layers * (scores + expanded) + 2 * scores,
        f"{layers} layer(s) x ({rows} x {config.num_attention_heads} heads x {tokens:,}^2 "
        "scores + expanded keys and values) + 2 x the scores in backward, x 4 B",
        phase=BACKWARD,
    )


def loss_term(config: ModelConfig, run: RunShape) -> Term:
    from rlvr_fast.ops.weighted_nll import default_chunk_size

    e = PRECISIONS[run.precision].compute
    tokens = run.group_size * run.max_new_tokens
    if run.eager_loss:
        return Term(
            "eager loss (logits)",
            eager_loss_bytes(config, e, tokens),
            f"{tokens:,} x {config.vocab_size:,} logits",
            phase=BACKWARD,
        )
    chunk = run.loss_chunk_tokens or default_chunk_size(tokens, config.vocab_size, e)
    return Term(
        "fused loss",
        fused_loss_bytes(config, e, tokens, min(chunk, tokens), head_gradient=run.lora is None),
        f"{min(chunk, tokens)}-token chunks, "
        + (
            f"fp32 dW [{config.vocab_size:,}, {config.hidden_size:,}]"
            if run.lora is None
            else "no dW (the head is frozen)"
        ),
        phase=BACKWARD,
    )


def engine_terms(config: ModelConfig, run: RunShape) -> list[Term]:
    """The decode working set the CUDA graphs keep, and the engine's prefill pass."""
    e = PRECISIONS[run.precision].compute
    most = DEFAULT_MAX_PREFILL_TOKENS  # the trainer's engine takes the default
    tokens = prefill_pass_tokens(most, run.row_tokens)
    terms = [
        Term(
            "engine prefill pass",
            prefill_bytes(config, e, tokens, run.max_batch),
            f"{tokens:,} padded tokens of one layer's intermediates, {run.max_batch} rows' logits",
            phase=PREFILL,
        )
    ]
    if not flash_attention_takes(e, "cuda"):
        terms.append(
            Term(
                "engine prefill attention scores (fp32: SDPA's math path)",
                prefill_scores_bytes(config, most, run.row_tokens, e),
                f"2 x {config.num_attention_heads} heads x {tokens:,} padded tokens x rows of "
                f"{run.row_tokens:,} x {e} B",
                phase=PREFILL,
            )
        )
    if run.cuda_graphs:  # without graphs the decode step's buffers are freed after each step
        terms.insert(
            0,
            Term(
                "decode working set (CUDA-graph pool)",
                sampler_bytes(config, e, run.max_batch),
                f"{run.max_batch} rows x ({config.vocab_size:,} logits x {e} B + "
                f"{SAMPLER_BYTES_PER_ROW:,} B of sampler buffers)",
            ),
        )
    return terms


def _kv_blocks(config: ModelConfig, run: RunShape, left: int, block_bytes: int) -> int:
    max_model_len = run.max_model_len or min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    most = run.max_batch * (-(-max_model_len // run.block_size) + 1)
    return min(int(left * run.kv_memory_fraction) // block_bytes, most)


def _count(config: ModelConfig, untied: bool = False) -> str:
    return _millions(config.num_parameters(untied=untied))


def _millions(count: int) -> str:
    return f"{count / 1e6:,.1f}M"


def _dtype(size: int, run: RunShape) -> str:
    return "fp32" if size == 4 else PRECISIONS[run.precision].half


def _header(config: ModelConfig, run: RunShape, device_memory: int) -> str:
    return (
        f"Memory plan: {config.model_type}, {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, {_count(config, run.untied)} parameters, {run.precision}, "
        f"G = {run.group_size} x Q = {run.questions_per_step}, {run.prompt_tokens} + "
        f"{run.max_new_tokens} tokens, max_batch {run.max_batch}, on "
        f"{gib(device_memory)} GiB" + (f", one of {run.world_size} fsdp ranks" if run.shard else "")
    )


def plan_for_training(
    model_config: ModelConfig, config, precision: str, prompt_tokens: int, device_memory: int
) -> MemoryPlan:
    """The plan of a run of ``config`` (a ``TrainConfig``, read by its field names) in
    ``precision``, whose longest prompt has ``prompt_tokens`` tokens, on ``device_memory``
    bytes: what the trainer checks on CUDA before the engine is made. Under
    ``activation_checkpointing="auto"`` the plan picks how many layers checkpoint
    (``auto_checkpointing_plan``; ``plan.checkpointed_layers``)."""
    auto = config.activation_checkpointing == "auto"
    run = RunShape(
        precision=precision,
        group_size=config.group_size,
        questions_per_step=config.questions_per_step,
        prompt_tokens=prompt_tokens,
        max_new_tokens=config.max_new_tokens,
        max_batch=config.max_batch,
        activation_checkpointing=False if auto else config.activation_checkpointing,
        kv_memory_fraction=config.kv_memory_fraction,
        kv_blocks=config.kv_blocks,
        max_model_len=config.max_model_len,
        untied=not model_config.tie_word_embeddings,
        cuda_graphs=config.cuda_graphs,
        reference_model=config.kl_beta > 0,
        lora=config.lora_settings,
        adamw_step="fused" if config.adamw_fused else "foreach",  # torch's choices on CUDA
        optimizer=config.optimizer,
    )
    if auto:
        from rlvr_fast.train.checkpointing import auto_checkpointing_plan  # it plans through here

        return auto_checkpointing_plan(model_config, device_memory, run)
    return plan_memory(model_config, device_memory, run)
