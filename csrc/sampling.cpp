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
// The default rule (top-p alone) finds the nucleus and its winner without ordering it
// (draw_from_nucleus, below): a random-weight model's nucleus is most of a 151,936-token
// vocabulary, which the prefix-sorting loop would order whole. Same draws, bit for bit.
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
#include <cstring>
#include <numeric>
#include <vector>

namespace {

constexpr uint64_t kSeedMultiplier = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kPositionMultiplier = 0xD1B54A32D192ED03ULL;
constexpr uint64_t kRankMultiplier = 0x8CB92BA72F3D8DD7ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;
constexpr int kUniformBits = 23;

// The hash's top kUniformBits bits; u = (bits + 0.5) / 2^kUniformBits.
uint64_t uniform_bits(uint64_t key, uint64_t rank) {
  uint64_t x = key + rank * kRankMultiplier;
  x = (x ^ (x >> 30)) * kMix1;
  x = (x ^ (x >> 27)) * kMix2;
  x ^= x >> 31;
  return x >> (64 - kUniformBits);
}

float uniform_of_bits(uint64_t bits) {
  return (static_cast<float>(bits) + 0.5f) * (1.0f / static_cast<float>(1 << kUniformBits));
}

float uniform(uint64_t key, uint64_t rank) { return uniform_of_bits(uniform_bits(key, rank)); }

// The nucleus without ordering it. Tokens fall into buckets by the top 16 bits of p's float32
// pattern (1/128 of an octave each), so bucket order is rank order; a bucket's ranks are
// consecutive. Two facts make the draw exact while ordering only a bucket or three:
// - the cut: every p >= 2^-29 is a multiple of 2^-52 and the masses stay below 2, so the
//   double sums of such p that draw_row's loop forms are exact in any order; a bucket whose
//   last cumulative mass is below top_p by more than float32 rounding holds no cut, and the
//   first that is not is ordered and walked as the loop walks it;
// - the race: no rank of a bucket scores above (the bucket's upper edge) / -log(the largest
//   u over its ranks), known from the ranks alone; only buckets whose bound reaches a score
//   another bucket surely attains (its lower edge over the same u) are ordered and raced.
// A nucleus reaching p < 2^-29, or a NaN, returns -1: draw_row's loop decides those rows.
constexpr int kBucketShift = 16;
constexpr uint32_t kFirstExactBucket = (127 - 29) << 7;  // p >= 2^-29
constexpr uint32_t kLastBucket = 0x3F800000u >> kBucketShift;  // p = 1
constexpr int32_t kNucleusBuckets = kLastBucket - kFirstExactBucket + 1;
constexpr double kCastMargin = 1e-6;  // > two float32 roundings of a mass below 2
constexpr float kLogMargin = 1e-5f;   // std::log's result may not be monotone to the last ulp
constexpr int64_t kWalkedWhole = 4096;  // a nucleus head this small is ordered whole

struct NucleusBucket {
  int32_t index;       // its bucket - kFirstExactBucket
  int64_t first_rank;  // the rank of its largest p
  int64_t size;
  double mass_before;  // of the ranks before it (exact)
  float bound;         // no rank of it scores above this
  float attained;      // some rank of it scores at least this
};

struct NucleusScratch {
  std::vector<int32_t> count = std::vector<int32_t>(kNucleusBuckets);
  std::vector<double> mass = std::vector<double>(kNucleusBuckets);
  std::vector<int64_t> cursor = std::vector<int64_t>(kNucleusBuckets, -1);
  std::vector<int32_t> members;
  std::vector<NucleusBucket> kept;
};

uint32_t bucket_of(float p) {
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  return bits >> kBucketShift;
}

float bucket_edge(int32_t index, uint32_t low_bits) {
  const uint32_t bits = ((index + kFirstExactBucket) << kBucketShift) | low_bits;
  float edge;
  std::memcpy(&edge, &bits, sizeof edge);
  return edge;
}

// The members of the given buckets in rank order, each bucket at its offset in
// scratch.members (one pass over the row, then a sort of each bucket by (p desc, id asc)).
void order_buckets(const float* probs, int64_t vocab, const std::vector<NucleusBucket>& buckets,
                   NucleusScratch& scratch, std::vector<int64_t>& offsets) {
  offsets.clear();
  int64_t total = 0;
  for (const NucleusBucket& bucket : buckets) {
    offsets.push_back(total);
    scratch.cursor[bucket.index] = total;
    total += scratch.count[bucket.index];
  }
  scratch.members.resize(total);
  for (int64_t i = 0; i < vocab; ++i) {
    const uint32_t index = bucket_of(probs[i]) - kFirstExactBucket;
    if (index < static_cast<uint32_t>(kNucleusBuckets) && scratch.cursor[index] >= 0) {
      scratch.members[scratch.cursor[index]++] = static_cast<int32_t>(i);
    }
  }
  const auto before = [probs](int32_t a, int32_t b) {
    return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
  };
  for (size_t j = 0; j < buckets.size(); ++j) {
    scratch.cursor[buckets[j].index] = -1;
    int32_t* first = scratch.members.data() + offsets[j];
    std::sort(first, first + scratch.count[buckets[j].index], before);
  }
}

struct RaceLeader {
  float score = -1.0f;
  int64_t rank = -1, token = -1;
  void enter(float candidate, int64_t at_rank, int64_t token_id) {  // ties: the lower rank
    if (candidate > score || (candidate == score && at_rank < rank)) {
      score = candidate;
      rank = at_rank;
      token = token_id;
    }
  }
};

float race_score(float p, uint64_t key, int64_t rank) {
  return p / -std::log(uniform(key, static_cast<uint64_t>(rank)));
}

// The rank-keyed race of draw_row over the top-p nucleus of probs (no top-k, no min-p), or -1.
int64_t draw_from_nucleus(const float* probs, int64_t vocab, float top_p, uint64_t key,
                          NucleusScratch& scratch) {
  std::fill(scratch.count.begin(), scratch.count.end(), 0);
  std::fill(scratch.mass.begin(), scratch.mass.end(), 0.0);
  int64_t counted = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const uint32_t bucket = bucket_of(probs[i]);
    const uint32_t index = bucket - kFirstExactBucket;
    if (index < static_cast<uint32_t>(kNucleusBuckets)) {
      ++scratch.count[index];
      scratch.mass[index] += probs[i];
      ++counted;
    } else if (bucket > kLastBucket) {
      return -1;
    }
  }
  // The cut: whole buckets while their mass cannot reach top_p, then draw_row's walk.
  std::vector<NucleusBucket>& kept = scratch.kept;
  kept.clear();
  std::vector<int64_t> offsets;
  RaceLeader leader;
  double mass_before = 0.0;
  int64_t rank = 0;
  bool cut = false;
  for (int32_t index = kNucleusBuckets - 1; index >= 0 && !cut; --index) {
    const int64_t size = scratch.count[index];
    if (size == 0) {
      continue;
    }
    const double mass_after = mass_before + scratch.mass[index];
    if (mass_after * (1.0 + kCastMargin) < top_p) {
      kept.push_back({index, rank, size, mass_before, 0.0f, 0.0f});
      mass_before = mass_after;
      rank += size;
      continue;
    }
    // The bucket that may hold the cut and the next one (where the cut falls if not in it),
    // ordered in one pass with every bucket before them when those are few (a peaked row),
    // else alone (the buckets before them race by their bounds).
    std::vector<NucleusBucket> walked;
    if (rank + size <= kWalkedWhole) {
      walked.swap(kept);
    }
    walked.push_back({index, rank, size, mass_before, 0.0f, 0.0f});
    mass_before = mass_after;
    rank += size;
    int32_t next = index - 1;
    while (next >= 0 && scratch.count[next] == 0) {
      --next;
    }
    if (next >= 0) {
      walked.push_back({next, rank, scratch.count[next], mass_before, 0.0f, 0.0f});
      mass_before += scratch.mass[next];
      rank += scratch.count[next];
      index = next;
    }
    order_buckets(probs, vocab, walked, scratch, offsets);
    const int64_t first_rank = walked.front().first_rank;
    double cumulative = walked.front().mass_before;
    for (size_t j = 0; j < scratch.members.size(); ++j) {
      const int32_t token = scratch.members[j];
      const float p = probs[token];
      const int64_t at_rank = first_rank + static_cast<int64_t>(j);
      cumulative += p;
      if (at_rank > 0 && static_cast<float>(cumulative) - p >= top_p) {
        cut = true;
        break;
      }
      leader.enter(race_score(p, key, at_rank), at_rank, token);
    }
  }
  if (!cut && counted < vocab) {
    return -1;  // the walk would reach a p below 2^-29
  }
  // The race over whole buckets: bounds from each bucket's largest u, then only the buckets
  // whose bound reaches the best score surely attained are ordered and raced.
  float attained = leader.score;
  for (NucleusBucket& bucket : kept) {
    uint64_t top_bits = 0;
    for (int64_t r = bucket.first_rank; r < bucket.first_rank + bucket.size; ++r) {
      top_bits = std::max(top_bits, uniform_bits(key, static_cast<uint64_t>(r)));
    }
    const float exponential = -std::log(uniform_of_bits(top_bits));
    bucket.bound = bucket_edge(bucket.index, 0xFFFF) / exponential * (1.0f + kLogMargin);
    bucket.attained = bucket_edge(bucket.index, 0) / exponential * (1.0f - kLogMargin);
    attained = std::max(attained, bucket.attained);
  }
  kept.erase(std::remove_if(kept.begin(), kept.end(),
                            [attained](const NucleusBucket& b) { return b.bound < attained; }),
             kept.end());
  if (kept.empty()) {
    return leader.token;
  }
  order_buckets(probs, vocab, kept, scratch, offsets);
  for (size_t j = 0; j < kept.size(); ++j) {
    const int32_t* members = scratch.members.data() + offsets[j];
    for (int64_t m = 0; m < kept[j].size; ++m) {
      const int64_t at_rank = kept[j].first_rank + m;
      leader.enter(race_score(probs[members[m]], key, at_rank), at_rank, members[m]);
    }
  }
  return leader.token;
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
                 std::vector<float>& probs, std::vector<int64_t>& order, NucleusScratch& nucleus) {
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
  if (!by_top_k && options.min_p <= 0.0f) {
    const int64_t token = draw_from_nucleus(probs.data(), vocab, top_p, key, nucleus);
    if (token >= 0) {
      return token;
    }
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
    NucleusScratch nucleus;
    for (int64_t row = first; row < last; ++row) {
      // The key of the torch version: seed * A + position * B, wrapping modulo 2^64.
      const uint64_t key = static_cast<uint64_t>(seed[row]) * kSeedMultiplier +
                           static_cast<uint64_t>(position[row]) * kPositionMultiplier;
      out[row] = draw_row(data + row * vocab, vocab, options, history_data + row * history_len,
                          history_len, key, probs, order, nucleus);
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
