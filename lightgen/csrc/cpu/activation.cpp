// Bias + activation (the FFN's first matmul runs without its bias) and the gated form act(gate) * up.
#include <torch/library.h>
#include "../include/checks.h"
#include "../include/vec_math.h"

namespace lightgen {
namespace {

using at::Tensor;

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;

inline fVec apply_act(Act act, fVec x) {
  switch (act) {
    case Act::kGelu:
      return x * fVec(0.5f) * (fVec(1.f) + (x * fVec(kSqrt1_2)).erf());
    case Act::kGeluTanh: {
      fVec inner = fVec(kSqrt2OverPi) * (x + fVec(0.044715f) * x * x * x);
      return fVec(0.5f) * x * (fVec(1.f) + inner.tanh());
    }
    case Act::kRelu:
      return at::vec::clamp_min(x, fVec(0.f));
    case Act::kSilu:
      return x / (fVec(1.f) + x.neg().exp());
    case Act::kNone:
      return x;
  }
  return x;
}

inline float apply_act(Act act, float x) {
  switch (act) {
    case Act::kGelu:
      return x * 0.5f * (1.f + std::erf(x * kSqrt1_2));
    case Act::kGeluTanh:
      return 0.5f * x * (1.f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
    case Act::kRelu:
      return x > 0.f ? x : 0.f;
    case Act::kSilu:
      return x / (1.f + std::exp(-x));
    case Act::kNone:
      return x;
  }
  return x;
}

// out[r, :] = act(x[r, :] + bias) (bias may be null), or act(x) * up when `up` is given.
template <typename scalar_t>
void act_rows(Act act, const Tensor& x, const float* bias, const Tensor* up, Tensor& out) {
  const int64_t c = x.size(-1);
  const int64_t rows = x.numel() / c;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* up_p = up ? up->data_ptr<scalar_t>() : nullptr;
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, row_grain(c), [&](int64_t begin, int64_t end) {
    std::vector<float> xbuf, ubuf, obuf(c);
    for (int64_t r = begin; r < end; ++r) {
      const float* xs = as_float(xp + r * c, c, xbuf);
      const float* us = up_p ? as_float(up_p + r * c, c, ubuf) : nullptr;
      int64_t i = 0;
      for (; i + fVec::size() <= c; i += fVec::size()) {
        fVec v = fVec::loadu(xs + i);
        if (bias) v = v + fVec::loadu(bias + i);
        v = apply_act(act, v);
        if (us) v = v * fVec::loadu(us + i);
        v.store(obuf.data() + i);
      }
      for (; i < c; ++i) {
        float v = apply_act(act, xs[i] + (bias ? bias[i] : 0.f));
        obuf[i] = us ? v * us[i] : v;
      }
      store_row(obuf.data(), op + r * c, c);
    }
  });
}

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
    const float* b = bias.defined() ? as_float(bias.data_ptr<scalar_t>(), x.size(-1), bbuf) : nullptr;
    act_rows<scalar_t>(act, x, b, nullptr, out);
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
                                  [&] { act_rows<scalar_t>(act, gate, nullptr, &up, out); });
  return out;
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("bias_act", &lightgen::bias_act);
  m.impl("gated_act", &lightgen::gated_act);
}
