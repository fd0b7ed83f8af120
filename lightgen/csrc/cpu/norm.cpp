// LayerNorm / RMSNorm, optionally fused with the residual add of pre-LN and post-LN blocks.
#include <torch/library.h>
#include "../include/checks.h"
#include "../include/cpu_ops.h"
#include "../include/layer_norm_rows.h"
#include "../include/vec_math.h"

namespace lightgen {
namespace {

using at::Tensor;

struct NormArgs {
  const char* op;
  bool rms;
  float eps;
};

void check_norm_inputs(const NormArgs& a, const Tensor& x, const Tensor* residual_opt, const Tensor& weight,
                       const c10::optional<Tensor>& bias_opt) {
  LG_CHECK_CPU(a.op, x);
  LG_CHECK_FLOAT(a.op, x);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, a.op, ": 'x' needs a non-empty last dimension, got shape ", x.sizes());
  const int64_t c = x.size(-1);
  LG_CHECK_CPU(a.op, weight);
  LG_CHECK_SAME_DTYPE(a.op, x, weight);
  LG_CHECK_SHAPE(a.op, weight, c);
  if (bias_opt) {
    const Tensor& bias = *bias_opt;
    LG_CHECK_CPU(a.op, bias);
    LG_CHECK_SAME_DTYPE(a.op, x, bias);
    LG_CHECK_SHAPE(a.op, bias, c);
  }
  if (residual_opt) {
    const Tensor& residual = *residual_opt;
    LG_CHECK_CPU(a.op, residual);
    LG_CHECK_SAME_DTYPE(a.op, x, residual);
    TORCH_CHECK(residual.sizes() == x.sizes(), a.op, ": 'residual' must have the shape of 'x' ", x.sizes(),
                ", got ", residual.sizes());
  }
}

// sum_out (optional) <- x + residual; y <- norm(x [+ residual]) * weight [+ bias].
template <typename scalar_t>
void norm_rows(const NormArgs& a, const Tensor& x, const Tensor* residual, const Tensor& weight,
               const c10::optional<Tensor>& bias, Tensor* sum_out, Tensor& y) {
  const int64_t c = x.size(-1);
  const int64_t rows = x.numel() / c;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
  scalar_t* sp = sum_out ? sum_out->data_ptr<scalar_t>() : nullptr;
  scalar_t* yp = y.data_ptr<scalar_t>();
  std::vector<float> wbuf, bbuf;
  const scalar_t* weight_data = weight.data_ptr<scalar_t>();
  const scalar_t* bias_data = bias ? bias->data_ptr<scalar_t>() : nullptr;
  // LayerNorm with weight and bias rounds as F.layer_norm (layer_norm_rows.cpp); the rest normalise here.
  const bool as_torch = !std::is_same_v<scalar_t, double> && !a.rms && bias_data;
  const float* w = as_torch ? nullptr : as_float(weight_data, c, wbuf);
  const float* b = bias && !as_torch ? as_float(bias_data, c, bbuf) : nullptr;

  at::parallel_for(0, rows, row_grain(c), [&](int64_t begin, int64_t end) {
    std::vector<float> row(c), xbuf;
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row_in = xp + r * c;
      if (rp) {
        // The sum is rounded to scalar_t before normalising, as the unfused composite does.
        for (int64_t i = 0; i < c; ++i) {
          sp[r * c + i] = static_cast<scalar_t>(static_cast<float>(xp[r * c + i]) + static_cast<float>(rp[r * c + i]));
        }
        row_in = sp + r * c;
      }
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (as_torch) {
          layer_norm_row_as_torch(row_in, weight_data, bias_data, yp + r * c, c, a.eps);
          continue;
        }
      }
      const float* src = as_float(row_in, c, xbuf);
      float mean = a.rms ? 0.f : row_sum(src, c) / c;
      float rstd = 1.f / std::sqrt(row_sum_sq(src, c, mean) / c + a.eps);
      float* out = row.data();
      if (a.rms) {
        // RMSNorm rounds the normalised value to the input dtype before the weight, like HF's Llama.
        for (int64_t i = 0; i < c; ++i)
          out[i] = static_cast<float>(static_cast<scalar_t>(src[i] * rstd)) * w[i];
      } else {
        fVec vm(mean), vr(rstd);
        int64_t i = 0;
        for (; i + fVec::size() <= c; i += fVec::size()) {
          fVec v = (fVec::loadu(src + i) - vm) * vr * fVec::loadu(w + i);
          if (b) v = v + fVec::loadu(b + i);
          v.store(out + i);
        }
        for (; i < c; ++i) out[i] = (src[i] - mean) * rstd * w[i] + (b ? b[i] : 0.f);
      }
      store_row(out, yp + r * c, c);
    }
  });
}

std::tuple<Tensor, Tensor> norm_impl(const NormArgs& a, const Tensor& x_in, const Tensor* residual_in,
                                     const Tensor& weight_in, const c10::optional<Tensor>& bias_in) {
  check_norm_inputs(a, x_in, residual_in, weight_in, bias_in);
  Tensor x = x_in.contiguous();
  Tensor residual = residual_in ? residual_in->contiguous() : Tensor();
  Tensor weight = weight_in.contiguous();
  c10::optional<Tensor> bias = bias_in ? c10::optional<Tensor>(bias_in->contiguous()) : c10::nullopt;
  Tensor y = at::empty_like(x);
  Tensor sum = residual_in ? at::empty_like(x) : Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lightgen.norm", [&] {
    norm_rows<scalar_t>(a, x, residual_in ? &residual : nullptr, weight, bias, residual_in ? &sum : nullptr, y);
  });
  return {sum, y};
}

}  // namespace

// Entry points (cpu_ops.h): the native decode step calls them directly, without the dispatcher.
// x: [..., C], weight/bias: [C]
Tensor layer_norm(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias, double eps) {
  return std::get<1>(norm_impl({"lightgen.layer_norm", false, static_cast<float>(eps)}, x, nullptr, weight, bias));
}

// x, residual: [..., C] -> (x + residual, layer_norm(x + residual))
std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                          const c10::optional<Tensor>& bias, double eps) {
  return norm_impl({"lightgen.add_layer_norm", false, static_cast<float>(eps)}, x, &residual, weight, bias);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return std::get<1>(norm_impl({"lightgen.rms_norm", true, static_cast<float>(eps)}, x, nullptr, weight, c10::nullopt));
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  return norm_impl({"lightgen.add_rms_norm", true, static_cast<float>(eps)}, x, &residual, weight, c10::nullopt);
}

}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("layer_norm", &lightgen::layer_norm);
  m.impl("add_layer_norm", &lightgen::add_layer_norm);
  m.impl("rms_norm", &lightgen::rms_norm);
  m.impl("add_rms_norm", &lightgen::add_rms_norm);
}
