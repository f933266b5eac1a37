// A paged pass on CPU through C++ alone (float32, inference): the same ops the Python decoder
// runs (rlvr_fast.models.qwen3 with its fused ops), in the same order, so the results are
// bitwise the Python ones; what it removes is the Python between them (module calls, backend
// switches, views), most of a small model's decode step on a CPU.
//
// One layer (decoder_layer_cpu, and each layer of DecoderModelCpu):
//   h = rms_norm(x); qkv = linear(h); q = qk_norm_rope_store(qkv) (k, v into the cache);
//   o = paged_attention(q); (h, x) = add_rms_norm(linear(o), x);
//   return x + linear(silu_mul(linear(h)))
// The whole pass (DecoderModelCpu::logits): x = embedding(ids); cos, sin = the RoPE tables'
// rows at the positions; every layer; rms_norm; the LM head on each row's last real token.
//
// x [R, T, H]; cos, sin [R, T, 1, D]; the layer's cache as keys / values [N, S, Hkv, D] and the
// same memory by slot [N * S, Hkv, D]; slot_mapping [R * T]; block_tables [R, M] int32;
// context_lens [R, T] int64 (the pass attends through the cache: not a fresh prefill).

#include "torch_api.h"

#include <optional>
#include <tuple>
#include <vector>

#include "decode_ops.h"

namespace {

struct LayerWeights {
  at::Tensor input_norm, qkv_weight;
  std::optional<at::Tensor> qkv_bias, q_norm, k_norm;
  at::Tensor o_weight, post_norm, gate_up_weight, down_weight;
};

struct LayerCacheViews {
  at::Tensor keys, values, key_slots, value_slots;
};
// A LayerCache as pybind11 hands it over (a named tuple is a tuple).
using CacheTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct PagedInputs {
  at::Tensor cos, sin, slot_mapping, block_tables, context_lens;
};

at::Tensor layer_pass(const LayerWeights& w, const at::Tensor& x, double eps,
                      const LayerCacheViews& cache, const PagedInputs& in, int64_t num_heads) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "decoder_layer_cpu: x must be a float32 CPU tensor [R, T, H]");
  const int64_t rows = x.size(0), tokens = x.size(1);
  const int64_t head_dim = cache.key_slots.size(2);
  auto h = rms_norm_cpu(x, w.input_norm, eps);
  auto qkv = at::linear(h, w.qkv_weight, w.qkv_bias);
  auto q_k = qk_norm_rope_store_cpu(qkv.view({rows * tokens, qkv.size(2)}), w.q_norm, w.k_norm,
                                    eps, in.cos, in.sin, cache.key_slots, cache.value_slots,
                                    in.slot_mapping, num_heads);
  auto q = std::get<0>(q_k).view({rows, tokens, num_heads, head_dim}).transpose(1, 2);
  auto out = paged_attention_cpu(q, cache.keys, cache.values, in.block_tables, in.context_lens);
  auto attended = at::linear(out.transpose(1, 2).reshape({rows, tokens, num_heads * head_dim}),
                             w.o_weight);
  auto normed_sum = add_rms_norm_cpu(attended, x, w.post_norm, eps);
  auto mlp = at::linear(silu_mul_cpu(at::linear(std::get<0>(normed_sum), w.gate_up_weight)),
                        w.down_weight);
  return std::get<1>(normed_sum) + mlp;
}

at::Tensor decoder_layer_cpu(at::Tensor x, at::Tensor input_norm, at::Tensor qkv_weight,
                             std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm,
                             std::optional<at::Tensor> k_norm, at::Tensor o_weight,
                             at::Tensor post_norm, at::Tensor gate_up_weight,
                             at::Tensor down_weight, double eps, at::Tensor cos, at::Tensor sin,
                             at::Tensor keys, at::Tensor values, at::Tensor key_slots,
                             at::Tensor value_slots, at::Tensor slot_mapping,
                             at::Tensor block_tables, at::Tensor context_lens,
                             int64_t num_heads) {
  const LayerWeights weights{input_norm, qkv_weight, qkv_bias, q_norm, k_norm,
                             o_weight, post_norm, gate_up_weight, down_weight};
  return layer_pass(weights, x, eps, {keys, values, key_slots, value_slots},
                    {cos, sin, slot_mapping, block_tables, context_lens}, num_heads);
}

// The decoder's weights, held (the same tensors as the model's parameters, so an optimizer's
// in-place step is seen; a parameter replaced by another tensor needs a new object) and run as
// one paged pass per call.
class DecoderModelCpu {
 public:
  // layers: per layer [input_norm, qkv_weight, qkv_bias, q_norm, k_norm, o_weight, post_norm,
  // gate_up_weight, down_weight] (None where the model has no such weight); cos_table,
  // sin_table [P, 1, D] (the RoPE rows of every position, sin signed as apply_rope takes it).
  DecoderModelCpu(at::Tensor embedding, std::vector<std::vector<std::optional<at::Tensor>>> layers,
                  at::Tensor final_norm, at::Tensor lm_head, at::Tensor cos_table,
                  at::Tensor sin_table, double eps, int64_t num_heads)
      : embedding_(std::move(embedding)),
        final_norm_(std::move(final_norm)),
        lm_head_(std::move(lm_head)),
        cos_table_(std::move(cos_table)),
        sin_table_(std::move(sin_table)),
        eps_(eps),
        num_heads_(num_heads) {
    for (auto& layer : layers) {
      TORCH_CHECK(layer.size() == 9 && layer[0] && layer[1] && layer[5] && layer[6] && layer[7] &&
                      layer[8],
                  "DecoderModelCpu: a layer is [input_norm, qkv_weight, qkv_bias, q_norm, "
                  "k_norm, o_weight, post_norm, gate_up_weight, down_weight]");
      layers_.push_back({*layer[0], *layer[1], layer[2], layer[3], layer[4], *layer[5],
                         *layer[6], *layer[7], *layer[8]});
    }
    TORCH_CHECK(cos_table_.dim() == 3 && cos_table_.sizes() == sin_table_.sizes(),
                "DecoderModelCpu: cos_table and sin_table must be [P, 1, D]");
  }

  // input_ids, positions [R, T] int64; kv_cache: per layer (keys, values, key_slots,
  // value_slots), the engine's LayerCache; logits_index [R]: flat index r * T + t of each row's
  // last real token (None: t = T - 1). Returns logits [R, V].
  at::Tensor logits(const at::Tensor& input_ids, const at::Tensor& positions,
                    const std::vector<CacheTuple>& kv_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& block_tables, const at::Tensor& context_lens,
                    const std::optional<at::Tensor>& logits_index) const {
    TORCH_CHECK(input_ids.dim() == 2 && positions.sizes() == input_ids.sizes() &&
                    positions.scalar_type() == at::kLong,
                "DecoderModelCpu: input_ids and positions must be int64 [R, T]");
    TORCH_CHECK(kv_cache.size() == layers_.size(), "DecoderModelCpu: one cache per layer");
    const int64_t rows = input_ids.size(0), tokens = input_ids.size(1);
    auto x = at::embedding(embedding_, input_ids);
    const auto flat_positions = positions.reshape({-1});
    const std::vector<int64_t> rope_shape{rows, tokens, 1, cos_table_.size(2)};
    const PagedInputs in{cos_table_.index_select(0, flat_positions).view(rope_shape),
                         sin_table_.index_select(0, flat_positions).view(rope_shape),
                         slot_mapping, block_tables, context_lens};
    for (size_t i = 0; i < layers_.size(); ++i) {
      const auto& [keys, values, key_slots, value_slots] = kv_cache[i];
      x = layer_pass(layers_[i], x, eps_, {keys, values, key_slots, value_slots}, in, num_heads_);
    }
    auto hidden = rms_norm_cpu(x, final_norm_, eps_);
    auto last = logits_index ? hidden.flatten(0, 1).index_select(0, *logits_index)
                             : hidden.select(1, tokens - 1);
    return at::linear(last, lm_head_);
  }

 private:
  at::Tensor embedding_;
  std::vector<LayerWeights> layers_;
  at::Tensor final_norm_, lm_head_, cos_table_, sin_table_;
  double eps_;
  int64_t num_heads_;
};

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
  pybind11::class_<DecoderModelCpu>(m, "DecoderModelCpu")
      .def(pybind11::init<at::Tensor, std::vector<std::vector<std::optional<at::Tensor>>>,
                          at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, int64_t>(),
           pybind11::arg("embedding"), pybind11::arg("layers"), pybind11::arg("final_norm"),
           pybind11::arg("lm_head"), pybind11::arg("cos_table"), pybind11::arg("sin_table"),
           pybind11::arg("eps"), pybind11::arg("num_heads"))
      .def("logits", &DecoderModelCpu::logits, pybind11::arg("input_ids"),
           pybind11::arg("positions"), pybind11::arg("kv_cache"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_tables"), pybind11::arg("context_lens"),
           pybind11::arg("logits_index"),
           "Logits [R, V] of each row's last real token after one paged pass (float32 CPU)");
}
