// RMSNorm on CPU in one call: out = weight * (x / sqrt(mean(x^2) + eps)) over the last dim,
// float32, for inference. The decoder's torch version (rlvr_fast.models.qwen3.rms_norm, which
// autograd differentiates) costs six operator dispatches per call; a small model decoding on a
// CPU runs 13 such calls per token step and is dispatch-bound, so inference takes this one.
//
// x [..., D]; weight [W_1, ..., D], equal to x's trailing dims (a q/k norm passes one weight row
// per head) or just [D]. The mean of squares accumulates in float with eight partial sums, so
// it equals torch's to float32 rounding, not bitwise.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>

namespace {

torch::Tensor rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && x.dim() >= 1 && weight.dim() >= 1,
              "rms_norm_cpu: x and weight must be float32 CPU tensors");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() <= x.dim() &&
                  weight.sizes() == x.sizes().slice(x.dim() - weight.dim()),
              "rms_norm_cpu: weight must have the shape of x's trailing dims");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t rows = dim ? x.numel() / dim : 0;
  const int64_t weight_rows = dim ? weight.numel() / dim : 1;
  const float* in = x.data_ptr<float>();
  const float* scale = weight.data_ptr<float>();
  float* result = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const float* v = in + row * dim;
      float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < dim; ++i) partial[i % 8] += v[i] * v[i];
      float sum = 0.0f;
      for (float p : partial) sum += p;
      const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(dim) + epsilon);
      const float* w = scale + (row % weight_rows) * dim;
      float* o = result + row * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = w[i] * (v[i] * inverse);
    }
  });
  return out;
}

}  // namespace

void register_rms_norm(pybind11::module& m) {
  m.def("rms_norm_cpu", &rms_norm_cpu, pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("eps"), "RMSNorm over the last dim, float32 CPU, one call (inference)");
}
