// Bias + activation (the FFN's first matmul runs without its bias) and the gated form act(gate) * up.
#include <torch/library.h>
#include "../include/checks.h"
#include "../include/cpu_ops.h"
#include "../include/act.h"
#include "../include/vec_math.h"

namespace lightgen {
namespace {

using at::Tensor;

// Load/store n <= fVec::size() elements as floats; float rows need no staging.
template <typename scalar_t>
inline fVec load_floats(const scalar_t* p, int64_t n) {
  float tmp[fVec::size()];
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return fVec::loadu(tmp, n);
}
template <>
inline fVec load_floats<float>(const float* p, int64_t n) {
  return n == fVec::size() ? fVec::loadu(p) : fVec::loadu(p, n);
}

template <typename scalar_t>
inline void store_floats(const fVec& v, scalar_t* p, int64_t n) {
  float tmp[fVec::size()];
  v.store(tmp, n);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<scalar_t>(tmp[i]);
}
template <>
inline void store_floats<float>(const fVec& v, float* p, int64_t n) {
  if (n == fVec::size()) v.store(p); else v.store(p, n);
}

// v rounded to scalar_t and widened again: where the composite (act(x + bias), act(gate) * up in the
// tensor's dtype) rounds, so that fp16 / bf16 results are the composite's, not one rounding at the end.
template <typename scalar_t>
inline fVec round_to(const fVec& v, int64_t n) {
  scalar_t tmp[fVec::size()];
  store_floats(v, tmp, n);
  return load_floats(tmp, n);
}
template <>
inline fVec round_to<float>(const fVec& v, int64_t) {
  return v;
}

// out[r, :] = act(x[r, :] + bias), or act(x) * up; the activation and the optional operands are
// compile-time so the inner loop is branch-free.
template <typename scalar_t, Act act, bool has_bias, bool gated>
void act_rows(const Tensor& x, const float* bias, const Tensor* up, Tensor& out) {
  const int64_t c = x.size(-1);
  const int64_t n = x.numel();
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* up_p = gated ? up->data_ptr<scalar_t>() : nullptr;
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, n / c, row_grain(c), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < c; i += fVec::size()) {
        const int64_t len = std::min<int64_t>(fVec::size(), c - i);
        const int64_t at = r * c + i;
        fVec v = load_floats(xp + at, len);
        if constexpr (has_bias) v = round_to<scalar_t>(v + fVec::loadu(bias + i, len), len);
        v = apply_act<act>(v);
        if constexpr (gated) v = round_to<scalar_t>(v, len) * load_floats(up_p + at, len);
        store_floats(v, op + at, len);
      }
    }
  });
}

template <typename scalar_t, bool has_bias, bool gated>
void act_rows_for(Act act, const Tensor& x, const float* bias, const Tensor* up, Tensor& out) {
  switch (act) {
    case Act::kGelu: return act_rows<scalar_t, Act::kGelu, has_bias, gated>(x, bias, up, out);
    case Act::kGeluTanh: return act_rows<scalar_t, Act::kGeluTanh, has_bias, gated>(x, bias, up, out);
    case Act::kRelu: return act_rows<scalar_t, Act::kRelu, has_bias, gated>(x, bias, up, out);
    case Act::kSilu: return act_rows<scalar_t, Act::kSilu, has_bias, gated>(x, bias, up, out);
    case Act::kNone: return act_rows<scalar_t, Act::kNone, has_bias, gated>(x, bias, up, out);
  }
}

}  // namespace

// Entry points (cpu_ops.h): the native decode step calls them directly, without the dispatcher.
// x: [..., C], bias: [C]
Tensor bias_act(const Tensor& x_in, const c10::optional<Tensor>& bias_in, c10::string_view act_name) {
  constexpr const char* op = "lightgen.bias_act";
  const Act act = parse_act(op, act_name);
  {
    const Tensor& x = x_in;
    LG_CHECK_CPU(op, x);
    LG_CHECK_FLOAT(op, x);
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": 'x' needs a non-empty last dimension, got ", x.sizes());
  }
  Tensor x = x_in.contiguous();
  Tensor bias;
  if (bias_in) {
    const Tensor& x = x_in;
    bias = *bias_in;
    LG_CHECK_CPU(op, bias);
    LG_CHECK_SAME_DTYPE(op, x, bias);
    LG_CHECK_SHAPE(op, bias, x.size(-1));
    bias = bias.contiguous();
  }
  Tensor out = at::empty_like(x);
  std::vector<float> bbuf;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), op, [&] {
    if (bias.defined()) {
      act_rows_for<scalar_t, true, false>(act, x, as_float(bias.data_ptr<scalar_t>(), x.size(-1), bbuf), nullptr, out);
    } else {
      act_rows_for<scalar_t, false, false>(act, x, nullptr, nullptr, out);
    }
  });
  return out;
}

// gate, up: [..., C] -> act(gate) * up
Tensor gated_act(const Tensor& gate_in, const Tensor& up_in, c10::string_view act_name) {
  constexpr const char* op = "lightgen.gated_act";
  const Act act = parse_act(op, act_name);
  {
    const Tensor& gate = gate_in;
    const Tensor& up = up_in;
    LG_CHECK_CPU(op, gate);
    LG_CHECK_CPU(op, up);
    LG_CHECK_FLOAT(op, gate);
    LG_CHECK_SAME_DTYPE(op, gate, up);
    TORCH_CHECK(gate.sizes() == up.sizes(), op, ": 'gate' and 'up' must have the same shape, got ", gate.sizes(),
                " and ", up.sizes());
    TORCH_CHECK(gate.dim() >= 1 && gate.size(-1) > 0, op, ": 'gate' needs a non-empty last dimension");
  }
  Tensor gate = gate_in.contiguous();
  Tensor up = up_in.contiguous();
  Tensor out = at::empty_like(gate);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), op,
                                  [&] { act_rows_for<scalar_t, false, true>(act, gate, nullptr, &up, out); });
  return out;
}

}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("bias_act", &lightgen::bias_act);
  m.impl("gated_act", &lightgen::gated_act);
}
