// Paged attention on CPU reading keys and values in place: no gathered copy of a sequence's KV.
//
// q [R, Hq, T, D] float32; k_cache, v_cache [num_blocks, block_size, Hkv, D] float32;
// block_tables [R, M] int32, the blocks of row r in order (the same tables the Triton kernel
// reads); context_lens [R, T] int64: query (r, t) attends to the first context_lens[r, t] tokens
// of row r (decode: T = 1; prefill of a suffix: each query's own position + 1). Query head h reads KV
// head h / (Hq / Hkv) (GQA); scale 1 / sqrt(D). Per (row, query, head): scores, max, exp,
// normaliser and the weighted sum of values in float32; tasks run in parallel with
// at::parallel_for. An AVX2 + FMA version (its exp eight at a time, vec_exp.h) is chosen at run
// time when D is a multiple of 8 (on x86-64 builds; see cpu_features.h).
// The result equals the torch reference (gather + SDPA) up to float32 rounding, not bitwise.

#include "torch_api.h"

#include "decode_ops.h"

#include <ATen/Parallel.h>

#include "cpu_features.h"
#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

struct HeadTask {
  const float* q;         // [D]
  const float* keys;      // cache base, already offset to this KV head
  const float* values;    // likewise
  const int64_t* slots;   // cache slot of each of this row's tokens
  int64_t length;         // keys to attend to
  int64_t slot_stride;    // floats between consecutive slots (Hkv * D)
  int64_t dim;            // D
  float scale;
  float* out;             // [D]
};

// Softmax over the scores in place; returns the normaliser.
float softmax_numerators(float* scores, int64_t length) {
  float top = -INFINITY;
  for (int64_t w = 0; w < length; ++w) top = std::max(top, scores[w]);
  float sum = 0.0f;
  for (int64_t w = 0; w < length; ++w) {
    scores[w] = std::exp(scores[w] - top);
    sum += scores[w];
  }
  return sum;
}

void attend_head_baseline(const HeadTask& t, float* scores) {
  for (int64_t w = 0; w < t.length; ++w) {
    const float* key = t.keys + t.slots[w] * t.slot_stride;
    float dot = 0.0f;
    for (int64_t i = 0; i < t.dim; ++i) dot += t.q[i] * key[i];
    scores[w] = dot * t.scale;
  }
  const float sum = softmax_numerators(scores, t.length);
  for (int64_t i = 0; i < t.dim; ++i) t.out[i] = 0.0f;
  for (int64_t w = 0; w < t.length; ++w) {
    const float* value = t.values + t.slots[w] * t.slot_stride;
    for (int64_t i = 0; i < t.dim; ++i) t.out[i] += scores[w] * value[i];
  }
  for (int64_t i = 0; i < t.dim; ++i) t.out[i] /= sum;
}

#if RLVR_FAST_AVX2
// Softmax over the scores in place, exp eight at a time (vec_exp.h); returns the normaliser. The
// tail goes through the same vector exp, so every score gets the same arithmetic.
__attribute__((target("avx2,fma"))) float softmax_numerators_avx2(float* scores, int64_t length) {
  float top = -INFINITY;
  for (int64_t w = 0; w < length; ++w) top = std::max(top, scores[w]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  int64_t w = 0;
  for (; w + 8 <= length; w += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + w), shift));
    _mm256_storeu_ps(scores + w, e);
    sum = _mm256_add_ps(sum, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  if (w < length) {
    float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::copy(scores + w, scores + length, tail);
    _mm256_storeu_ps(tail, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(tail), shift)));
    for (int64_t i = 0; w + i < length; ++i) {
      scores[w + i] = tail[i];
      total += tail[i];
    }
  }
  return total;
}

__attribute__((target("avx2,fma"))) void attend_head_avx2(const HeadTask& t, float* scores) {
  for (int64_t w = 0; w < t.length; ++w) {
    const float* key = t.keys + t.slots[w] * t.slot_stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < t.dim; i += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(t.q + i), _mm256_loadu_ps(key + i), acc);
    }
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_shuffle_ps(half, half, 1));
    scores[w] = _mm_cvtss_f32(half) * t.scale;
  }
  const __m256 sum = _mm256_set1_ps(softmax_numerators_avx2(scores, t.length));
  for (int64_t i = 0; i < t.dim; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t w = 0; w < t.length; ++w) {
      const float* value = t.values + t.slots[w] * t.slot_stride;
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[w]), _mm256_loadu_ps(value + i), acc);
    }
    _mm256_storeu_ps(t.out + i, _mm256_div_ps(acc, sum));
  }
}
#endif

// Cache slot (block * block_size + offset) of each of a row's first `length` tokens.
void fill_slots(const int32_t* table, int64_t block_size, int64_t length, int64_t* slots) {
  for (int64_t w = 0; w < length; ++w) {
    slots[w] = static_cast<int64_t>(table[w / block_size]) * block_size + w % block_size;
  }
}

}  // namespace

at::Tensor paged_attention_cpu(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 4,
              "paged_attention_cpu: q must be a float32 CPU tensor [R, Hq, T, D]");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                  k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_attention_cpu: k_cache and v_cache must be float32 [N, block_size, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kLong,
              "paged_attention_cpu: block_tables must be int32 and context_lens int64");
  const int64_t rows = q.size(0), q_heads = q.size(1), tokens = q.size(2), dim = q.size(3);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && q_heads % kv_heads == 0,
              "paged_attention_cpu: head_dim mismatch or query heads not a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == rows &&
                  context_lens.dim() == 2 && context_lens.size(0) == rows &&
                  context_lens.size(1) == tokens,
              "paged_attention_cpu: block_tables must be [R, M] and context_lens [R, T]");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t width = block_tables.size(1) * block_size;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  // Each row's longest context, and every block it reads checked against the cache.
  std::vector<int64_t> row_length(rows, 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t length = lens[r * tokens + t];
      TORCH_CHECK(length >= 1 && length <= width,
                  "paged_attention_cpu: every context length must lie in [1, M * block_size]");
      row_length[r] = std::max(row_length[r], length);
    }
    for (int64_t b = 0; b < (row_length[r] + block_size - 1) / block_size; ++b) {
      const int32_t block = tables[r * block_tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention_cpu: block id ", block,
                  " in row ", r, " is outside the cache (", num_blocks, " blocks)");
    }
  }
  auto out = at::empty_like(q);
  auto attend_head = attend_head_baseline;
#if RLVR_FAST_AVX2
  if (cpu_has_avx2_fma() && dim % 8 == 0) attend_head = attend_head_avx2;
#endif
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k_cache.data_ptr<float>();
  const float* v_data = v_cache.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t group = q_heads / kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  // One task per (row, query head, query token); q and out are [R, Hq, T, D]. Consecutive tasks
  // share a row, so each thread fills that row's slots once. A thread's share should be worth
  // waking it for: short contexts of small heads run inline.
  const int64_t longest = std::max<int64_t>(
      1, rows ? *std::max_element(row_length.begin(), row_length.end()) : 1);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (longest * dim));
  at::parallel_for(0, rows * q_heads * tokens, grain, [&](int64_t first, int64_t last) {
    std::vector<float> scores(width);
    std::vector<int64_t> slots(width);
    int64_t slots_row = -1;
    for (int64_t task = first; task < last; ++task) {
      const int64_t row = task / (q_heads * tokens);
      const int64_t head = task / tokens % q_heads;
      const int64_t token = task % tokens;
      const int64_t kv_head = head / group;
      if (row != slots_row) {
        fill_slots(tables + row * block_tables.size(1), block_size, row_length[row],
                   slots.data());
        slots_row = row;
      }
      HeadTask t{q_data + task * dim, k_data + kv_head * dim, v_data + kv_head * dim,
                 slots.data(), lens[row * tokens + token], kv_heads * dim, dim, scale,
                 out_data + task * dim};
      attend_head(t, scores.data());
    }
  });
  return out;
}

void register_paged_attention(pybind11::module& m) {
  m.def("paged_attention_cpu", &paged_attention_cpu, pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"),
        "Paged attention on CPU, float32, reading keys and values in place through block tables");
}
