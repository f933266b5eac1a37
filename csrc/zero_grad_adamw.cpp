// k zero-gradient AdamW steps on one parameter tensor, in one pass over (param, exp_avg,
// exp_avg_sq), bitwise equal to k rounds of {grad = 0; torch.optim.AdamW.step()} on CPU.
//
// torch's single-tensor CPU path with g = 0, per step (each line one rounded op, every scalar a
// Python double cast to float):
//   p = p * (1 - lr*wd)                      mul_
//   m = fma(1 - beta1, 0 - m, m)             lerp_ (vectorised lerp is a fused multiply-add)
//   v = v * beta2                            mul_ (+ addcmul_ of 0*0, which leaves v unchanged)
//   d = sqrt(v) / sqrt(1 - beta2^t) + eps    sqrt (torch's own kernel), div (a true division on
//                                            CPU), add_
//   p = p + (-step_size * m) / d             addcdiv_ (no FMA on CPU)
// bf16 tensors compute each op in float and round to bf16 where torch stores a tensor. The file
// is compiled with -ffp-contract=off so the compiler fuses nothing torch does not.

#include "torch_api.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_features.h"

namespace {

struct StepScalars {
  float decay;        // 1 - lr * weight_decay
  float denom_scale;  // sqrt(1 - beta2^t)
  float neg_step;     // -lr / (1 - beta1^t)
};

template <typename T>
inline float stored(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <>
inline float stored<float>(float x) {
  return x;
}

// torch's float32 sqrt on CPU is not always the correctly rounded one (its vectorised kernel
// differs by one ulp on ~0.6% of inputs here), so float32 blocks take their square roots from
// at::sqrt_out itself, on a block that stays in cache. bf16 sqrt in torch is the correctly
// rounded float sqrt rounded to bf16, which std::sqrt reproduces.
template <typename T>
void block_sqrt(float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    values[i] = stored<T>(std::sqrt(values[i]));
  }
}

template <>
void block_sqrt<float>(float* values, int64_t count) {
  at::Tensor block = at::from_blob(values, {count}, at::kFloat);
  at::sqrt_out(block, block);
}

// Each block costs one at::sqrt_out per step (a TensorIterator built each time), so blocks are
// large: the four float buffers (512 KiB per thread, on the heap) still sit in this machine's
// 2 MiB of L2 per core. Measured on 50M fp32 params, 2 threads: 8,192 -> 82 ms, 32,768 -> 60 ms,
// 65,536 -> 66 ms per step.
constexpr int64_t kBlock = 32768;

// One block of k steps, on (p, m, v) already in float. Always inlined into the two entry points
// below, so that it is compiled once for the baseline ISA, where std::fma is a call to libm's
// fmaf, and (on x86-64 builds, cpu_features.h) once for AVX2 + FMA, where it is one vfmadd
// instruction and the loops vectorise.
// Both round identically: fmaf and vfmadd are the correctly rounded fma, and vector mul, div and
// add are the IEEE operations the scalar code performs (-ffp-contract=off still holds).
template <typename T>
__attribute__((always_inline)) inline void advance_block(float* p, float* m, float* v, float* d,
                                                         int64_t count, float lerp_weight,
                                                         float beta2, float eps,
                                                         const std::vector<StepScalars>& steps) {
  for (const StepScalars& s : steps) {
    for (int64_t i = 0; i < count; ++i) {
      p[i] = stored<T>(p[i] * s.decay);
      m[i] = stored<T>(std::fma(lerp_weight, 0.0f - m[i], m[i]));
      v[i] = stored<T>(v[i] * beta2);
      d[i] = v[i];
    }
    block_sqrt<T>(d, count);
    for (int64_t i = 0; i < count; ++i) {
      const float denom = stored<T>(stored<T>(d[i] / s.denom_scale) + eps);
      p[i] = stored<T>(p[i] + (s.neg_step * m[i]) / denom);
    }
  }
}

template <typename T>
void advance_block_baseline(float* p, float* m, float* v, float* d, int64_t count,
                            float lerp_weight, float beta2, float eps,
                            const std::vector<StepScalars>& steps) {
  advance_block<T>(p, m, v, d, count, lerp_weight, beta2, eps, steps);
}

#if RLVR_FAST_AVX2
template <typename T>
__attribute__((target("avx2,fma"))) void advance_block_avx2(
    float* p, float* m, float* v, float* d, int64_t count, float lerp_weight, float beta2,
    float eps, const std::vector<StepScalars>& steps) {
  advance_block<T>(p, m, v, d, count, lerp_weight, beta2, eps, steps);
}
#endif

template <typename T>
void zero_grad_steps(T* param, T* exp_avg, T* exp_avg_sq, int64_t numel, float lerp_weight,
                     float beta2, float eps, const std::vector<StepScalars>& steps) {
  auto advance = advance_block_baseline<T>;
#if RLVR_FAST_AVX2
  if (cpu_has_avx2_fma()) advance = advance_block_avx2<T>;
#endif
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t first_block, int64_t end_block) {
    std::vector<float> buffer(4 * kBlock);
    float* p = buffer.data();
    float* m = p + kBlock;
    float* v = m + kBlock;
    float* d = v + kBlock;
    for (int64_t block = first_block; block < end_block; ++block) {
      const int64_t start = block * kBlock;
      const int64_t count = std::min(kBlock, numel - start);
      for (int64_t i = 0; i < count; ++i) {
        p[i] = static_cast<float>(param[start + i]);
        m[i] = static_cast<float>(exp_avg[start + i]);
        v[i] = static_cast<float>(exp_avg_sq[start + i]);
      }
      advance(p, m, v, d, count, lerp_weight, beta2, eps, steps);
      for (int64_t i = 0; i < count; ++i) {
        param[start + i] = static_cast<T>(p[i]);
        exp_avg[start + i] = static_cast<T>(m[i]);
        exp_avg_sq[start + i] = static_cast<T>(v[i]);
      }
    }
  });
}

void zero_grad_adamw_(at::Tensor param, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                      double one_minus_beta1, double beta2, double eps,
                      const std::vector<double>& decay, const std::vector<double>& denom_scale,
                      const std::vector<double>& neg_step) {
  TORCH_CHECK(param.device().is_cpu(), "zero_grad_adamw_: the C++ kernel takes CPU tensors");
  TORCH_CHECK(param.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous(),
              "zero_grad_adamw_: param, exp_avg and exp_avg_sq must be contiguous");
  TORCH_CHECK(exp_avg.scalar_type() == param.scalar_type() &&
                  exp_avg_sq.scalar_type() == param.scalar_type(),
              "zero_grad_adamw_: param, exp_avg and exp_avg_sq must share one dtype");
  TORCH_CHECK(exp_avg.numel() == param.numel() && exp_avg_sq.numel() == param.numel(),
              "zero_grad_adamw_: param, exp_avg and exp_avg_sq must have the same size");
  TORCH_CHECK(!decay.empty() && decay.size() == denom_scale.size() &&
                  decay.size() == neg_step.size(),
              "zero_grad_adamw_: one decay, denominator scale and step size per step");
  std::vector<StepScalars> steps;
  for (size_t s = 0; s < decay.size(); ++s) {
    steps.push_back({static_cast<float>(decay[s]), static_cast<float>(denom_scale[s]),
                     static_cast<float>(neg_step[s])});
  }
  const float w = static_cast<float>(one_minus_beta1);
  const float b2 = static_cast<float>(beta2);
  const float e = static_cast<float>(eps);
  switch (param.scalar_type()) {
    case at::kFloat:
      zero_grad_steps<float>(param.data_ptr<float>(), exp_avg.data_ptr<float>(),
                             exp_avg_sq.data_ptr<float>(), param.numel(), w, b2, e, steps);
      break;
    case at::kBFloat16:
      zero_grad_steps<c10::BFloat16>(param.data_ptr<c10::BFloat16>(),
                                     exp_avg.data_ptr<c10::BFloat16>(),
                                     exp_avg_sq.data_ptr<c10::BFloat16>(), param.numel(), w, b2,
                                     e, steps);
      break;
    default:
      TORCH_CHECK(false, "zero_grad_adamw_: float32 and bfloat16 only, got ",
                  param.scalar_type());
  }
}

}  // namespace

void register_zero_grad_adamw(pybind11::module& m) {
  m.def("zero_grad_adamw_", &zero_grad_adamw_,
        "k zero-gradient AdamW steps on one CPU tensor, bitwise equal to torch.optim.AdamW");
}
