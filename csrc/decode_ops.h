// The CPU decode ops that one C++ function calls from another (decoder_layer.cpp runs a whole
// layer of a paged pass through them), each defined in its own source and registered there.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

torch::Tensor rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_cpu(torch::Tensor x, torch::Tensor residual,
                                                          torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope_store_cpu(
    torch::Tensor qkv, std::optional<torch::Tensor> q_weight,
    std::optional<torch::Tensor> k_weight, double eps, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor key_slots, torch::Tensor value_slots, torch::Tensor slot_mapping,
    int64_t num_heads);
torch::Tensor silu_mul_cpu(const torch::Tensor& gate_up);
torch::Tensor paged_attention_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                  torch::Tensor block_tables, torch::Tensor context_lens);
