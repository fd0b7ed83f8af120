// Token embedding x scale + positional embedding on CUDA: one block per token.
#include <torch/library.h>
#include "../include/cuda_common.cuh"

namespace lightgen {
namespace {

using at::Tensor;
using namespace lightgen::cuda;

constexpr const char* kOp = "lightgen.embedding";

// out[t] = scalar_t(weight[ids[t]] * scale) (+ pos_weight[positions[t]]). Out-of-range ids stop the
// kernel with a device-side assert, as torch.nn.functional.embedding does on CUDA: checking them on
// the host would cost a device sync on every decode step.
template <typename scalar_t, bool has_pos>
__global__ void embedding_kernel(const int64_t* __restrict__ ids, const scalar_t* __restrict__ weight, int64_t vocab,
                                 float scale, const int64_t* __restrict__ positions,
                                 const scalar_t* __restrict__ pos_weight, int64_t pos_rows, scalar_t* __restrict__ out,
                                 int64_t d) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  CUDA_KERNEL_ASSERT_MSG(id >= 0 && id < vocab, "lightgen.embedding: token id outside the table");
  const scalar_t* w = weight + id * d;
  const scalar_t* p = nullptr;
  if constexpr (has_pos) {
    const int64_t pos = positions[t];
    CUDA_KERNEL_ASSERT_MSG(pos >= 0 && pos < pos_rows, "lightgen.embedding: position outside the table");
    p = pos_weight + pos * d;
  }
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    // The scaled token embedding is rounded first, as the unfused `embed(x) * scale + pos` rounds it
    // (__fmul_rn / __fadd_rn: nvcc would otherwise contract the two into one fused multiply-add).
    float v = static_cast<float>(static_cast<scalar_t>(__fmul_rn(static_cast<float>(w[i]), scale)));
    if constexpr (has_pos) v = __fadd_rn(v, static_cast<float>(p[i]));
    out[t * d + i] = static_cast<scalar_t>(v);
  }
}

// ids: int64 [...]; weight: [V, D]; pos_weight: [P, D]; positions: int64, same shape as ids. Returns [..., D].
Tensor embedding(const Tensor& ids_in, const Tensor& weight_in, double scale, const c10::optional<Tensor>& pos_weight_in,
                 const c10::optional<Tensor>& positions_in) {
  {
    const Tensor& ids = ids_in;
    const Tensor& weight = weight_in;
    LG_CHECK_CUDA(kOp, weight);
    LG_CHECK_FLOAT(kOp, weight);
    LG_CHECK_CUDA(kOp, ids);
    LG_CHECK_SAME_DEVICE(kOp, weight, ids);
    TORCH_CHECK(ids.scalar_type() == at::kLong, kOp, ": 'ids' must be int64, got ", ids.scalar_type());
    TORCH_CHECK(weight.dim() == 2, kOp, ": 'weight' must be [V, D], got ", weight.sizes());
  }
  TORCH_CHECK(pos_weight_in.has_value() == positions_in.has_value(), kOp,
              ": 'pos_weight' and 'positions' must be given together");
  const int64_t d = weight_in.size(1);
  if (pos_weight_in) {
    const Tensor& weight = weight_in;
    const Tensor& pos_weight = *pos_weight_in;
    const Tensor& positions = *positions_in;
    LG_CHECK_CUDA_LIKE(kOp, weight, pos_weight);
    LG_CHECK_CUDA(kOp, positions);
    LG_CHECK_SAME_DEVICE(kOp, weight, positions);
    TORCH_CHECK(pos_weight.dim() == 2 && pos_weight.size(1) == d, kOp, ": 'pos_weight' must be [P, ", d, "], got ",
                pos_weight.sizes());
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.sizes() == ids_in.sizes(), kOp,
                ": 'positions' must be int64 with the shape of 'ids' ", ids_in.sizes(), ", got ",
                positions.scalar_type(), " ", positions.sizes());
  }
  const c10::cuda::CUDAGuard guard(weight_in.device());
  const Tensor ids = ids_in.contiguous();
  const Tensor weight = weight_in.contiguous();
  const Tensor pos_weight = pos_weight_in ? pos_weight_in->contiguous() : Tensor();
  const Tensor positions = positions_in ? positions_in->contiguous() : Tensor();
  auto out_shape = ids.sizes().vec();
  out_shape.push_back(d);
  Tensor out = at::empty(out_shape, weight.options());
  const int64_t n = ids.numel();
  if (n == 0 || d == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), kOp, [&] {
    dispatch_bool(pos_weight.defined(), [&](auto pos_c) {
      embedding_kernel<scalar_t, LG_CONST(pos_c)><<<n, row_threads(d, 256), 0, stream>>>(
          ids.data_ptr<int64_t>(), weight.data_ptr<scalar_t>(), weight.size(0), static_cast<float>(scale),
          positions.defined() ? positions.data_ptr<int64_t>() : nullptr,
          pos_weight.defined() ? pos_weight.data_ptr<scalar_t>() : nullptr,
          pos_weight.defined() ? pos_weight.size(0) : 0, out.data_ptr<scalar_t>(), d);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CUDA, m) {
  m.impl("embedding", &lightgen::embedding);
}
