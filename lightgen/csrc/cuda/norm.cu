// LayerNorm / RMSNorm on CUDA, optionally fused with the residual add: one block per row, block
// reductions in float. The row is read from global memory once per pass; at model widths it stays
// in L1/L2 between passes, which costs less than staging arbitrary widths in shared memory.
#include <torch/library.h>
#include "../include/cuda_common.cuh"

namespace lightgen {
namespace {

using at::Tensor;
using namespace lightgen::cuda;

// sum_out <- x + residual (rounded to scalar_t, as the unfused composite rounds it);
// y <- rms ? scalar_t(src * rstd) * weight : (src - mean) * rstd * weight + bias, src = x or the sum.
template <typename scalar_t, bool rms, bool has_residual, bool has_bias>
__global__ void norm_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ residual,
                            const scalar_t* __restrict__ weight, const scalar_t* __restrict__ bias,
                            scalar_t* __restrict__ sum_out, scalar_t* __restrict__ y, int64_t c, float eps) {
  __shared__ float scratch[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * c;
  const scalar_t* src = x + offset;
  if constexpr (has_residual) {
    // Each thread later rereads only the elements it wrote here, so no barrier is needed.
    for (int64_t i = threadIdx.x; i < c; i += blockDim.x)
      sum_out[offset + i] = static_cast<scalar_t>(static_cast<float>(x[offset + i]) +
                                                  static_cast<float>(residual[offset + i]));
    src = sum_out + offset;
  }
  float mean = 0.f;
  if constexpr (!rms) {
    float s = 0.f;
    for (int64_t i = threadIdx.x; i < c; i += blockDim.x) s += static_cast<float>(src[i]);
    mean = block_reduce(s, Sum{}, 0.f, scratch) / c;
  }
  float sq = 0.f;
  for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
    const float d = static_cast<float>(src[i]) - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(block_reduce(sq, Sum{}, 0.f, scratch) / c + eps);
  for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
    const float v = static_cast<float>(src[i]);
    float out;
    if constexpr (rms) {
      // Rounded to the input dtype before the weight, like HF's Llama RMSNorm.
      out = static_cast<float>(static_cast<scalar_t>(v * rstd)) * static_cast<float>(weight[i]);
    } else {
      out = (v - mean) * rstd * static_cast<float>(weight[i]);
      if constexpr (has_bias) out += static_cast<float>(bias[i]);
    }
    y[offset + i] = static_cast<scalar_t>(out);
  }
}

std::tuple<Tensor, Tensor> norm_impl(const char* op, bool rms, double eps, const Tensor& x_in,
                                     const Tensor* residual_in, const Tensor& weight_in,
                                     const c10::optional<Tensor>& bias_in) {
  LG_CHECK_CUDA(op, x_in);
  LG_CHECK_FLOAT(op, x_in);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) > 0, op, ": 'x' needs a non-empty last dimension, got shape ",
              x_in.sizes());
  const int64_t c = x_in.size(-1);
  {
    const Tensor& x = x_in;
    const Tensor& weight = weight_in;
    LG_CHECK_CUDA_LIKE(op, x, weight);
    LG_CHECK_SHAPE(op, weight, c);
    if (bias_in) {
      const Tensor& bias = *bias_in;
      LG_CHECK_CUDA_LIKE(op, x, bias);
      LG_CHECK_SHAPE(op, bias, c);
    }
    if (residual_in) {
      const Tensor& residual = *residual_in;
      LG_CHECK_CUDA_LIKE(op, x, residual);
      TORCH_CHECK(residual.sizes() == x.sizes(), op, ": 'residual' must have the shape of 'x' ", x.sizes(),
                  ", got ", residual.sizes());
    }
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous();
  const Tensor residual = residual_in ? residual_in->contiguous() : Tensor();
  const Tensor weight = weight_in.contiguous();
  const Tensor bias = bias_in ? bias_in->contiguous() : Tensor();
  Tensor y = at::empty_like(x);
  Tensor sum = residual_in ? at::empty_like(x) : Tensor();
  const int64_t rows = x.numel() / c;
  if (rows == 0) return {sum, y};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lightgen.norm", [&] {
    dispatch_bool(rms, [&](auto rms_c) {
      dispatch_bool(residual.defined(), [&](auto res_c) {
        dispatch_bool(bias.defined(), [&](auto bias_c) {
          if constexpr (!(LG_CONST(rms_c) && LG_CONST(bias_c))) {  // RMSNorm has no bias
            norm_kernel<scalar_t, LG_CONST(rms_c), LG_CONST(res_c), LG_CONST(bias_c)>
                <<<rows, row_threads(c), 0, stream>>>(
                    x.data_ptr<scalar_t>(), residual.defined() ? residual.data_ptr<scalar_t>() : nullptr,
                    weight.data_ptr<scalar_t>(), bias.defined() ? bias.data_ptr<scalar_t>() : nullptr,
                    sum.defined() ? sum.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), c,
                    static_cast<float>(eps));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
        });
      });
    });
  });
  return {sum, y};
}

// x: [..., C], weight/bias: [C]
Tensor layer_norm(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias, double eps) {
  return std::get<1>(norm_impl("lightgen.layer_norm", false, eps, x, nullptr, weight, bias));
}

// x, residual: [..., C] -> (x + residual, layer_norm(x + residual))
std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                          const c10::optional<Tensor>& bias, double eps) {
  return norm_impl("lightgen.add_layer_norm", false, eps, x, &residual, weight, bias);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return std::get<1>(norm_impl("lightgen.rms_norm", true, eps, x, nullptr, weight, c10::nullopt));
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  return norm_impl("lightgen.add_rms_norm", true, eps, x, &residual, weight, c10::nullopt);
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CUDA, m) {
  m.impl("layer_norm", &lightgen::layer_norm);
  m.impl("add_layer_norm", &lightgen::add_layer_norm);
  m.impl("rms_norm", &lightgen::rms_norm);
  m.impl("add_rms_norm", &lightgen::add_rms_norm);
}
