#pragma once
// Float row helpers on ATen's Vectorized<float> (AVX2 or AVX-512 as the build selects).
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <vector>

namespace lightgen {

using fVec = at::vec::Vectorized<float>;

// The lane sum in a shuffle tree (attention's scores, a dot a key): a few instructions, independent across calls.
inline float lane_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](const fVec& a, const fVec& b) { return a + b; }, v);
}

inline float row_dot(const float* a, const float* b, int64_t n) {
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + fVec::size() <= n; i += fVec::size()) acc = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc);
  float s = lane_sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += alpha * x
inline void row_axpy(float alpha, const float* x, float* y, int64_t n) {
  fVec a(alpha);
  int64_t i = 0;
  for (; i + fVec::size() <= n; i += fVec::size())
    at::vec::fmadd(a, fVec::loadu(x + i), fVec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// Reduced-precision rows are widened to float once; float rows are used in place.
template <typename scalar_t>
inline const float* as_float(const scalar_t* src, int64_t n, std::vector<float>& buf) {
  buf.resize(n);
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf.data();
}
template <>
inline const float* as_float<float>(const float* src, int64_t, std::vector<float>&) {
  return src;
}

template <typename scalar_t>
inline void store_row(const float* src, scalar_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}
template <>
inline void store_row<float>(const float* src, float* dst, int64_t n) {
  if (src != dst) std::copy(src, src + n, dst);
}

}  // namespace lightgen
