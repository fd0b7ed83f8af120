#pragma once
// LayerNorm of one row as PyTorch's CPU layer_norm rounds it (cpu/layer_norm_rows.cpp): a header without ATen's
// vector types, since that file compiles them for another width than the rest of the build.
#include <cstdint>

namespace lightgen {

// y[0..n) <- (x - mean) / sqrt(var + eps) * weight + bias, bit for bit F.layer_norm's row (float, BFloat16, Half).
template <typename scalar_t>
void layer_norm_row_as_torch(const scalar_t* x, const scalar_t* weight, const scalar_t* bias, scalar_t* y, int64_t n,
                             float eps);

}  // namespace lightgen
