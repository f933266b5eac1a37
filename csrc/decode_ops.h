// The CPU decode ops that one C++ function calls from another (decoder_layer.cpp runs a whole
// layer of a paged pass through them), each defined in its own source and registered there.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

at::Tensor rms_norm_cpu(at::Tensor x, at::Tensor weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(at::Tensor x, at::Tensor residual,
                                                          at::Tensor weight, double eps);
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_store_cpu(
    at::Tensor qkv, std::optional<at::Tensor> q_weight,
    std::optional<at::Tensor> k_weight, double eps, at::Tensor cos, at::Tensor sin,
    at::Tensor key_slots, at::Tensor value_slots, at::Tensor slot_mapping,
    int64_t num_heads);
at::Tensor silu_mul_cpu(const at::Tensor& gate_up);
at::Tensor paged_attention_cpu(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens);
