// Next-token draws on CPU with the study's temperature + top-p rule, one call per decode step:
// the C++ twin of rlvr_fast.kernels.top_p_sampling.sample_tokens_reference (the torch
// definition), which a tiny model on a CPU would otherwise pay ~25 operator dispatches for.
//
// Per row: p = softmax(logits / T) in float32; ranks by p descending (ties: lower token id
// first; only the ranks up to the cut are ever ordered); rank r is kept while the mass of the
// ranks before it is < top_p (rank 0 always); the token is the kept rank maximising p_r / E_r,
// E_r = -log u_r, where u_r is the same splitmix64 hash of (seed, position, r) the torch version
// computes. Rows run in parallel. Equal to the torch version up to float32 rounding of exp / log
// (not bitwise): a draw can differ only where two ranks' p / E are within an ulp.
//
// Options, off by default, as the torch version defines them (transformers' order): the
// repetition penalty on the logits of the row's history (prompt + completion so far) before the
// temperature; top_k keeps ranks < k and tests top-p against top_p times their mass; min_p drops
// ranks with p < min_p * p of rank 0; top_p 1 drops nothing. The race is keyed by token id
// (E_v) at every setting but top-p alone (top_p < 1, no top_k, no min_p: the trainer's, keyed by
// rank), as the torch version's is: with none filtering, every token is kept and nothing sorted.

#include "torch_api.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

constexpr uint64_t kSeedMultiplier = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kPositionMultiplier = 0xD1B54A32D192ED03ULL;
constexpr uint64_t kRankMultiplier = 0x8CB92BA72F3D8DD7ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;
constexpr int kUniformBits = 23;

float uniform(uint64_t key, uint64_t rank) {
  uint64_t x = key + rank * kRankMultiplier;
  x = (x ^ (x >> 30)) * kMix1;
  x = (x ^ (x >> 27)) * kMix2;
  x ^= x >> 31;
  return (static_cast<float>(x >> (64 - kUniformBits)) + 0.5f) *
         (1.0f / static_cast<float>(1 << kUniformBits));
}

struct Options {
  float temperature, top_p, min_p, penalty;
  int64_t top_k;  // 0 or >= vocab: off
};

float penalized(float logit, float penalty) {
  return logit < 0 ? logit * penalty : logit / penalty;
}

int64_t draw_row(const float* logits, int64_t vocab, const Options& options,
                 const int64_t* history, int64_t history_len, uint64_t key,
                 std::vector<float>& probs, std::vector<int64_t>& order) {
  const float temperature = options.temperature, top_p = options.top_p;
  float top = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) {
    probs[i] = logits[i] / temperature;
    top = std::max(top, probs[i]);
  }
  if (history_len > 0) {  // a penalty below 1 raises logits: the maximum is taken again
    for (int64_t j = 0; j < history_len; ++j) {
      probs[history[j]] = penalized(logits[history[j]], options.penalty) / temperature;
    }
    top = *std::max_element(probs.begin(), probs.end());
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < vocab; ++i) {
    probs[i] = std::exp(probs[i] - top);
    sum += probs[i];
  }
  for (int64_t i = 0; i < vocab; ++i) {
    probs[i] /= sum;
  }
  const bool by_top_k = options.top_k > 0 && options.top_k < vocab;
  if (top_p >= 1.0f && !by_top_k && options.min_p <= 0.0f) {
    // No filter (TRL's defaults): every token kept, the race keyed by token id, no ranks.
    float best = -1.0f;
    int64_t token = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const float score = probs[i] / -std::log(uniform(key, static_cast<uint64_t>(i)));
      if (score > best) {
        best = score;
        token = i;
      }
    }
    return token;
  }
  std::iota(order.begin(), order.end(), 0);
  const auto before = [&](int64_t a, int64_t b) {
    return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
  };
  // The mass before rank r as torch computes it: an inclusive cumulative sum accumulated in
  // double and stored as float, minus p_r. Only the ranks up to the cut are needed, so they are
  // ordered a prefix at a time (the first 32, then twice as many, ...), never the whole row
  // unless the nucleus is: the same ranks as a full sort under the same total order.
  const int64_t ranks = by_top_k ? options.top_k : vocab;
  int64_t sorted = 0;
  float threshold = top_p;
  if (by_top_k) {  // top-p over the distribution renormalised on the k first ranks
    std::partial_sort(order.begin(), order.begin() + ranks, order.end(), before);
    sorted = ranks;
    double mass = 0.0;
    for (int64_t rank = 0; rank < ranks; ++rank) {
      mass += probs[order[rank]];
    }
    threshold = top_p * static_cast<float>(mass);
  }
  // Keyed by rank only where top-p is the one filter; top_p 1 tests no cumulative mass.
  const bool by_rank = top_p < 1.0f && !by_top_k && options.min_p <= 0.0f;
  const bool by_top_p = top_p < 1.0f;
  double cumulative = 0.0;
  float best = -1.0f;
  int64_t token = order[0];
  float floor = 0.0f;  // min_p * the largest p
  for (int64_t rank = 0; rank < ranks; ++rank) {
    if (rank == sorted) {
      const int64_t next = std::min<int64_t>(vocab, std::max<int64_t>(32, 2 * sorted));
      std::partial_sort(order.begin() + sorted, order.begin() + next, order.end(), before);
      sorted = next;
    }
    const float p = probs[order[rank]];
    cumulative += p;
    if (rank == 0) {
      floor = options.min_p * p;
    } else if ((by_top_p && static_cast<float>(cumulative) - p >= threshold) || p < floor) {
      break;
    }
    const uint64_t noise = static_cast<uint64_t>(by_rank ? rank : order[rank]);
    const float score = p / -std::log(uniform(key, noise));
    if (score > best) {
      best = score;
      token = order[rank];
    }
  }
  return token;
}

at::Tensor sample_top_p_cpu(at::Tensor logits, at::Tensor seeds, at::Tensor positions,
                               double temperature, double top_p, int64_t top_k, double min_p,
                               double repetition_penalty, c10::optional<at::Tensor> history) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "sample_top_p_cpu: logits must be a float32 CPU tensor [B, V]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab >= 1, "sample_top_p_cpu: empty vocabulary");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  seeds.dim() == 1 && positions.dim() == 1 && seeds.size(0) == rows &&
                  positions.size(0) == rows,
              "sample_top_p_cpu: seeds and positions must be int64 [B]");
  TORCH_CHECK(temperature > 0 && top_p > 0 && top_p <= 1,
              "sample_top_p_cpu: need temperature > 0 and top_p in (0, 1]");
  TORCH_CHECK(top_k >= 0 && min_p >= 0 && min_p <= 1 && repetition_penalty > 0,
              "sample_top_p_cpu: need top_k >= 0, min_p in [0, 1] and repetition_penalty > 0");
  at::Tensor seen = at::empty({rows, 0}, at::kLong);
  if (repetition_penalty != 1.0) {
    TORCH_CHECK(history.has_value() && history->scalar_type() == at::kLong &&
                    history->dim() == 2 && history->size(0) == rows,
                "sample_top_p_cpu: a repetition penalty needs history, int64 [B, L]");
    seen = history->contiguous();
    TORCH_CHECK(seen.numel() == 0 || (seen.min().item<int64_t>() >= 0 &&
                                      seen.max().item<int64_t>() < vocab),
                "sample_top_p_cpu: history holds ids outside the vocabulary");
  }
  const Options options{static_cast<float>(temperature), static_cast<float>(top_p),
                        static_cast<float>(min_p), static_cast<float>(repetition_penalty), top_k};
  const int64_t history_len = seen.size(1);
  const int64_t* history_data = seen.data_ptr<int64_t>();
  logits = logits.contiguous();
  seeds = seeds.contiguous();
  positions = positions.contiguous();
  auto tokens = at::empty({rows}, at::kLong);
  const float* data = logits.data_ptr<float>();
  const int64_t* seed = seeds.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  // A thread's share should be worth waking it for: rows of a small vocabulary run inline.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / vocab);
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    std::vector<float> probs(vocab);
    std::vector<int64_t> order(vocab);
    for (int64_t row = first; row < last; ++row) {
      // The key of the torch version: seed * A + position * B, wrapping modulo 2^64.
      const uint64_t key = static_cast<uint64_t>(seed[row]) * kSeedMultiplier +
                           static_cast<uint64_t>(position[row]) * kPositionMultiplier;
      out[row] = draw_row(data + row * vocab, vocab, options, history_data + row * history_len,
                          history_len, key, probs, order);
    }
  });
  return tokens;
}

}  // namespace

void register_sampling(pybind11::module& m) {
  m.def("sample_top_p_cpu", &sample_top_p_cpu, pybind11::arg("logits"), pybind11::arg("seeds"),
        pybind11::arg("positions"), pybind11::arg("temperature"), pybind11::arg("top_p"),
        pybind11::arg("top_k") = 0, pybind11::arg("min_p") = 0.0,
        pybind11::arg("repetition_penalty") = 1.0, pybind11::arg("history") = pybind11::none(),
        "Temperature + top-p (+ top-k, min-p, repetition penalty) draws, one per row, from "
        "per-row hashed streams (float32, CPU)");
}
