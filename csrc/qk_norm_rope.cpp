// The attention prologue of one paged pass on CPU in one call (float32, inference): per-head
// q/k RMSNorm, rotate-half RoPE, and the store of the new keys and values into their cache
// slots; the C++ twin of rlvr_fast.kernels.qk_norm_rope (see there for shapes). The torch ops it
// replaces (a weight concat, the norm, a roll, two products, a sum, two transposes and two
// index copies) cost about fifteen dispatches per layer on a dispatch-bound small model.
//
// Bitwise equal to those torch ops on CPU: the norm is rms_norm_row (the C++ norm the decoder
// already used), and RoPE forms x * cos, roll(x) * sin and their sum as three roundings, as the
// element-wise torch ops do (setup.py compiles with -ffp-contract=off).

#include "torch_api.h"

#include "decode_ops.h"

#include <ATen/Parallel.h>

#include <vector>

#include "rms_row.h"

namespace {

void check_inputs(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& key_slots, const at::Tensor& value_slots,
                  const at::Tensor& slot_mapping, int64_t num_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2,
              "qk_norm_rope_store_cpu: qkv must be a float32 CPU tensor [N, (Hq + 2 Hkv) D]");
  TORCH_CHECK(key_slots.dim() == 3 && key_slots.sizes() == value_slots.sizes() &&
                  key_slots.scalar_type() == at::kFloat &&
                  value_slots.scalar_type() == at::kFloat && key_slots.is_contiguous() &&
                  value_slots.is_contiguous(),
              "qk_norm_rope_store_cpu: key_slots and value_slots must be contiguous float32 "
              "[S, Hkv, D]");
  const int64_t kv_heads = key_slots.size(1), dim = key_slots.size(2);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * kv_heads) * dim,
              "qk_norm_rope_store_cpu: qkv width must be (Hq + 2 Hkv) * D with D even");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() >= 1 && cos.size(-1) == dim &&
                  cos.numel() == qkv.size(0) * dim && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "qk_norm_rope_store_cpu: cos and sin must be float32 [..., D] with N rows");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == qkv.size(0),
              "qk_norm_rope_store_cpu: slot_mapping must be int64 [N]");
}

// y = x * cos + roll(x, D / 2) * sin for one head of D values.
void rotate(const float* x, const float* cos, const float* sin, int64_t dim, float* y) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const float rolled = x[i < half ? i + half : i - half];
    const float a = x[i] * cos[i];
    const float b = rolled * sin[i];
    y[i] = a + b;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_store_cpu(
    at::Tensor qkv, std::optional<at::Tensor> q_weight,
    std::optional<at::Tensor> k_weight, double eps, at::Tensor cos, at::Tensor sin,
    at::Tensor key_slots, at::Tensor value_slots, at::Tensor slot_mapping,
    int64_t num_heads) {
  check_inputs(qkv, cos, sin, key_slots, value_slots, slot_mapping, num_heads);
  const int64_t tokens = qkv.size(0), kv_heads = key_slots.size(1), dim = key_slots.size(2);
  const int64_t slots = key_slots.size(0);
  const bool norm = q_weight.has_value();
  TORCH_CHECK(norm == k_weight.has_value(), "qk_norm_rope_store_cpu: give both weights or none");
  at::Tensor qw, kw;
  if (norm) {
    qw = q_weight->contiguous();
    kw = k_weight->contiguous();
    TORCH_CHECK(qw.scalar_type() == at::kFloat && kw.scalar_type() == at::kFloat &&
                    qw.numel() == dim && kw.numel() == dim,
                "qk_norm_rope_store_cpu: q and k weights must be float32 [D]");
  }
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t n = 0; n < tokens; ++n) {
    TORCH_CHECK(slot[n] >= 0 && slot[n] < slots, "qk_norm_rope_store_cpu: slot ", slot[n],
                " is outside the cache (", slots, " slots)");
  }
  auto q = at::empty({tokens, num_heads, dim}, qkv.options());
  auto k = at::empty({tokens, kv_heads, dim}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* cos_data = cos.data_ptr<float>();
  const float* sin_data = sin.data_ptr<float>();
  float* q_out = q.data_ptr<float>();
  float* k_out = k.data_ptr<float>();
  float* key_data = key_slots.data_ptr<float>();
  float* value_data = value_slots.data_ptr<float>();
  const int64_t width = qkv.size(1), heads = num_heads + kv_heads;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / width);
  at::parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {
    std::vector<float> normed(dim);
    for (int64_t n = first; n < last; ++n) {
      const float* row = in + n * width;
      const float* c = cos_data + n * dim;
      const float* s = sin_data + n * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = row + h * dim;
        if (norm) {
          rms_norm_row(x, (h < num_heads ? qw : kw).data_ptr<float>(), dim,
                       static_cast<float>(eps), normed.data());
          x = normed.data();
        }
        if (h < num_heads) {
          rotate(x, c, s, dim, q_out + (n * num_heads + h) * dim);
        } else {
          float* y = k_out + (n * kv_heads + h - num_heads) * dim;
          rotate(x, c, s, dim, y);
          std::copy(y, y + dim, key_data + (slot[n] * kv_heads + h - num_heads) * dim);
        }
      }
      std::copy(row + heads * dim, row + width, value_data + slot[n] * kv_heads * dim);
    }
  });
  return {q, k};
}

void register_qk_norm_rope(pybind11::module& m) {
  m.def("qk_norm_rope_store_cpu", &qk_norm_rope_store_cpu, pybind11::arg("qkv"),
        pybind11::arg("q_weight"), pybind11::arg("k_weight"), pybind11::arg("eps"),
        pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("key_slots"),
        pybind11::arg("value_slots"), pybind11::arg("slot_mapping"), pybind11::arg("num_heads"),
        "q/k RMSNorm + RoPE + the KV store into the paged cache, float32 CPU, one call");
}
