// One decoder layer of a paged pass on CPU in one call (float32, inference): the same ops the
// Python layer runs (rlvr_fast.models.qwen3.DecoderLayer with its fused ops), in the same order,
// so the result is bitwise the Python layer's; what it removes is the Python between them
// (module calls, backend switches, views), about half of a small model's decode step on a CPU.
//
//   h = rms_norm(x); qkv = linear(h); q = qk_norm_rope_store(qkv) (k, v into the cache);
//   o = paged_attention(q); (h, x) = add_rms_norm(linear(o), x);
//   return x + linear(silu_mul(linear(h)))
//
// x [R, T, H]; cos, sin [R, T, 1, D]; the layer's cache as keys / values [N, S, Hkv, D] and the
// same memory by slot [N * S, Hkv, D]; slot_mapping [R * T]; block_tables [R, M] int32;
// context_lens [R, T] int64 (the pass attends through the cache: not a fresh prefill).

#include "torch_api.h"

#include <optional>

#include "decode_ops.h"

namespace {

at::Tensor decoder_layer_cpu(
    at::Tensor x, at::Tensor input_norm, at::Tensor qkv_weight,
    std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm,
    std::optional<at::Tensor> k_norm, at::Tensor o_weight, at::Tensor post_norm,
    at::Tensor gate_up_weight, at::Tensor down_weight, double eps, at::Tensor cos,
    at::Tensor sin, at::Tensor keys, at::Tensor values, at::Tensor key_slots,
    at::Tensor value_slots, at::Tensor slot_mapping, at::Tensor block_tables,
    at::Tensor context_lens, int64_t num_heads) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "decoder_layer_cpu: x must be a float32 CPU tensor [R, T, H]");
  const int64_t rows = x.size(0), tokens = x.size(1);
  const int64_t head_dim = key_slots.size(2);
  auto h = rms_norm_cpu(x, input_norm, eps);
  auto qkv = at::linear(h, qkv_weight, qkv_bias);
  auto q_k = qk_norm_rope_store_cpu(qkv.view({rows * tokens, qkv.size(2)}), q_norm, k_norm, eps,
                                    cos, sin, key_slots, value_slots, slot_mapping, num_heads);
  auto q = std::get<0>(q_k).view({rows, tokens, num_heads, head_dim}).transpose(1, 2);
  auto out = paged_attention_cpu(q, keys, values, block_tables, context_lens);
  auto attended = at::linear(out.transpose(1, 2).reshape({rows, tokens, num_heads * head_dim}),
                             o_weight);
  auto normed_sum = add_rms_norm_cpu(attended, x, post_norm, eps);
  auto mlp = at::linear(silu_mul_cpu(at::linear(std::get<0>(normed_sum), gate_up_weight)),
                        down_weight);
  return std::get<1>(normed_sum) + mlp;
}

}  // namespace

void register_decoder_layer(pybind11::module& m) {
  m.def("decoder_layer_cpu", &decoder_layer_cpu, pybind11::arg("x"), pybind11::arg("input_norm"),
        pybind11::arg("qkv_weight"), pybind11::arg("qkv_bias"), pybind11::arg("q_norm"),
        pybind11::arg("k_norm"), pybind11::arg("o_weight"), pybind11::arg("post_norm"),
        pybind11::arg("gate_up_weight"), pybind11::arg("down_weight"), pybind11::arg("eps"),
        pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("keys"),
        pybind11::arg("values"), pybind11::arg("key_slots"), pybind11::arg("value_slots"),
        pybind11::arg("slot_mapping"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("num_heads"),
        "One decoder layer of a paged pass, float32 CPU, one call (inference)");
}
