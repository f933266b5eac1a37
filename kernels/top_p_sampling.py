"""The study's temperature + top-p draw, one stream per sequence: the torch reference and a
sort-free Triton version in three passes over the logits.

Rule (seed §1): p = softmax(logits / T); rank tokens by p descending; keep rank r while the
probability mass of the ranks before it is < top_p (rank 0 always); draw among the kept.
Options, off by default (off, the rule and every draw are exactly the above), in the order of
transformers' ``_get_logits_processor`` in the path TRL's GRPOTrainer generates with
(``RepetitionPenaltyLogitsProcessor`` among the processors, then the warpers
``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``):
- ``repetition_penalty`` (1: off; ``penalize_repeats``): before the temperature, each token
  present in the row's prompt + completion so far has its logit divided by the penalty where
  positive and multiplied where negative;
- ``top_k`` (0: off, or >= V): ranks >= k are dropped, and the top-p test runs on the
  distribution renormalised over the k first ranks (top-p after top-k): rank r is kept while
  the mass before it is < top_p times the mass of the k first ranks. Ties at the k-th
  probability keep exactly k ranks (lower ids first) where transformers keeps every tie;
- ``min_p`` (0: off): ranks with p < min_p times the largest p are dropped (after temperature;
  renormalising by top-k / top-p changes no ratio to the largest p, which is always kept).

The draw is an exponential race: with E_r ~ Exp(1) independent, argmax_r p_r / E_r over the
kept ranks is distributed as the renormalised kept p. E_r = -log u_r where u_r is a
counter-based hash (splitmix64) of (the sequence's seed, the position being sampled, the rank
r), so a sequence's tokens depend only on its own seed and its own logits: not on which other
sequences share the batch, on the batch's order, or on how many draws came before. Ties in p
rank the lower token id first. With no filter at all (top_p >= 1, no top-k, no min-p: TRL's and
the TRL facade's defaults) every token is kept, and the race is keyed by token id instead of
rank (E_v, the hash of v): the same distribution, and no rank to find, so the Triton version
reads each row twice (the trainer's defaults, top_p < 1, keep the rank-keyed race and its
draws).

Reference (``sample_tokens_reference``): a full sort of every row, in torch ops.

Triton (``sample_top_p_triton``), per row, three passes over the logits and no full sort (two
with no filter: pass 2 skips the row and pass 3 races every token by id in one read) (a
candidate filter in the spirit of FlashInfer's and Qrita's pivot-based top-p, but with one
histogram in place of an iterative pivot search, and exact for the rank-keyed race):
1. ``_row_stats_kernel``: the softmax's max and normaliser (online, fp32);
2. ``_histogram_kernel``: a histogram of the probabilities by the top bits of their float32
   pattern, ``BINS`` quarter-octave bins (bin b holds p in [2^(b/4 - 127), 2^((b+1)/4 - 127)),
   so ordering bins orders tokens);
3. ``_draw_kernel``: the highest bin b* whose bins >= b* hold at least top_p of mass by their
   lower edges bounds the nucleus (every token below b* has at least that much mass before it);
   the tokens of bins >= b* (usually a handful) are gathered into a row scratch of ``CAP``
   slots, sorted there by (p, -id), and the race runs over their exact ranks, cumulative mass
   and hashed noise. That is exact whenever they fit (always at top_p < 1 unless the row's
   nucleus is flat over thousands of tokens).
   When they do not fit (top_p = 1, or a flat row), the top bins that fit are raced, and the
   ranks after them cannot win if the best score so far is >= q / min E_r over their ranks
   (q bounds their p; the E_r are known from the ranks alone): that settles peaked rows. A row
   still open continues exactly, in windows of the next ``CAP`` tokens in rank order, each
   found by a radix select over the (p, -id) key (7 histogram passes) and gathered (one more):
   slow, and only for rows whose nucleus spreads over more than ``CAP`` tokens.
With top-k or min-p on, the bound b* is also the highest bin with k tokens at or above it, and
the bin of min_p * p_max: both only shrink the candidates, and the pass count stays 3. The mass
of the k first ranks comes from the head window when it holds them (the usual case); else a
radix select of the k-th key and one more pass sum it (8 more passes, for that row only).
The repetition penalty runs before the passes, on a float32 copy of the logits
(``penalize_repeats``: one copy, then a gather and a scatter of the [B, L] history).
The probabilities, cumulative sums and noise are fp32 as the reference's, computed in another
order: a draw differs from the reference's only where two ranks' p / E are within float32
rounding.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference needs no Triton
    triton = None

# splitmix64 (Steele, Lea and Flood 2014): odd multipliers of the key and its finaliser, as
# signed 64-bit integers (torch's int64 arithmetic wraps modulo 2^64 on CPU and CUDA).
SEED_MULTIPLIER = 0x9E3779B97F4A7C15 - 2**64
POSITION_MULTIPLIER = 0xD1B54A32D192ED03 - 2**64
RANK_MULTIPLIER = 0x8CB92BA72F3D8DD7 - 2**64
MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
MIX_2 = 0x94D049BB133111EB - 2**64
UNIFORM_BITS = 23  # (k + 0.5) / 2^23 needs 24 significant bits: exact in float32
_ranks: dict[tuple[int, torch.device], torch.Tensor] = {}

# Triton: histogram bins of a probability's float32 bits >> 21 (p <= 1 gives at most 508),
# candidate slots per row, token ids in the low 20 bits of the (p, -id) key.
BINS = 512
CAP = 4096
ID_BITS = 20
BLOCK_V = 4096


def _logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic, logical shifts)."""
    x = (x ^ _logical_shift_right(x, 30)) * MIX_1
    x = (x ^ _logical_shift_right(x, 27)) * MIX_2
    return x ^ _logical_shift_right(x, 31)


def _rank_keys(width: int, device: torch.device) -> torch.Tensor:
    key = (width, device)
    if key not in _ranks:
        _ranks[key] = torch.arange(width, dtype=torch.int64, device=device) * RANK_MULTIPLIER
    return _ranks[key]


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """u [B, width] float32 in (0, 1): u[b, i] is a hash of (seeds[b], positions[b], i).

    seeds, positions [B] int64 on the device that gets the noise."""
    key = seeds * SEED_MULTIPLIER + positions * POSITION_MULTIPLIER
    bits = _logical_shift_right(
        _mix(key[:, None] + _rank_keys(width, seeds.device)), 64 - UNIFORM_BITS
    )
    return (bits.float() + 0.5) * (1.0 / 2**UNIFORM_BITS)


def top_p_probs(
    logits: torch.Tensor, temperature, top_p, top_k=0, min_p=0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (kept probabilities in descending order, 0 where dropped [B, V], and the
    token id of each rank [B, V]). ``temperature``, ``top_p``, ``top_k`` (0: off) and ``min_p``
    (0: off) are numbers or 0-d tensors (read on the device: a CUDA graph can capture it)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    mass_before = cumulative - sorted_probs
    if isinstance(top_k, int) and isinstance(min_p, (int, float)) and not (top_k or min_p):
        # mass_before of rank 0 is 0 < top_p, so the first token is always kept.
        return sorted_probs.masked_fill(mass_before >= top_p, 0.0), sorted_ids
    # Options as tensors: off, k = V, the renormaliser is 1 and min_p 0, which drop nothing.
    rows, vocab = logits.shape
    top_k = torch.as_tensor(top_k, device=logits.device)
    by_top_k = (top_k > 0) & (top_k < vocab)
    k = torch.where(by_top_k, top_k, vocab).long()
    # top-p over the distribution renormalised on the k first ranks (transformers' order).
    mass_k = cumulative.gather(1, (k - 1).expand(rows, 1))
    threshold = top_p * torch.where(by_top_k, mass_k, 1.0)
    ranks = torch.arange(vocab, device=logits.device)
    dropped = (mass_before >= threshold) | (ranks >= k)
    dropped |= sorted_probs < min_p * sorted_probs[:, :1]
    return sorted_probs.masked_fill(dropped, 0.0), sorted_ids


def penalize_repeats(logits: torch.Tensor, history: torch.Tensor, penalty) -> torch.Tensor:
    """float32 copy of logits [B, V] with the logit of every token in ``history`` [B, L] int64
    (row b: ids of its prompt + completion so far, repeats allowed, so a short row pads with
    one of its own ids) divided by ``penalty`` where positive, multiplied where negative."""
    penalized = logits.to(torch.float32, copy=True)
    seen = penalized.gather(1, history)
    return penalized.scatter_(1, history, torch.where(seen < 0, seen * penalty, seen / penalty))


def sample_tokens_reference(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature,
    top_p,
    top_k=0,
    min_p=0.0,
) -> torch.Tensor:
    """The sampled draw in torch ops: the definition every other version follows (the
    repetition penalty, when on, is applied to ``logits`` before: ``penalize_repeats``)."""
    kept, ids = top_p_probs(logits, temperature, top_p, top_k, min_p)
    exponential = -torch.log(uniform_noise(seeds, positions, kept.shape[1]))
    choice = (kept / exponential).argmax(dim=-1, keepdim=True)
    by_rank = ids.gather(1, choice).squeeze(1)
    unfiltered = keeps_every_token(top_p, top_k, min_p, logits.shape[1])
    if unfiltered is False:
        return by_rank
    # No filter: the race keyed by token id (exponential[:, v] is E_v).
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    by_id = (probs / exponential).argmax(dim=-1)
    return by_id if unfiltered is True else torch.where(unfiltered, by_id, by_rank)


def keeps_every_token(top_p, top_k, min_p, vocab: int):
    """Whether the options filter nothing (top_p >= 1, top_k off or >= V, min_p 0): a bool for
    numbers, a 0-d bool tensor when any option is a tensor (a CUDA graph's settings)."""
    if not any(isinstance(value, torch.Tensor) for value in (top_p, top_k, min_p)):
        return top_p >= 1 and (top_k <= 0 or top_k >= vocab) and min_p <= 0
    top_p, top_k, min_p = (torch.as_tensor(value) for value in (top_p, top_k, min_p))
    return (top_p >= 1) & ((top_k <= 0) | (top_k >= vocab)) & (min_p <= 0)


if triton is not None:

    @triton.jit
    def _probabilities(p_row, o_v, m_v, b_temperature, b_max, b_sum):
        """p [BV] of the tokens o_v (0 where masked off), as softmax(logits / T) forms it."""
        b_x = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32) / b_temperature
        return tl.exp(b_x - b_max) / b_sum

    @triton.jit
    def _rank_keys_of(b_p, o_v, m_v, ID_BITS: tl.constexpr):
        """The (p, -id) key [BV] int64: larger means an earlier rank; -1 where masked off."""
        b_bits = b_p.to(tl.int32, bitcast=True).to(tl.int64)
        b_key = (b_bits << ID_BITS) | ((1 << ID_BITS) - 1 - o_v.to(tl.int64))
        return tl.where(m_v, b_key, -1)

    @triton.jit
    def _exponential(b_key, b_ranks):
        """E = -log u for the ranks [N] of the stream whose key is seed * A + position * B."""
        b_x = b_key + b_ranks.to(tl.uint64) * 0x8CB92BA72F3D8DD7
        b_x = (b_x ^ (b_x >> 30)) * 0xBF58476D1CE4E5B9
        b_x = (b_x ^ (b_x >> 27)) * 0x94D049BB133111EB
        b_x = b_x ^ (b_x >> 31)
        b_u = ((b_x >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        return -tl.log(b_u)

    @triton.jit
    def _unfiltered(p_top_p, p_top_k, p_min_p, V):
        """Whether the row's options filter nothing (every token kept)."""
        b_top_k = tl.load(p_top_k).to(tl.int32)
        b_no_top_k = (b_top_k <= 0) | (b_top_k >= V)
        return (tl.load(p_top_p) >= 1.0) & b_no_top_k & (tl.load(p_min_p) <= 0.0)

    @triton.jit
    def _row_stats_kernel(
        p_logits,
        stride_row,
        p_temperature,
        p_stats,
        V,
        BLOCK_V: tl.constexpr,
        NUM_TILES: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        p_row = p_logits + i_b * stride_row
        b_temperature = tl.load(p_temperature)
        b_max = tl.full([], float("-inf"), tl.float32)
        b_sum = tl.full([], 0.0, tl.float32)
        for i_t in range(0, NUM_TILES):
            o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
            b_x = tl.load(p_row + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
            b_x = b_x / b_temperature  # [BV]
            b_new_max = tl.maximum(b_max, tl.max(b_x, axis=0))
            b_sum = b_sum * tl.exp(b_max - b_new_max) + tl.sum(tl.exp(b_x - b_new_max), axis=0)
            b_max = b_new_max
        tl.store(p_stats + 2 * i_b, b_max)
        tl.store(p_stats + 2 * i_b + 1, b_sum)

    @triton.jit
    def _histogram_kernel(
        p_logits,
        stride_row,
        p_temperature,
        p_top_p,
        p_top_k,
        p_min_p,
        p_stats,
        p_counts,
        V,
        BINS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        NUM_TILES: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        p_row = p_logits + i_b * stride_row
        b_temperature = tl.load(p_temperature)
        b_max = tl.load(p_stats + 2 * i_b)
        b_sum = tl.load(p_stats + 2 * i_b + 1)
        b_counts = tl.zeros([BINS], dtype=tl.int32)
        # No filter: the draw races every token by id and reads no histogram.
        if not _unfiltered(p_top_p, p_top_k, p_min_p, V):
            for i_t in range(0, NUM_TILES):
                o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
                m_v = o_v < V
                b_p = _probabilities(p_row, o_v, m_v, b_temperature, b_max, b_sum)
                b_bin = b_p.to(tl.int32, bitcast=True) >> 21  # [BV]
                b_counts += tl.histogram(b_bin, BINS, mask=m_v)
        tl.store(p_counts + i_b * BINS + tl.arange(0, BINS), b_counts)

    @triton.jit
    def _gather(
        p_row,
        p_scratch,
        V,
        b_temperature,
        b_max,
        b_sum,
        b_lo,
        b_hi,
        ID_BITS,
        BLOCK_V,
        NUM_TILES,
        CAP,
    ):
        """Write the keys in [lo, hi) of the row to the scratch (at most CAP, token order);
        returns how many there are."""
        b_n = tl.full([], 0, tl.int32)
        for i_t in range(0, NUM_TILES):
            o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
            m_v = o_v < V
            b_p = _probabilities(p_row, o_v, m_v, b_temperature, b_max, b_sum)
            b_key = _rank_keys_of(b_p, o_v, m_v, ID_BITS)
            m_sel = m_v & (b_key >= b_lo) & (b_key < b_hi)
            o_slot = b_n + tl.cumsum(m_sel.to(tl.int32), axis=0) - 1
            tl.store(p_scratch + o_slot, b_key, mask=m_sel & (o_slot < CAP))
            b_n += tl.sum(m_sel.to(tl.int32), axis=0)
        return b_n

    @triton.jit
    def _radix_floor(p_row, V, b_temperature, b_max, b_sum, b_hi, ID_BITS, BLOCK_V, NUM_TILES, CAP):
        """The CAP-th largest key below hi (0 when at most CAP keys are below hi): an MSD radix
        select over the 51-bit keys, one 8-bit digit per pass (the first digit has 3 bits).
        CAP may be a run-time count (top-k's k)."""
        b_prefix = tl.full([], 0, tl.int64)
        b_need = tl.full([], 0, tl.int32) + CAP
        b_all = tl.full([], 0, tl.int32)
        o_d = tl.arange(0, 256)
        for level in tl.static_range(7):
            shift = 48 - 8 * level
            b_hist = tl.zeros([256], dtype=tl.int32)
            for i_t in range(0, NUM_TILES):
                o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
                m_v = o_v < V
                b_p = _probabilities(p_row, o_v, m_v, b_temperature, b_max, b_sum)
                b_key = _rank_keys_of(b_p, o_v, m_v, ID_BITS)
                m_sel = m_v & (b_key < b_hi) & ((b_key >> (shift + 8)) == (b_prefix >> (shift + 8)))
                b_hist += tl.histogram(((b_key >> shift) & 255).to(tl.int32), 256, mask=m_sel)
            if level == 0:
                b_all = tl.sum(b_hist, axis=0)
            b_at_or_above = tl.cumsum(b_hist, axis=0, reverse=True)  # [256]
            b_digit = tl.max(tl.where(b_at_or_above >= b_need, o_d, -1), axis=0)
            b_above = tl.sum(tl.where(o_d > b_digit, b_hist, 0), axis=0)
            b_need -= b_above
            b_prefix = b_prefix | (tl.maximum(b_digit, 0).to(tl.int64) << shift)
        return tl.where(b_all <= CAP, 0, b_prefix)

    @triton.jit
    def _mass_from(p_row, V, b_temperature, b_max, b_sum, b_lo, ID_BITS, BLOCK_V, NUM_TILES):
        """The probability mass of the row's keys >= lo."""
        b_mass = tl.full([], 0.0, tl.float32)
        for i_t in range(0, NUM_TILES):
            o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
            m_v = o_v < V
            b_p = _probabilities(p_row, o_v, m_v, b_temperature, b_max, b_sum)
            b_key = _rank_keys_of(b_p, o_v, m_v, ID_BITS)
            b_mass += tl.sum(tl.where(m_v & (b_key >= b_lo), b_p, 0.0), axis=0)
        return b_mass

    @triton.jit
    def _min_exponential(b_key, b_first, b_last, BLOCK_V: tl.constexpr):
        """min E_r over the ranks [first, last) (+inf when empty). A while loop: the interpreter
        cannot take a computed value as a loop bound."""
        b_min = tl.full([], float("inf"), tl.float32)
        i_r = b_first
        while i_r < b_last:
            o_r = i_r + tl.arange(0, BLOCK_V)
            b_e = _exponential(b_key, o_r)
            b_min = tl.minimum(b_min, tl.min(tl.where(o_r < b_last, b_e, float("inf")), axis=0))
            i_r += BLOCK_V
        return b_min

    @triton.jit
    def _draw_kernel(
        p_logits,
        stride_row,
        p_temperature,
        p_top_p,
        p_top_k,
        p_min_p,
        p_stats,
        p_counts,
        p_seeds,
        p_positions,
        p_scratch,
        p_tokens,
        V,
        BINS: tl.constexpr,
        CAP: tl.constexpr,
        ID_BITS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        NUM_TILES: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        p_row = p_logits + i_b * stride_row
        p_slots = p_scratch + i_b * CAP
        b_temperature = tl.load(p_temperature)
        b_top_p = tl.load(p_top_p)
        b_max = tl.load(p_stats + 2 * i_b)
        b_sum = tl.load(p_stats + 2 * i_b + 1)
        # Off: k = V and min_p = 0 keep every rank, and the renormaliser b_z is 1.
        b_top_k = tl.load(p_top_k).to(tl.int32)
        b_by_top_k = (b_top_k > 0) & (b_top_k < V)
        b_k = tl.where(b_by_top_k, b_top_k, V)
        b_min_p = tl.load(p_min_p)
        b_p_max = 1.0 / b_sum  # the largest p, exp(0) / sum, as _probabilities forms it
        b_seed = tl.load(p_seeds + i_b).to(tl.uint64, bitcast=True)
        b_position = tl.load(p_positions + i_b).to(tl.uint64, bitcast=True)
        b_stream = b_seed * 0x9E3779B97F4A7C15 + b_position * 0xD1B54A32D192ED03
        # The nucleus bound b* and the head window from the histogram.
        o_bin = tl.arange(0, BINS)
        b_counts = tl.load(p_counts + i_b * BINS + o_bin)  # [BINS]
        b_edges = (o_bin << 21).to(tl.float32, bitcast=True)
        b_floor_mass = tl.cumsum(b_counts.to(tl.float32) * b_edges, axis=0, reverse=True)
        # A margin over float32 rounding of the sums of mass (the reference's and ours).
        b_star = tl.max(tl.where(b_floor_mass >= b_top_p * 1.00390625, o_bin, 0), axis=0)
        b_counted = tl.cumsum(b_counts, axis=0, reverse=True)  # tokens in bins >= b
        # Below the highest bin with k tokens at or above it every rank is >= k; below the bin
        # of min_p * p_max every p is smaller.
        b_star_k = tl.max(tl.where(b_counted >= b_k, o_bin, 0), axis=0)
        b_star = tl.where(b_by_top_k, tl.maximum(b_star, b_star_k), b_star)
        b_star_min_p = (b_min_p * b_p_max).to(tl.int32, bitcast=True) >> 21
        b_star = tl.where(b_min_p > 0, tl.maximum(b_star, b_star_min_p), b_star)
        b_total = tl.sum(tl.where(o_bin >= b_star, b_counts, 0), axis=0)  # ranks that may be kept
        b_head = tl.min(tl.where((b_counted <= CAP) & (o_bin >= b_star), o_bin, BINS), axis=0)
        b_hi = tl.full([], 1 << 62, tl.int64)
        b_lo = b_head.to(tl.int64) << (21 + ID_BITS)
        b_first = tl.full([], 1, tl.int32)  # the first window comes from the histogram
        b_done = tl.full([], 0, tl.int32)
        b_rank = tl.full([], 0, tl.int32)  # ranks raced so far
        b_mass = tl.full([], 0.0, tl.float32)  # their probability mass
        b_best = tl.full([], -1.0, tl.float32)
        b_token = tl.full([], 0, tl.int64)
        if _unfiltered(p_top_p, p_top_k, p_min_p, V):
            # Every token kept: the race keyed by token id, in one read, and nothing after it.
            for i_t in range(0, NUM_TILES):
                o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
                m_v = o_v < V
                b_p = _probabilities(p_row, o_v, m_v, b_temperature, b_max, b_sum)
                b_score = tl.where(m_v, b_p / _exponential(b_stream, o_v), -1.0)
                b_tile_best = tl.max(b_score, axis=0)
                if b_tile_best > b_best:
                    b_best = b_tile_best
                    b_at = tl.argmax(b_score, axis=0, tie_break_left=True)
                    b_token = (i_t * BLOCK_V + b_at).to(tl.int64)
            b_done = 1  # (top-k is off: no top-k mass either)
        # The mass of the k first ranks: from the head window when it holds them, else now.
        b_z = tl.full([], 1.0, tl.float32)
        b_head_count = tl.sum(tl.where(o_bin == b_head, b_counted, 0), axis=0)
        if b_by_top_k & (b_head_count < b_k):
            b_kth = _radix_floor(
                p_row, V, b_temperature, b_max, b_sum, 1 << 62, ID_BITS, BLOCK_V, NUM_TILES, b_k
            )
            b_z = _mass_from(
                p_row, V, b_temperature, b_max, b_sum, b_kth, ID_BITS, BLOCK_V, NUM_TILES
            )
        o_c = tl.arange(0, CAP)
        while b_done == 0:
            if b_first == 0:
                b_lo = _radix_floor(
                    p_row, V, b_temperature, b_max, b_sum, b_hi, ID_BITS, BLOCK_V, NUM_TILES, CAP
                )
            b_n = tl.full([], 0, tl.int32)
            if (b_head < BINS) | (b_first == 0):
                b_n = _gather(
                    p_row,
                    p_slots,
                    V,
                    b_temperature,
                    b_max,
                    b_sum,
                    b_lo,
                    b_hi,
                    ID_BITS,
                    BLOCK_V,
                    NUM_TILES,
                    CAP,
                )
            tl.debug_barrier()  # the scratch written by every thread, read by every thread
            m_c = o_c < b_n
            b_keys = tl.sort(tl.load(p_slots + o_c, mask=m_c, other=-1), descending=True)
            tl.debug_barrier()  # read before the next window overwrites it
            b_p = (b_keys >> ID_BITS).to(tl.int32).to(tl.float32, bitcast=True)
            b_p = tl.where(m_c, b_p, 0.0)  # [CAP], descending
            b_cumulative = b_mass + tl.cumsum(b_p, axis=0)
            o_rank = b_rank + o_c
            m_kth = m_c & b_by_top_k & (o_rank == b_k - 1) & (b_first == 1)
            if tl.sum(m_kth.to(tl.int32), axis=0) > 0:
                b_z = tl.sum(tl.where(m_kth, b_cumulative, 0.0), axis=0)
            m_rule = (b_cumulative - b_p < b_top_p * b_z) & (o_rank < b_k)
            m_kept = m_c & ((o_rank == 0) | (m_rule & (b_p >= b_min_p * b_p_max)))
            b_e = _exponential(b_stream, o_rank)
            b_score = tl.where(m_kept, b_p / b_e, -1.0)
            b_window_best = tl.max(b_score, axis=0)
            b_at = tl.argmax(b_score, axis=0, tie_break_left=True)
            b_id = (1 << ID_BITS) - 1 - (b_keys & ((1 << ID_BITS) - 1))
            if b_window_best > b_best:
                b_best = b_window_best
                b_token = tl.sum(tl.where(o_c == b_at, b_id, 0), axis=0)
            b_cut = tl.sum((m_c & ~m_kept).to(tl.int32), axis=0) > 0
            b_mass = tl.max(tl.where(m_c, b_cumulative, b_mass), axis=0)
            b_last_p = tl.min(tl.where(m_c, b_p, 1.0), axis=0)  # bounds every later rank's p
            b_rank += b_n
            b_hi = tl.where(b_n > 0, b_lo, b_hi)
            b_first = 0
            b_open = tl.minimum(b_total, b_k)  # ranks that may still be kept
            if b_cut | (b_rank >= b_open):
                b_done = 1
            else:
                # Ranks still open cannot beat b_best when even the smallest E among them
                # could not lift the largest p they may have above it.
                b_tail = b_last_p / _min_exponential(b_stream, b_rank, b_open, BLOCK_V)
                if b_best >= b_tail:
                    b_done = 1
        tl.store(p_tokens + i_b, b_token)


def _tiles(logits: torch.Tensor) -> int:
    return -(-logits.shape[1] // BLOCK_V)


def device_scalar(value, device: torch.device) -> torch.Tensor:
    """A 0-d float32 device tensor: the given one, or a fill (no host copy, no sync)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32)
    return torch.full((), float(value), dtype=torch.float32, device=device)


def row_stats_triton(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Pass 1: per row (max, normaliser) of softmax(logits / T), [B, 2] fp32."""
    stats = torch.empty((logits.shape[0], 2), dtype=torch.float32, device=logits.device)
    _row_stats_kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        temperature,
        stats,
        logits.shape[1],
        BLOCK_V=BLOCK_V,
        NUM_TILES=_tiles(logits),
    )
    return stats


def histogram_triton(logits, temperature, top_p, top_k, min_p, stats) -> torch.Tensor:
    """Pass 2: per row the probability histogram [B, BINS] int32 (zeros, the row unread, when
    the options filter nothing); the options 0-d float32 device tensors."""
    counts = torch.empty((logits.shape[0], BINS), dtype=torch.int32, device=logits.device)
    _histogram_kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        temperature,
        top_p,
        top_k,
        min_p,
        stats,
        counts,
        logits.shape[1],
        BINS=BINS,
        BLOCK_V=BLOCK_V,
        NUM_TILES=_tiles(logits),
    )
    return counts


def draw_triton(
    logits, temperature, top_p, top_k, min_p, stats, counts, seeds, positions, cap: int = CAP
) -> torch.Tensor:
    """Pass 3: per row the drawn token [B] int64; ``top_k`` and ``min_p`` 0-d float32 device
    tensors (0: off); ``cap`` candidate slots per row (a power of two; tests take small ones,
    which send more rows down the windowed path)."""
    rows = logits.shape[0]
    scratch = torch.empty((rows, cap), dtype=torch.int64, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _draw_kernel[(rows,)](
        logits,
        logits.stride(0),
        temperature,
        top_p,
        top_k,
        min_p,
        stats,
        counts,
        seeds,
        positions,
        scratch,
        tokens,
        logits.shape[1],
        BINS=BINS,
        CAP=cap,
        ID_BITS=ID_BITS,
        BLOCK_V=BLOCK_V,
        NUM_TILES=_tiles(logits),
        num_warps=8,
    )
    return tokens


def sample_top_p_triton(
    logits, seeds, positions, temperature, top_p, top_k=0, min_p=0.0
) -> torch.Tensor:
    """Triton version of ``sample_tokens_reference`` (CUDA, or CPU under TRITON_INTERPRET=1):
    logits [B, V] (V < 2^20, the last dim contiguous), seeds and positions [B] int64,
    temperature, top_p, top_k and min_p numbers or 0-d tensors."""
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    device = logits.device
    temperature = device_scalar(temperature, device)
    top_p, top_k, min_p = (device_scalar(value, device) for value in (top_p, top_k, min_p))
    stats = row_stats_triton(logits, temperature)
    counts = histogram_triton(logits, temperature, top_p, top_k, min_p, stats)
    return draw_triton(logits, temperature, top_p, top_k, min_p, stats, counts, seeds, positions)
