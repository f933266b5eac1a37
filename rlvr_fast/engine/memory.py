"""The rollout engine's own memory plan: what an engine holds besides its KV cache, and the KV
blocks it gets from what is left. Every engine made without ``kv_blocks`` is sized by it (the
trainer passes ``kv_blocks`` from its run-wide plan, ``rlvr_fast.train.memory_plan``, which
counts these terms too).

Terms, in bytes, for a model of V tokens, hidden size h, MLP width I, Hq query heads, query and
key/value widths q and kv, compute dtype size e (the model's weights are already in memory, so
the free memory the plan starts from has them counted):
- the decode working set, with CUDA graphs: ``max_batch`` rows of V logits and the Triton
  sampler's buffers per row (``SAMPLER_BYTES_PER_ROW``), which the graphs' private pool keeps;
- one prefill pass: its padded tokens (every row runs as wide as the pass's widest, and the
  scheduler admits rows while their number times the widest stays within
  ``max_prefill_tokens``; a longer row runs alone), so at most P = max(max_prefill_tokens, L)
  tokens for rows of at most L = ``max_model_len`` tokens (a longer row, which decodes beyond the
  CUDA graphs too, prefills beyond the plan): one layer's intermediates at once
  (e (3h + 2q + 2kv + 3I) per token), and the logits of up to ``max_batch`` rows;
- on CUDA in fp32, the attention scores of that pass: a fresh prefill attends densely (SDPA),
  and CUDA's flash kernel takes fp16 / bf16 only while its memory-efficient kernel does not take
  grouped-query attention, so SDPA falls back to its math path, which forms the scores and their
  softmax, 2 x R x Hq x W^2 x 4 bytes for R rows of W tokens; R x W <= P and W <= L, so at most
  2 x Hq x P x L x 4 (``prefill_scores_bytes``: 8.6 GB for Qwen3-0.6B at P = L = 8,192); bf16
  and fp16 take the flash kernel, which stores no scores, and a CPU attends fp32 with its own
  flash kernel;
- an allowance for the CUDA context, workspaces and allocator slack (``RUNTIME_ALLOWANCE``).

The KV cache gets ``kv_memory_fraction`` of the memory left (free memory on CUDA, available
memory on a CPU, where pages are only committed as blocks are used), at most ``most`` blocks
(what the engine could ever hold at once); none left is a one-line ``OutOfBlocksError`` naming
the largest term.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_fast.models.config import ModelConfig

# Bytes the Triton sampler's three passes make per row of a sampled draw, whatever V: the row's
# (max, normaliser) in fp32, its 1,024-bin int32 histogram, the draw's 4,096 int64 candidate slots
# and the int64 token. Measured on the meta device with the launches left out (tests check it).
SAMPLER_BYTES_PER_ROW = 36_880
RUNTIME_ALLOWANCE = 1 << 30
DEFAULT_MAX_PREFILL_TOKENS = 8192  # RolloutEngine's max_prefill_tokens


def sampler_bytes(config: ModelConfig, e: int, rows: int) -> int:
    """``rows`` rows of logits [V] in the compute dtype and the sampler's buffers per row."""
    return rows * (config.vocab_size * e + SAMPLER_BYTES_PER_ROW)


def prefill_bytes(config: ModelConfig, e: int, tokens: int, rows: int) -> int:
    """One prefill pass of ``tokens`` tokens in ``rows`` rows: one layer's intermediates at once
    and the rows' logits."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = e * (3 * config.hidden_size + 2 * q + 2 * kv + 3 * config.intermediate_size)
    return tokens * per_token + rows * config.vocab_size * e


def prefill_pass_tokens(max_prefill_tokens: int, longest: int) -> int:
    """The most tokens one prefill pass runs, padding included, for rows of at most ``longest``
    tokens: rows share a pass while their number times the widest stays within
    ``max_prefill_tokens`` (``rlvr_fast.engine.scheduler.joins_prefill_pass``); a longer row
    runs alone."""
    return max(max_prefill_tokens, longest)


def prefill_scores_bytes(config: ModelConfig, max_prefill_tokens: int, longest: int, e: int) -> int:
    """SDPA's math-path scores and softmax in the largest prefill pass of rows of at most
    ``longest`` tokens: R rows of W tokens form 2 x R x Hq x W^2 elements, and R x W is at most
    the pass's padded tokens P while W <= ``longest``, so at most 2 x Hq x P x ``longest``."""
    tokens = prefill_pass_tokens(max_prefill_tokens, longest)
    return 2 * config.num_attention_heads * tokens * longest * e


def math_attention_bytes(config: ModelConfig, rows: int, tokens: int, element: int = 4) -> int:
    """SDPA's math path over ``rows`` rows of ``tokens`` tokens: the scores and their softmax,
    [rows, Hq, T, T] each."""
    return 2 * rows * config.num_attention_heads * tokens * tokens * element


def flash_attention_takes(element: int, device_type: str) -> bool:
    """Whether a dense causal pass in this dtype size attends without forming its scores: on
    CUDA the flash kernel takes 2-byte dtypes only (the memory-efficient one does not take
    grouped-query attention); a CPU's flash kernel takes fp32 too."""
    return device_type != "cuda" or element == 2


@dataclass(frozen=True)
class EngineTerm:
    name: str
    bytes: int
    how: str


@dataclass(frozen=True)
class EnginePlan:
    terms: tuple[EngineTerm, ...]
    left: int  # bytes left for the KV cache before kv_memory_fraction
    kv_blocks: int

    @property
    def fixed_bytes(self) -> int:
        return sum(term.bytes for term in self.terms)


def plan_engine(
    config: ModelConfig,
    *,
    element: int,
    device_type: str,
    memory: int,
    block_bytes: int,
    fraction: float,
    most: int,
    max_batch: int,
    max_prefill_tokens: int,
    max_model_len: int,
    cuda_graphs: bool,
) -> EnginePlan:
    """The engine's terms on ``memory`` free (CUDA) or available (CPU) bytes and the KV blocks
    that fit the rest (``OutOfBlocksError`` when none does)."""
    from rlvr_fast.engine.scheduler import OutOfBlocksError

    e = element
    terms = []
    if cuda_graphs and device_type == "cuda":
        terms.append(
            EngineTerm(
                "decode working set (CUDA-graph pool)",
                sampler_bytes(config, e, max_batch),
                f"{max_batch} rows x ({config.vocab_size:,} logits x {e} B + "
                f"{SAMPLER_BYTES_PER_ROW:,} B of sampler buffers)",
            )
        )
    tokens = prefill_pass_tokens(max_prefill_tokens, max_model_len)
    terms.append(
        EngineTerm(
            "prefill pass",
            prefill_bytes(config, e, tokens, max_batch),
            f"{tokens:,} padded tokens of one layer's intermediates, {max_batch} rows' logits",
        )
    )
    if not flash_attention_takes(e, device_type):
        terms.append(
            EngineTerm(
                "prefill attention scores (SDPA's math path: fp32 on CUDA)",
                prefill_scores_bytes(config, max_prefill_tokens, max_model_len, e),
                f"2 x {config.num_attention_heads} heads x {tokens:,} padded tokens x "
                f"rows of {max_model_len:,} x {e} B",
            )
        )
    if device_type == "cuda":
        terms.append(EngineTerm("CUDA context, workspaces, allocator slack", RUNTIME_ALLOWANCE, ""))
    fixed = sum(term.bytes for term in terms)
    left = max(0, memory - fixed)
    blocks = min(int(left * fraction) // block_bytes, most)
    if blocks < 1:
        largest = max(terms, key=lambda term: term.bytes)
        raise OutOfBlocksError(
            f"no room for a single KV block: {fixed / 2**30:.2f} GiB of the engine's own terms "
            f"leave {left / 2**30:.2f} GiB of {memory / 2**30:.2f} GiB (kv_memory_fraction "
            f"{fraction}); the largest is {largest.name}, {largest.bytes / 2**30:.2f} GiB: "
            "lower max_batch or max_prefill_tokens, free memory, or pass kv_blocks"
        )
    return EnginePlan(tuple(terms), left, int(blocks))
