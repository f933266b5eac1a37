// RMSNorm on CPU in one call, alone or after the residual add, float32, for inference:
//   rms_norm_cpu:      out = weight * (x / sqrt(mean(x^2) + eps)) over the last dim;
//   add_rms_norm_cpu:  s = x + residual, then (rms_norm(s), s).
// The decoder's torch version (rlvr_fast.kernels.rms_norm, which autograd differentiates) costs
// six operator dispatches per call, plus one for the add; a small model decoding on a CPU is
// dispatch-bound, so inference takes these.
//
// x [..., D]; weight [W_1, ..., D], equal to x's trailing dims (a q/k norm passes one weight row
// per head) or just [D]. Rows go through rms_norm_row (rms_row.h): equal to torch's to float32
// rounding of the mean, not bitwise; the add is torch's add, bitwise.

#include "torch_api.h"

#include "decode_ops.h"

#include <ATen/Parallel.h>

#include "rms_row.h"

namespace {

void check_norm_inputs(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && x.dim() >= 1 && weight.dim() >= 1,
              op, ": x and weight must be float32 CPU tensors");
  TORCH_CHECK(weight.dim() <= x.dim() &&
                  weight.sizes() == x.sizes().slice(x.dim() - weight.dim()),
              op, ": weight must have the shape of x's trailing dims");
}

// Normalise every row of `in` (rows x dim, contiguous) into `out`; weight rows cycle.
void normalise_rows(const float* in, const float* weight, int64_t rows, int64_t dim,
                    int64_t weight_rows, float eps, float* out) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      rms_norm_row(in + row * dim, weight + (row % weight_rows) * dim, dim, eps, out + row * dim);
    }
  });
}

}  // namespace

at::Tensor rms_norm_cpu(at::Tensor x, at::Tensor weight, double eps) {
  check_norm_inputs(x, weight, "rms_norm_cpu");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1);
  const int64_t rows = dim ? x.numel() / dim : 0;
  const int64_t weight_rows = dim ? weight.numel() / dim : 1;
  normalise_rows(x.data_ptr<float>(), weight.data_ptr<float>(), rows, dim, weight_rows,
                 static_cast<float>(eps), out.data_ptr<float>());
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(at::Tensor x, at::Tensor residual,
                                                          at::Tensor weight, double eps) {
  check_norm_inputs(x, weight, "add_rms_norm_cpu");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat,
              "add_rms_norm_cpu: residual must be float32 of x's shape");
  TORCH_CHECK(weight.dim() == 1, "add_rms_norm_cpu: weight must be [D]");
  x = x.contiguous();
  residual = residual.contiguous();
  weight = weight.contiguous();
  auto summed = at::empty_like(x);
  auto out = at::empty_like(x);
  const float* a = x.data_ptr<float>();
  const float* b = residual.data_ptr<float>();
  float* s = summed.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) s[i] = a[i] + b[i];
  const int64_t dim = x.size(-1);
  normalise_rows(s, weight.data_ptr<float>(), dim ? x.numel() / dim : 0, dim, 1,
                 static_cast<float>(eps), out.data_ptr<float>());
  return {out, summed};
}

void register_rms_norm(pybind11::module& m) {
  m.def("rms_norm_cpu", &rms_norm_cpu, pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("eps"), "RMSNorm over the last dim, float32 CPU, one call (inference)");
  m.def("add_rms_norm_cpu", &add_rms_norm_cpu, pybind11::arg("x"), pybind11::arg("residual"),
        pybind11::arg("weight"), pybind11::arg("eps"),
        "(RMSNorm(x + residual), x + residual), float32 CPU, one call (inference)");
}
