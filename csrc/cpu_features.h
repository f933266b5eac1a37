// Which CPU kernels this build may run. x86-64 builds compile AVX2 + FMA variants beside the
// scalar code and pick one at run time; other CPUs (aarch64: GH200's Grace), and any build with
// -DRLVR_FAST_NO_AVX2 (the CI check that the scalar path compiles and agrees), compile only the
// scalar code: <immintrin.h> and __builtin_cpu_supports("avx2") exist only on x86.
#pragma once

#if (defined(__x86_64__) || defined(__i386__)) && !defined(RLVR_FAST_NO_AVX2)
#define RLVR_FAST_AVX2 1
#include <immintrin.h>
#else
#define RLVR_FAST_AVX2 0
#endif

// True when the AVX2 + FMA variants are compiled in and this CPU runs them.
inline bool cpu_has_avx2_fma() {
#if RLVR_FAST_AVX2
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}
