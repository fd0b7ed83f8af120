// LayerNorm rows as PyTorch's CPU layer_norm rounds them, so that a model's norms are HF's bit for bit. torch 2.13
// runs that kernel with 256-bit vectors on every x86 CPU (its AVX-512 build registers none of its own), and the
// lane count decides the order of its sums: this file is compiled for 256-bit vectors, in a Vectorized namespace
// of its own (the rest of the build may use 512-bit ones), and takes the moments from ATen's own RowwiseMoments
// (Welford over chunks of vectors, merged as a cascade). Measured against F.layer_norm on 4,000 rows of 32-1024
// values: bf16 and fp16 outputs identical (the previous kernel: one ulp off at 3e-5 / 2e-4 of values), float ones
// too where the width is a multiple of 8 (before: 50% of values off); a float row with a remainder (36 values) is
// one ulp off at 0.6% of values (the moments' scalar tail, rounded where torch's compiler fused otherwise).
#if defined(__AVX2__)
#undef CPU_CAPABILITY_AVX512
#undef CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY_AVX2
#endif
#undef CPU_CAPABILITY
#define CPU_CAPABILITY lightgen_layer_norm
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/moments_utils.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include "../include/layer_norm_rows.h"

namespace lightgen {

template <typename scalar_t>
void layer_norm_row_as_torch(const scalar_t* x, const scalar_t* weight, const scalar_t* bias, scalar_t* y, int64_t n,
                             float eps) {
  using fVec = at::vec::Vectorized<float>;
  const auto [mean, variance] = at::native::RowwiseMoments(x, n);
  const float rstd = 1.f / std::sqrt(static_cast<float>(variance) + eps);
  const float m = static_cast<float>(mean);
  if constexpr (std::is_same_v<scalar_t, float>) {
    at::vec::map3<float>([m, rstd](fVec v, fVec w, fVec b) { return (v - fVec(m)) * fVec(rstd) * w + b; }, y, x,
                         weight, bias, n);
  } else {  // fp16 / bf16 rows normalise as x * rstd - rstd * mean
    const float shift = -rstd * m;
    at::vec::map3<scalar_t>([rstd, shift](fVec v, fVec w, fVec b) { return (v * fVec(rstd) + fVec(shift)) * w + b; },
                            y, x, weight, bias, n);
  }
}

template void layer_norm_row_as_torch<float>(const float*, const float*, const float*, float*, int64_t, float);
template void layer_norm_row_as_torch<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                                     c10::BFloat16*, int64_t, float);
template void layer_norm_row_as_torch<c10::Half>(const c10::Half*, const c10::Half*, const c10::Half*, c10::Half*,
                                                 int64_t, float);

}  // namespace lightgen
