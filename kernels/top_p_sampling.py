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
rank the lower token id first. Keyed by rank only where top-p is the one filter (top_p < 1, no
top-k, no min-p: the trainer's settings, whose recorded draws it keeps); at every other setting
(no filter: TRL's and the facade's defaults; any top-k or min-p) the race is keyed by token id
(E_v, the hash of v): the same distribution, and the kept tokens, always the ranks before a cut,
are then those with a key at or above the cut's, whose ranks need not be found. top_p >= 1
tests no cumulative mass (a rounded sum cannot drop a token).

Reference (``sample_tokens_reference``): a full sort of every row, in torch ops.

Triton (``sample_top_p_triton``), per row, three passes over the logits and no full sort (two
when the kept tokens are a threshold on p: no filter or min-p alone, where pass 2 skips the row
and pass 3 races the tokens with p >= min_p * p_max by id in one read) (a candidate filter in
the spirit of FlashInfer's and Qrita's pivot-based top-p, but with one histogram in place of an
iterative pivot search, and exact):
1. ``_row_stats_kernel``: the softmax's max and normaliser (online, fp32);
2. ``_histogram_kernel``: a histogram of the probabilities by the top bits of their float32
   pattern, ``BINS`` sixteenth-octave bins counted down from the row's largest p (bin BINS - 1;
   bin 0 holds every p more than 64 octaves below it), so ordering bins orders tokens;
3. ``_draw_kernel`` (its row reads in ``top_p_rows``): the highest bin b* whose bins >= b* hold
   at least top_p of mass by their lower edges bounds the nucleus (every token below b* has at
   least that much mass before it); with top-k or min-p on, b* is also at least the highest bin
   with k tokens at or above it and the bin of min_p * p_max. Keyed by token id, the bins whose
   every token is surely kept (within the k first ranks by the counts, above the floor's bin,
   short of top_p even by upper edges) start at b_sure: in one read their tokens race by id and
   their mass is summed, while the tokens of bins [b*, b_sure) (from top-k's bin when the k
   first ranks' mass is needed; usually a handful) are gathered into a row scratch of ``CAP``
   slots, sorted there by (p, -id), and raced over their exact ranks, cumulative mass and
   hashed noise. Keyed by rank (the trainer's top-p), b_sure is past every bin and every
   candidate is gathered. That is exact whenever they fit: top-k with k and its bin within
   ``CAP``, min-p with top-p or top-k whose uncertain bins fit, top-p alone unless the row's
   nucleus is flat over thousands of tokens.
   When they do not fit, the top bins that fit are raced, and the ranks after them cannot win
   if the best score so far is >= q / min E over them (q bounds their p; the E are known from
   the ranks alone, or bounded by the smallest over every token id): that settles peaked rows.
   A row still open continues exactly, in windows of the next ``CAP`` tokens in rank order,
   each found by a radix select over the (p, -id) key (7 histogram passes) and gathered (one
   more): slow, and only for rows whose uncertain tokens spread over more than ``CAP`` (the
   trainer's top-p on a flat row; top-k past ``CAP`` on one, or top-p with min-p). The mass
   of the k first ranks comes from the sure bins and the head window when they hold them; else
   a radix select of the k-th key and one more pass sum it (8 more passes, for that row only).
Reads of each row, 4 rows of V = 2,000 at T = 0.8 and cap 64, flat (logits x 0.2) / peaked
(x 4), counted in the interpreter (``tests/ops/test_top_p_sampling.py``): top-p 0.9 alone
61 / 3; no filter 2 / 2; min-p 0.05 alone 2 / 2; top-k 50 with top-p 0.95 or 1: 3 / 3;
top-p 0.9, top-k 20, min-p 0.1: 3 / 3.
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

# Triton: histogram bins of a probability's float32 bits >> 19 (sixteenth-octave bins) counted
# down from the row's largest p (bin BINS - 1; bin 0 holds every p 64 octaves below it), candidate
# slots per row, token ids in the low 20 bits of the (p, -id) key.
BINS = 1024
CAP = 4096
ID_BITS = 20
BLOCK_V = 4096
DRAW_BLOCK_V = 2048  # pass 3's tiles: 4,096 wide, its reads next to the sort spill registers


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
        # mass_before of rank 0 is 0 < top_p, so the first token is always kept; top_p >= 1
        # keeps every token (no test a rounded cumulative sum could fail).
        return sorted_probs.masked_fill((mass_before >= top_p) & (top_p < 1), 0.0), sorted_ids
    # Options as tensors: off, k = V, the renormaliser is 1 and min_p 0, which drop nothing.
    rows, vocab = logits.shape
    top_k = torch.as_tensor(top_k, device=logits.device)
    by_top_k = (top_k > 0) & (top_k < vocab)
    k = torch.where(by_top_k, top_k, vocab).long()
    # top-p over the distribution renormalised on the k first ranks (transformers' order).
    mass_k = cumulative.gather(1, (k - 1).expand(rows, 1))
    threshold = top_p * torch.where(by_top_k, mass_k, 1.0)
    ranks = torch.arange(vocab, device=logits.device)
    dropped = ((mass_before >= threshold) & (top_p < 1)) | (ranks >= k)
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
    keyed_by_rank = races_by_rank(top_p, top_k, min_p, logits.shape[1])
    if keyed_by_rank is True:
        return by_rank
    # Any other setting: the race keyed by token id (exponential[:, v] is E_v).
    kept_by_id = torch.zeros_like(kept).scatter_(1, ids, kept)
    by_id = (kept_by_id / exponential).argmax(dim=-1)
    return by_id if keyed_by_rank is False else torch.where(keyed_by_rank, by_rank, by_id)


def races_by_rank(top_p, top_k, min_p, vocab: int):
    """Whether the race is keyed by rank: top-p is the only filter (top_p < 1, top-k off or
    >= V, min_p 0: the trainer's settings, whose recorded draws the rank keys keep). A bool for
    numbers, a 0-d bool tensor when any option is a tensor (a CUDA graph's settings)."""
    if not any(isinstance(value, torch.Tensor) for value in (top_p, top_k, min_p)):
        return top_p < 1 and (top_k <= 0 or top_k >= vocab) and min_p <= 0
    top_p, top_k, min_p = (torch.as_tensor(value) for value in (top_p, top_k, min_p))
    return (top_p < 1) & ((top_k <= 0) | (top_k >= vocab)) & (min_p <= 0)


if triton is not None:
    from rlvr_fast.kernels.top_p_rows import (
        _exponential,
        _gather,
        _gather_racing_above,
        _mass_from,
        _min_exponential,
        _probabilities,
        _radix_floor,
    )

    @triton.jit
    def _threshold_only(p_top_p, p_top_k, V):
        """Whether the row's kept tokens are those with p >= min_p * p_max (top_p 1, no top-k):
        no filter, or min-p alone. The draw races them by token id in one read."""
        b_top_k = tl.load(p_top_k).to(tl.int32)
        return (tl.load(p_top_p) >= 1.0) & ((b_top_k <= 0) | (b_top_k >= V))

    @triton.jit
    def _bin_base(b_sum, BINS: tl.constexpr):
        """The row's bin offset: p_max = 1 / sum (as _probabilities forms it) in bin BINS - 1."""
        return ((1.0 / b_sum).to(tl.int32, bitcast=True) >> 19) - (BINS - 1)

    @triton.jit
    def _bins_of(b_p, b_base):
        """The bin of each p: its float32 bits >> 19 less the row's base, 0 at least."""
        return tl.maximum((b_p.to(tl.int32, bitcast=True) >> 19) - b_base, 0)

    @triton.jit
    def _bin_key(b_bin, b_base, BINS: tl.constexpr, ID_BITS: tl.constexpr):
        """The smallest (p, -id) key of bin b (0 for bin 0; past every key for b >= BINS)."""
        b_key = (b_bin + b_base).to(tl.int64) << (19 + ID_BITS)
        return tl.where(b_bin >= BINS, 1 << 62, tl.where(b_bin > 0, b_key, 0))

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
        b_base = _bin_base(b_sum, BINS)
        # No filter or min-p alone: the draw races the tokens by id and reads no histogram.
        if not _threshold_only(p_top_p, p_top_k, V):
            for i_t in range(0, NUM_TILES):
                o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
                m_v = o_v < V
                b_p = _probabilities(p_row, o_v, m_v, b_temperature, b_max, b_sum)
                b_counts += tl.histogram(_bins_of(b_p, b_base), BINS, mask=m_v)
        tl.store(p_counts + i_b * BINS + tl.arange(0, BINS), b_counts)

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
        b_base = _bin_base(b_sum, BINS)
        b_edges = tl.where(o_bin > 0, ((o_bin + b_base) << 19).to(tl.float32, bitcast=True), 0.0)
        b_floor_mass = tl.cumsum(b_counts.to(tl.float32) * b_edges, axis=0, reverse=True)
        # A margin over float32 rounding of the sums of mass (the reference's and ours).
        b_star = tl.max(tl.where(b_floor_mass >= b_top_p * 1.00390625, o_bin, 0), axis=0)
        b_counted = tl.cumsum(b_counts, axis=0, reverse=True)  # tokens in bins >= b
        # Below the highest bin with k tokens at or above it every rank is >= k; below the bin
        # of min_p * p_max every p is smaller.
        b_star_k = tl.max(tl.where(b_counted >= b_k, o_bin, 0), axis=0)
        b_star = tl.where(b_by_top_k, tl.maximum(b_star, b_star_k), b_star)
        b_floor = b_min_p * b_p_max  # 0 when min-p is off
        b_star_min_p = _bins_of(b_floor, b_base)
        b_star = tl.where(b_min_p > 0, tl.maximum(b_star, b_star_min_p), b_star)
        b_total = tl.sum(tl.where(o_bin >= b_star, b_counts, 0), axis=0)  # ranks that may be kept
        # Keyed by token id (any setting but top-p alone), every token of the bins >= b_sure is
        # surely kept and races in the read that gathers the window below them: sure by top-k
        # when its bin is within the k first ranks, by min-p when above the floor's bin, by top-p
        # when even the upper edges' mass of the bins >= its own is short of top_p times a lower
        # bound of the k first ranks' mass (their bins' lower edges).
        b_by_rank = (b_top_p < 1.0) & ((b_top_k <= 0) | (b_top_k >= V)) & (b_min_p <= 0.0)
        b_need_z = b_by_top_k & (b_top_p < 1.0)  # the k first ranks' exact mass
        b_z_low = tl.sum(tl.where(o_bin > b_star_k, b_counts.to(tl.float32) * b_edges, 0.0), axis=0)
        b_z_low = tl.where(b_by_top_k, b_z_low, 1.0)
        b_upper = ((o_bin + 1 + b_base) << 19).to(tl.float32, bitcast=True)
        b_ceiling_mass = tl.cumsum(b_counts.to(tl.float32) * b_upper, axis=0, reverse=True)
        # (tl.where on the scalar conditions: the interpreter cannot & a float comparison's
        # scalar with a vector.)
        m_open = tl.where(b_top_p < 1.0, b_ceiling_mass * 1.00390625 >= b_top_p * b_z_low, False)
        m_open |= tl.where(b_by_top_k, b_counted > b_k, False)
        m_open |= tl.where(b_min_p > 0.0, o_bin <= b_star_min_p, False)
        b_sure = tl.where(b_by_rank, BINS, tl.max(tl.where(m_open, o_bin, -1), axis=0) + 1)
        b_sure_count = tl.sum(tl.where(o_bin >= b_sure, b_counts, 0), axis=0)
        # The head window: the lowest bins from b* (from top-k's bound when the k first ranks'
        # mass is needed) up whose tokens below b_sure fit in CAP slots.
        b_from = tl.where(b_need_z, b_star_k, b_star)
        b_window = b_counted - b_sure_count  # tokens in bins [b, b_sure)
        b_head = tl.min(tl.where((b_window <= CAP) & (o_bin >= b_from), o_bin, b_sure), axis=0)
        b_hi = _bin_key(b_sure, b_base, BINS, ID_BITS)
        b_lo = _bin_key(b_head, b_base, BINS, ID_BITS)
        b_threshold_only = _threshold_only(p_top_p, p_top_k, V)
        if b_threshold_only:
            # No histogram: the kept tokens are those with p >= the floor (every one when min-p
            # is off), by their keys; nothing to gather, and nothing after this read.
            b_hi = b_floor.to(tl.int32, bitcast=True).to(tl.int64) << ID_BITS
            b_lo = b_hi
            b_head = b_head * 0
            b_total = b_total * 0
        b_first = tl.full([], 1, tl.int32)  # the first window comes from the histogram
        b_done = tl.full([], 0, tl.int32)
        b_rank = tl.full([], 0, tl.int32)  # ranks raced so far
        b_mass = tl.full([], 0.0, tl.float32)  # their probability mass
        b_best = tl.full([], -1.0, tl.float32)
        b_token = tl.full([], 0, tl.int64)
        # The mass of the k first ranks: from the head window when it holds them, else now.
        b_z = tl.full([], 1.0, tl.float32)
        b_head_count = tl.sum(tl.where(o_bin == b_head, b_counted, 0), axis=0)
        if b_need_z & (b_head_count < b_k):
            b_kth = _radix_floor(
                p_row, V, b_temperature, b_max, b_sum, 1 << 62, ID_BITS, BLOCK_V, NUM_TILES, b_k
            )
            b_z = _mass_from(
                p_row, V, b_temperature, b_max, b_sum, b_kth, ID_BITS, BLOCK_V, NUM_TILES
            )
        o_c = tl.arange(0, CAP)
        while b_done == 0:
            b_n = tl.full([], 0, tl.int32)
            if b_first == 1:
                if b_head < BINS:
                    b_n, b_best, b_token, b_mass = _gather_racing_above(
                        p_row,
                        p_slots,
                        V,
                        b_temperature,
                        b_max,
                        b_sum,
                        b_lo,
                        b_hi,
                        b_stream,
                        ID_BITS,
                        BLOCK_V,
                        NUM_TILES,
                        CAP,
                    )
                    b_rank = b_sure_count  # (0 with no histogram)
                    if b_need_z & (b_rank == b_k):  # the k first ranks are the sure ones
                        b_z = b_mass
            else:
                b_lo = _radix_floor(
                    p_row, V, b_temperature, b_max, b_sum, b_hi, ID_BITS, BLOCK_V, NUM_TILES, CAP
                )
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
            m_top_p = tl.where(b_top_p < 1.0, b_cumulative - b_p < b_top_p * b_z, True)
            m_rule = m_top_p & (o_rank < b_k)
            m_kept = m_c & ((o_rank == 0) | (m_rule & (b_p >= b_floor)))
            b_id = ((1 << ID_BITS) - 1 - (b_keys & ((1 << ID_BITS) - 1))).to(tl.int32)
            b_e = _exponential(b_stream, tl.where(b_by_rank, o_rank, b_id))
            b_score = tl.where(m_kept, b_p / b_e, -1.0)
            b_window_best = tl.max(b_score, axis=0)
            b_at = tl.argmax(b_score, axis=0, tie_break_left=True)
            if b_window_best > b_best:
                b_best = b_window_best
                b_token = tl.sum(tl.where(o_c == b_at, b_id, 0), axis=0).to(tl.int64)
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
                # could not lift the largest p they may have above it (E of their ranks, or of
                # any token id when keyed by id).
                b_from_e = tl.where(b_by_rank, b_rank, 0)
                b_to_e = tl.where(b_by_rank, b_open, V)
                if b_best >= b_last_p / _min_exponential(b_stream, b_from_e, b_to_e, BLOCK_V):
                    b_done = 1
        tl.store(p_tokens + i_b, b_token)


def _tiles(logits: torch.Tensor, block: int = BLOCK_V) -> int:
    return -(-logits.shape[1] // block)


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
        BLOCK_V=DRAW_BLOCK_V,
        NUM_TILES=_tiles(logits, DRAW_BLOCK_V),
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
