// LayerNorm / RMSNorm, optionally fused with the residual add of pre-LN and post-LN blocks.
#include <torch/library.h>
#include "../include/checks.h"
#include "../include/cpu_ops.h"
#include "../include/layer_norm_rows.h"
#include "../include/vec_math.h"
#include <ATen/native/cpu/utils.h>
#include <algorithm>

namespace lightgen {
namespace {

using at::Tensor;

struct NormArgs {
  const char* op;
  bool rms;
  double eps;  // the model's; float rows add it as a float, as torch does
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

// torch's CPU sum of a contiguous float row (SumKernel.cpp's cascade_sum): vectors of 8 floats (its 256-bit build
// runs there even where the CPU capability is AVX-512: 16 lanes matched ~40% of rows, 8 all of them) taken four at
// a time into four accumulators, each a cascade of four levels that carries every 2^p vectors up one level; then
// the leftover vectors into the first, the others into it in turn; the scalar tail from zero, then the first's
// lanes in order. A row shorter than one vector is the same with one-float "vectors". Only adds happen here, so
// no multiply can be fused into them: HF's composite rounds each square before the sum.
template <int64_t lanes>
__attribute__((noinline)) float sum_as_torch(const float* v, int64_t n) {
  constexpr int kIlp = 4, kLevels = 4;
  const int64_t vectors = n / lanes, groups = vectors / kIlp;
  const int64_t power = std::max<int64_t>(4, at::native::utils::CeilLog2(groups) / kLevels);
  const int64_t step = int64_t{1} << power;
  float acc[kLevels][kIlp][lanes] = {};
  auto add_vector = [&](float* into, int64_t vector) {
    for (int64_t l = 0; l < lanes; ++l) into[l] += v[vector * lanes + l];
  };
  auto add_into = [&](float* into, float* from, bool clear) {
    for (int64_t l = 0; l < lanes; ++l) {
      into[l] += from[l];
      if (clear) from[l] = 0.f;
    }
  };
  int64_t g = 0;
  while (g + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++g)
      for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], g * kIlp + k);
    for (int level = 1; level < kLevels; ++level) {
      for (int k = 0; k < kIlp; ++k) add_into(acc[level][k], acc[level - 1][k], true);
      if (g & ((step - 1) << (level * power))) break;
    }
  }
  for (; g < groups; ++g)
    for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], g * kIlp + k);
  for (int level = 1; level < kLevels; ++level)
    for (int k = 0; k < kIlp; ++k) add_into(acc[0][k], acc[level][k], false);
  for (int64_t i = groups * kIlp; i < vectors; ++i) add_vector(acc[0][0], i);
  for (int k = 1; k < kIlp; ++k) add_into(acc[0][0], acc[0][k], false);
  float total = 0.f;
  for (int64_t i = vectors * lanes; i < n; ++i) total += v[i];
  for (int64_t l = 0; l < lanes; ++l) total += acc[0][0][l];
  return total;
}

// sum_out (optional) <- x + residual; y <- norm(x [+ residual]) * weight [+ bias]. LayerNorm rows round as
// F.layer_norm (layer_norm_rows.cpp) and RMSNorm rows as HF's composite (sum_as_torch).
template <typename scalar_t>
void norm_rows(const NormArgs& a, const Tensor& x, const Tensor* residual, const Tensor& weight,
               const c10::optional<Tensor>& bias, Tensor* sum_out, Tensor& y) {
  const int64_t c = x.size(-1);
  const int64_t rows = x.numel() / c;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
  scalar_t* sp = sum_out ? sum_out->data_ptr<scalar_t>() : nullptr;
  scalar_t* yp = y.data_ptr<scalar_t>();
  std::vector<float> wbuf;
  const scalar_t* weight_data = weight.data_ptr<scalar_t>();
  const scalar_t* bias_data = bias ? bias->data_ptr<scalar_t>() : nullptr;
  const float* w = a.rms ? as_float(weight_data, c, wbuf) : nullptr;

  at::parallel_for(0, rows, row_grain(c), [&](int64_t begin, int64_t end) {
    std::vector<float> row(c), xbuf, squares(c);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row_in = xp + r * c;
      if (rp) {
        // The sum is rounded to scalar_t before normalising, as the unfused composite does.
        for (int64_t i = 0; i < c; ++i) {
          sp[r * c + i] = static_cast<scalar_t>(static_cast<float>(xp[r * c + i]) + static_cast<float>(rp[r * c + i]));
        }
        row_in = sp + r * c;
      }
      if (!a.rms) {
        layer_norm_row_as_torch(row_in, weight_data, bias_data, yp + r * c, c, static_cast<float>(a.eps));
        continue;
      }
      const float* src = as_float(row_in, c, xbuf);
      for (int64_t i = 0; i < c; ++i) squares[i] = src[i] * src[i];
      const float sum = c < 8 ? sum_as_torch<1>(squares.data(), c) : sum_as_torch<8>(squares.data(), c);
      const float variance = sum / static_cast<float>(c);
      const float rstd = 1.f / std::sqrt(variance + static_cast<float>(a.eps));
      float* out = row.data();
      // RMSNorm rounds the normalised value to the input dtype before the weight, like HF's Llama.
      for (int64_t i = 0; i < c; ++i) out[i] = static_cast<float>(static_cast<scalar_t>(src[i] * rstd)) * w[i];
      store_row(out, yp + r * c, c);
    }
  });
}

// Where no row kernel rounds as the model does, its own composite runs: LayerNorm without bias, float LayerNorm
// whose width is not a multiple of 8 (the moments' scalar tail: torch's build leaves a product unfused that ours
// fuses, one ulp at ~0.6% of values), bf16 LayerNorm whose width is not a multiple of 16 (its partial vector:
// an fp32 ulp that flips bf16's rounding at ~5e-6 of values, widths 4-31; fp16 rounds as torch's), and double rows.
bool norm_needs_composite(const NormArgs& a, const Tensor& x, const c10::optional<Tensor>& bias) {
  if (x.scalar_type() == at::kDouble) return true;
  const int64_t width = x.size(-1);
  return !a.rms && (!bias || (x.scalar_type() == at::kFloat && width % 8) ||
                    (x.scalar_type() == at::kBFloat16 && width % 16));
}

std::tuple<Tensor, Tensor> norm_composite(const NormArgs& a, const Tensor& x, const Tensor* residual,
                                          const Tensor& weight, const c10::optional<Tensor>& bias) {
  Tensor total = residual ? x + *residual : Tensor();
  const Tensor& in = residual ? total : x;
  if (!a.rms) return {total, at::layer_norm(in, {in.size(-1)}, weight, bias, a.eps)};
  Tensor wide = in.to(at::kFloat);
  Tensor normed = wide * at::rsqrt(wide.pow(2).mean(-1, true) + a.eps);
  return {total, weight * normed.to(in.scalar_type())};
}

std::tuple<Tensor, Tensor> norm_impl(const NormArgs& a, const Tensor& x_in, const Tensor* residual_in,
                                     const Tensor& weight_in, const c10::optional<Tensor>& bias_in) {
  check_norm_inputs(a, x_in, residual_in, weight_in, bias_in);
  if (norm_needs_composite(a, x_in, bias_in)) return norm_composite(a, x_in, residual_in, weight_in, bias_in);
  Tensor x = x_in.contiguous();
  Tensor residual = residual_in ? residual_in->contiguous() : Tensor();
  Tensor weight = weight_in.contiguous();
  c10::optional<Tensor> bias = bias_in ? c10::optional<Tensor>(bias_in->contiguous()) : c10::nullopt;
  Tensor y = at::empty_like(x);
  Tensor sum = residual_in ? at::empty_like(x) : Tensor();
  auto rows = [&](auto zero) {
    using scalar_t = decltype(zero);
    norm_rows<scalar_t>(a, x, residual_in ? &residual : nullptr, weight, bias, residual_in ? &sum : nullptr, y);
  };
  switch (x.scalar_type()) {
    case at::kFloat: rows(float{}); break;
    case at::kBFloat16: rows(c10::BFloat16{}); break;
    case at::kHalf: rows(c10::Half{}); break;
    default: TORCH_CHECK(false, a.op, ": no kernel for ", x.scalar_type());
  }
  return {sum, y};
}

}  // namespace

// Entry points (cpu_ops.h): the native decode step calls them directly, without the dispatcher.
// x: [..., C], weight/bias: [C]
Tensor layer_norm(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias, double eps) {
  return std::get<1>(norm_impl({"lightgen.layer_norm", false, eps}, x, nullptr, weight, bias));
}

// x, residual: [..., C] -> (x + residual, layer_norm(x + residual))
std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                          const c10::optional<Tensor>& bias, double eps) {
  return norm_impl({"lightgen.add_layer_norm", false, eps}, x, &residual, weight, bias);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return std::get<1>(norm_impl({"lightgen.rms_norm", true, eps}, x, nullptr, weight, c10::nullopt));
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  return norm_impl({"lightgen.add_rms_norm", true, eps}, x, &residual, weight, c10::nullopt);
}

}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("layer_norm", &lightgen::layer_norm);
  m.impl("add_layer_norm", &lightgen::add_layer_norm);
  m.impl("rms_norm", &lightgen::rms_norm);
  m.impl("add_rms_norm", &lightgen::add_rms_norm);
}
