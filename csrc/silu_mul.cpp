// SwiGLU's activation on CPU in one call (float32, inference): silu(gate) * up from the packed
// gate_up [..., 2 I]. It runs torch's own silu and multiply kernels (so it is bitwise the torch
// ops), called from C++: what it saves a dispatch-bound small model is the Python-side split and
// two dispatches per layer.

#include "torch_api.h"

#include "decode_ops.h"

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat &&
                  gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_mul_cpu: gate_up must be a float32 CPU tensor [..., 2 I]");
  const int64_t inner = gate_up.size(-1) / 2;
  auto out = at::silu(gate_up.narrow(-1, 0, inner));
  out.mul_(gate_up.narrow(-1, inner, inner));
  return out;
}

void register_silu_mul(pybind11::module& m) {
  m.def("silu_mul_cpu", &silu_mul_cpu, pybind11::arg("gate_up"),
        "silu(gate) * up of the packed gate_up, float32 CPU, one call (inference)");
}
