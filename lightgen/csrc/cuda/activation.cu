// Bias + activation and the gated form act(gate) * up on CUDA: grid-stride elementwise kernels
// with the activation and the optional operand as template parameters.
#include <torch/library.h>
#include "../include/cuda_common.cuh"

namespace lightgen {
namespace {

using at::Tensor;
using namespace lightgen::cuda;

// out = act(x + bias[i % c]) or act(x) * up. Intermediates are rounded to scalar_t where the
// references' separate ops round them, so reduced-precision results match theirs.
template <typename scalar_t, Act act, bool has_bias, bool gated>
__global__ void act_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ bias,
                           const scalar_t* __restrict__ up, scalar_t* __restrict__ out, int64_t n, int64_t c) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = static_cast<float>(x[i]);
    if constexpr (has_bias) v = static_cast<float>(static_cast<scalar_t>(v + static_cast<float>(bias[i % c])));
    v = activate<act>(v);
    if constexpr (gated) v = static_cast<float>(static_cast<scalar_t>(v)) * static_cast<float>(up[i]);
    out[i] = static_cast<scalar_t>(v);
  }
}

Tensor launch(const char* op, c10::string_view act_name, const Tensor& x, const Tensor& bias, const Tensor& up) {
  const Act act = parse_act(op, act_name);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  constexpr int kThreads = 256;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lightgen.act", [&] {
    dispatch_act(act, [&](auto act_c) {
      dispatch_bool(bias.defined(), [&](auto bias_c) {
        dispatch_bool(up.defined(), [&](auto gated_c) {
          if constexpr (!(LG_CONST(bias_c) && LG_CONST(gated_c))) {  // never both
            act_kernel<scalar_t, LG_CONST(act_c), LG_CONST(bias_c), LG_CONST(gated_c)>
                <<<grid_for(n, kThreads), kThreads, 0, stream>>>(
                    x.data_ptr<scalar_t>(), bias.defined() ? bias.data_ptr<scalar_t>() : nullptr,
                    up.defined() ? up.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), n, x.size(-1));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
        });
      });
    });
  });
  return out;
}

// x: [..., C], bias: [C]
Tensor bias_act(const Tensor& x_in, const c10::optional<Tensor>& bias_in, c10::string_view act_name) {
  constexpr const char* op = "lightgen.bias_act";
  {
    const Tensor& x = x_in;
    LG_CHECK_CUDA(op, x);
    LG_CHECK_FLOAT(op, x);
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": 'x' needs a non-empty last dimension, got ", x.sizes());
    if (bias_in) {
      const Tensor& bias = *bias_in;
      LG_CHECK_CUDA_LIKE(op, x, bias);
      LG_CHECK_SHAPE(op, bias, x.size(-1));
    }
  }
  return launch(op, act_name, x_in.contiguous(), bias_in ? bias_in->contiguous() : Tensor(), Tensor());
}

// gate, up: [..., C] -> act(gate) * up
Tensor gated_act(const Tensor& gate_in, const Tensor& up_in, c10::string_view act_name) {
  constexpr const char* op = "lightgen.gated_act";
  {
    const Tensor& gate = gate_in;
    const Tensor& up = up_in;
    LG_CHECK_CUDA(op, gate);
    LG_CHECK_FLOAT(op, gate);
    LG_CHECK_CUDA_LIKE(op, gate, up);
    TORCH_CHECK(gate.sizes() == up.sizes(), op, ": 'gate' and 'up' must have the same shape, got ", gate.sizes(),
                " and ", up.sizes());
    TORCH_CHECK(gate.dim() >= 1 && gate.size(-1) > 0, op, ": 'gate' needs a non-empty last dimension");
  }
  return launch(op, act_name, gate_in.contiguous(), Tensor(), up_in.contiguous());
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CUDA, m) {
  m.impl("bias_act", &lightgen::bias_act);
  m.impl("gated_act", &lightgen::gated_act);
}
