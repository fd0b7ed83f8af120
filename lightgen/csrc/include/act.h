#pragma once
// Activations on Vectorized<float>, shared by bias_act and the linear epilogue.
#include "checks.h"
#include "vec_math.h"

namespace lightgen {

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;

template <Act act>
inline fVec apply_act(fVec x) {
  if constexpr (act == Act::kGelu) {
    return x * fVec(0.5f) * (fVec(1.f) + (x * fVec(kSqrt1_2)).erf());
  } else if constexpr (act == Act::kGeluTanh) {
    fVec inner = fVec(kSqrt2OverPi) * (x + fVec(0.044715f) * x * x * x);
    return fVec(0.5f) * x * (fVec(1.f) + inner.tanh());
  } else if constexpr (act == Act::kRelu) {
    return at::vec::clamp_min(x, fVec(0.f));
  } else if constexpr (act == Act::kSilu) {
    return x / (fVec(1.f) + x.neg().exp());
  } else {
    return x;
  }
}

}  // namespace lightgen
