// rlvr_fast._C: one Python module for every C++ source in csrc/; each registers its functions.

#include "torch_api.h"

void register_zero_grad_adamw(pybind11::module& m);
void register_block_manager(pybind11::module& m);
void register_paged_attention(pybind11::module& m);
void register_sampling(pybind11::module& m);
void register_rms_norm(pybind11::module& m);
void register_qk_norm_rope(pybind11::module& m);
void register_silu_mul(pybind11::module& m);
void register_decoder_layer(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_zero_grad_adamw(m);
  register_block_manager(m);
  register_paged_attention(m);
  register_sampling(m);
  register_rms_norm(m);
  register_qk_norm_rope(m);
  register_silu_mul(m);
  register_decoder_layer(m);
}
