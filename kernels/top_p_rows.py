"""The sampler's reads of a row in Triton (``top_p_sampling``'s passes 2 and 3): its
probabilities and (p, -id) keys as softmax(logits / T) forms them, the hashed exponential noise,
the gather of a key range into the candidate scratch (with, in the same read, the race over the
surely kept keys above it), the radix select of the windows past the first, a key range's mass
and the smallest noise over a range of ranks or ids."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference needs no Triton
    triton = None

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
    def _gather_racing_above(
        p_row,
        p_scratch,
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
    ):
        """``_gather`` of [lo, hi), and in the same read the race keyed by token id over the keys
        >= hi (every one of them kept): returns (how many gathered, the best p / E_v above and
        its token, their probability mass)."""
        b_n = tl.full([], 0, tl.int32)
        b_best = tl.full([], -1.0, tl.float32)
        b_token = tl.full([], 0, tl.int64)
        b_mass = tl.full([], 0.0, tl.float32)
        for i_t in range(0, NUM_TILES):
            o_v = i_t * BLOCK_V + tl.arange(0, BLOCK_V)
            m_v = o_v < V
            b_p = _probabilities(p_row, o_v, m_v, b_temperature, b_max, b_sum)
            b_key = _rank_keys_of(b_p, o_v, m_v, ID_BITS)
            m_sel = m_v & (b_key >= b_lo) & (b_key < b_hi)
            o_slot = b_n + tl.cumsum(m_sel.to(tl.int32), axis=0) - 1
            tl.store(p_scratch + o_slot, b_key, mask=m_sel & (o_slot < CAP))
            b_n += tl.sum(m_sel.to(tl.int32), axis=0)
            m_above = m_v & (b_key >= b_hi)
            b_mass += tl.sum(tl.where(m_above, b_p, 0.0), axis=0)
            b_score = tl.where(m_above, b_p / _exponential(b_stream, o_v), -1.0)
            b_tile_best = tl.max(b_score, axis=0)
            if b_tile_best > b_best:
                b_best = b_tile_best
                b_token = (i_t * BLOCK_V + tl.argmax(b_score, axis=0, tie_break_left=True)).to(
                    tl.int64
                )
        return b_n, b_best, b_token, b_mass

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
