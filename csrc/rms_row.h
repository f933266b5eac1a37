// One RMSNorm row on CPU, shared by every C++ op that normalises: the mean of squares
// accumulated in float with eight partial sums (equal to torch's to float32 rounding, not
// bitwise), then out = weight * (x * inverse), the reference's order of the two products.
#pragma once

#include <cmath>
#include <cstdint>

inline float rms_inverse(const float* x, int64_t dim, float eps) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < dim; ++i) partial[i % 8] += x[i] * x[i];
  float sum = 0.0f;
  for (float p : partial) sum += p;
  return 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
}

inline void rms_norm_row(const float* x, const float* weight, int64_t dim, float eps, float* out) {
  const float inverse = rms_inverse(x, dim, eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = weight[i] * (x[i] * inverse);
}
