// Layer 1, the reductions' arithmetic, one definition for every transport: the accumulation
// type of each element type and how two values combine. The shared-memory transport
// (transport_shm.cpp) runs it on the host, the CUDA kernels (cuda/reduce_kernels.cu,
// cuda/accumulate_kernel.cu) on the GPU, so both reduce alike. Depends on layout.hpp (Combine).
#pragma once

#include <cstdint>

#include "layout.hpp"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define ODC_MATH inline __host__ __device__
#else
#define ODC_MATH inline
#endif

namespace c10 {
struct BFloat16;
struct Half;
}  // namespace c10

namespace odc {

// Accumulation type of a reduction (ReduceSpec): fp32 for the 16/32-bit floats (host c10
// types and CUDA types alike), fp64 for float64, int64 for integers.
template <typename T> struct AccOf { using type = long long; };
template <> struct AccOf<float> { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <> struct AccOf<c10::BFloat16> { using type = float; };
template <> struct AccOf<c10::Half> { using type = float; };
#if defined(__CUDACC__)
template <> struct AccOf<__nv_bfloat16> { using type = float; };
template <> struct AccOf<__half> { using type = float; };
#endif

// a (+ * max min) b in the accumulation type; Max and Min propagate NaN (a float NaN is
// unequal to itself), as NCCL's do.
template <Combine C, typename A>
ODC_MATH A combine(A a, A b) {
  if constexpr (C == Combine::Sum) {
    return a + b;
  } else if constexpr (C == Combine::Product) {
    return a * b;
  } else {
    if (a != a) return a;
    if (b != b) return b;
    return C == Combine::Max ? (b > a ? b : a) : (b < a ? b : a);
  }
}

}  // namespace odc

#undef ODC_MATH
