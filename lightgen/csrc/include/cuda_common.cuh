#pragma once
// Shared by the CUDA kernels: input checks, warp and block reductions, activations, launch helpers.
// Every kernel widens to float, accumulates in float and rounds once on the store, as the CPU ones do.
// Only c10's CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers, which a
// minimal toolkit lacks and which cost compile time.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <initializer_list>
#include <type_traits>
#include "checks.h"

#define LG_CHECK_CUDA(op, t) \
  TORCH_CHECK((t).is_cuda(), op, ": '" #t "' must be a CUDA tensor, got one on ", (t).device())
#define LG_CHECK_SAME_DEVICE(op, a, b)                                                                       \
  TORCH_CHECK((a).device() == (b).device(), op, ": '" #a "' and '" #b "' must be on the same device, got ", \
              (a).device(), " and ", (b).device())

// `t` is a CUDA tensor on `like`'s device with `like`'s dtype.
#define LG_CHECK_CUDA_LIKE(op, like, t) \
  do {                                  \
    LG_CHECK_CUDA(op, t);               \
    LG_CHECK_SAME_DEVICE(op, like, t);  \
    LG_CHECK_SAME_DTYPE(op, like, t);   \
  } while (0)

namespace lightgen {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Threads for a one-block-per-row kernel: whole warps, about one element per thread, at most `cap`.
inline int row_threads(int64_t row_len, int cap = 512) {
  return static_cast<int>(std::min<int64_t>(cap, std::max<int64_t>(32, ceil_div(row_len, 32) * 32)));
}

// Blocks for a grid-stride elementwise kernel: enough to fill every SM a few times over.
inline int64_t grid_for(int64_t n, int threads) {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, threads), sms * 8));
}

struct Sum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct Min {
  __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); }
};
struct Max {
  // fmaxf drops NaN; callers that must see NaN check for it separately.
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Reduce over the block (blockDim.x a multiple of 32); every thread gets the result. `scratch`
// holds 32 floats of shared memory, reusable across calls.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, Op op, float identity, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_reduce(lane < warps ? scratch[lane] : identity, op);
}

// The activations in the references' float formulas (ATen's CUDA kernels compute the same in float).
template <Act act>
__device__ __forceinline__ float activate(float x) {
  if constexpr (act == Act::kGelu) {
    return 0.5f * x * (1.f + erff(x * 0.70710678118654752440f));
  } else if constexpr (act == Act::kGeluTanh) {
    return 0.5f * x * (1.f + tanhf(0.79788456080286535588f * (x + 0.044715f * x * x * x)));
  } else if constexpr (act == Act::kRelu) {
    return x < 0.f ? 0.f : x;  // NaN passes through, as torch.relu's does
  } else if constexpr (act == Act::kSilu) {
    return x / (1.f + expf(-x));
  } else {
    return x;
  }
}

// The value carried by a dispatch_* argument. decay_t: inside nested [&] lambdas nvcc's host pass
// sees the captured constant as a reference type.
#define LG_CONST(c) std::decay_t<decltype(c)>::value

// Calls f(std::integral_constant<Act, act>{}) so a kernel can take the activation as a template.
template <typename F>
void dispatch_act(Act act, F&& f) {
  switch (act) {
    case Act::kGelu: return f(std::integral_constant<Act, Act::kGelu>{});
    case Act::kGeluTanh: return f(std::integral_constant<Act, Act::kGeluTanh>{});
    case Act::kRelu: return f(std::integral_constant<Act, Act::kRelu>{});
    case Act::kSilu: return f(std::integral_constant<Act, Act::kSilu>{});
    case Act::kNone: return f(std::integral_constant<Act, Act::kNone>{});
  }
}

// Calls f(std::bool_constant<value>{}): a runtime flag as a template parameter.
template <typename F>
void dispatch_bool(bool value, F&& f) {
  if (value) return f(std::true_type{});
  f(std::false_type{});
}

}  // namespace cuda
}  // namespace lightgen
