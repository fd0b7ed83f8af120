// Decode-shaped linear layer on CUDA: y = act(x @ W^T * scale + bias) for a few rows of x, with
// the weight layouts of the CPU op. Memory-bound GEMV kernels stream the weight once per tile of
// kTileRows rows of x and widen bf16 / int8 weights in registers:
//  - panels: packed [P, K, 64] and Conv1D's [K, N] (a row stride instead of 64): a block owns 64
//    output columns, kSlices groups of 64 threads split K, and each k step of a group reads 64
//    consecutive weights (coalesced);
//  - rows: nn.Linear's [N, K]: a warp per output column, lanes split K.
// float32 weights that are not packed, at more than kGemvMaxRows rows, go to cuBLAS (at::mm reads
// both [N, K] and its transposed view in place), then one epilogue kernel: there the GEMM is
// compute-bound and cuBLAS's tiling wins.
#include <torch/library.h>
#include "../include/cuda_common.cuh"

namespace lightgen {
namespace {

using at::Tensor;
using namespace lightgen::cuda;

constexpr const char* kOp = "lightgen.linear";
constexpr int64_t kPanel = 64;
constexpr int kSlices = 4;  // K slices per panel block: 256 threads
constexpr int kTileRows = 4;  // rows of x per weight pass, accumulated in registers
constexpr int kRowsWarps = 8;  // output columns per block of the rows kernel
constexpr int64_t kGemvMaxRows = 16;
constexpr int kMaxGridY = 65535;

__device__ __forceinline__ float widen(float w) { return w; }
__device__ __forceinline__ float widen(c10::BFloat16 w) { return static_cast<float>(w); }
__device__ __forceinline__ float widen(int8_t w) { return static_cast<float>(w); }

struct Epilogue {
  const float* scale;  // [N] or nullptr
  const float* bias;  // [N] or nullptr

  template <Act act>
  __device__ __forceinline__ float apply(float acc, int64_t n) const {
    if (scale) acc *= scale[n];
    if (bias) acc += bias[n];
    return activate<act>(acc);
  }
};

// What panel_kernel reads: weights(p, col, k) = the float weight of output column 64 p + col at input k.
template <typename W>
struct PanelWeights {  // packed [P, K, 64] (panel_stride K * 64, ld_w 64) or Conv1D's [K, N] (64, row stride)
  const W* w;
  int64_t panel_stride, ld_w;
  __device__ __forceinline__ float operator()(int64_t p, int col, int64_t k) const {
    return widen(w[p * panel_stride + col + k * ld_w]);
  }
};

// Group-wise quantized panels (the CPU op's format): int8 [P, K, 64] w = q * scale (+ offset), or int4 as uint8
// [P, ceil(K / 2), 64] (k = 2j low nibble, 2j + 1 high) w = u * scale + offset (none: -8 * scale).
template <bool nibbles>
struct GroupedWeights {
  const void* w;
  const float* scale;  // [P, G, 64]
  const float* offset;  // [P, G, 64] or nullptr
  int64_t panel_k, groups, group_size;
  __device__ __forceinline__ float operator()(int64_t p, int col, int64_t k) const {
    const int64_t g = (p * groups + k / group_size) * kPanel + col;
    const float d = scale[g];
    if constexpr (!nibbles) {
      const float q = static_cast<float>(static_cast<const int8_t*>(w)[(p * panel_k + k) * kPanel + col]);
      return offset ? fmaf(q, d, offset[g]) : q * d;
    } else {
      const uint8_t b = static_cast<const uint8_t*>(w)[(p * panel_k + k / 2) * kPanel + col];
      return static_cast<float>((k & 1) ? (b >> 4) : (b & 15)) * d + (offset ? offset[g] : -8.f * d);
    }
  }
};

// Panel p covers output columns [64 p, 64 p + 64), read through ``weights``.
template <typename Weights, Act act>
__global__ void __launch_bounds__(kSlices * kPanel)
    panel_kernel(const float* __restrict__ x, int64_t m, int64_t k_len, Weights weights, int64_t n, Epilogue epi,
                 float* __restrict__ y) {
  __shared__ float partial[kSlices][kTileRows][kPanel];
  const int col = threadIdx.x % kPanel, slice = threadIdx.x / kPanel;
  const int64_t out_col = blockIdx.x * kPanel + col;
  const bool live = out_col < n;  // Conv1D's last panel may end inside the tile; packed ones are padded
  for (int64_t row0 = blockIdx.y * kTileRows; row0 < m; row0 += static_cast<int64_t>(gridDim.y) * kTileRows) {
    const int rows = m - row0 < kTileRows ? static_cast<int>(m - row0) : kTileRows;
    const float* xr = x + row0 * k_len;
    float acc[kTileRows] = {};
    if (live) {
      for (int64_t k = slice; k < k_len; k += kSlices) {
        const float wv = weights(blockIdx.x, col, k);
#pragma unroll
        for (int r = 0; r < kTileRows; ++r)
          if (r < rows) acc[r] += xr[r * k_len + k] * wv;
      }
    }
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) partial[slice][r][col] = acc[r];
    __syncthreads();
    if (slice == 0 && live) {
      for (int r = 0; r < rows; ++r) {
        float total = 0.f;
#pragma unroll
        for (int s = 0; s < kSlices; ++s) total += partial[s][r][col];
        y[(row0 + r) * n + out_col] = epi.apply<act>(total, out_col);
      }
    }
    __syncthreads();  // partial is rewritten by the next row tile
  }
}

template <typename Weights>
void launch_panels(Act act, const float* x, int64_t m, int64_t k_len, Weights weights, int64_t n, Epilogue epi,
                   float* y) {
  const unsigned grid_y = static_cast<unsigned>(std::min<int64_t>(ceil_div(m, kTileRows), kMaxGridY));
  dispatch_act(act, [&](auto act_c) {
    panel_kernel<Weights, LG_CONST(act_c)><<<dim3(ceil_div(n, kPanel), grid_y), kSlices * kPanel, 0,
                                             c10::cuda::getCurrentCUDAStream()>>>(x, m, k_len, weights, n, epi, y);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// W [N, K] row-major: warp `warp` of block b computes column b * kRowsWarps + warp.
template <typename W, Act act>
__global__ void __launch_bounds__(kRowsWarps * 32)
    rows_kernel(const float* __restrict__ x, int64_t m, int64_t k_len, const W* __restrict__ w, int64_t n,
                Epilogue epi, float* __restrict__ y) {
  const int lane = threadIdx.x & 31;
  const int64_t out_col = blockIdx.x * static_cast<int64_t>(kRowsWarps) + (threadIdx.x >> 5);
  if (out_col >= n) return;  // whole warps leave; no block barrier below
  const W* wr = w + out_col * k_len;
  for (int64_t row0 = blockIdx.y * kTileRows; row0 < m; row0 += static_cast<int64_t>(gridDim.y) * kTileRows) {
    const int rows = m - row0 < kTileRows ? static_cast<int>(m - row0) : kTileRows;
    const float* xr = x + row0 * k_len;
    float acc[kTileRows] = {};
    for (int64_t k = lane; k < k_len; k += 32) {
      const float wv = widen(wr[k]);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r)
        if (r < rows) acc[r] += xr[r * k_len + k] * wv;
    }
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) acc[r] = warp_reduce(acc[r], Sum{});
    if (lane == 0)
      for (int r = 0; r < rows; ++r) y[(row0 + r) * n + out_col] = epi.apply<act>(acc[r], out_col);
  }
}

// y [M, N] <- act(y * scale + bias), after cuBLAS.
template <Act act>
__global__ void epilogue_kernel(float* __restrict__ y, int64_t total, int64_t n, Epilogue epi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = epi.apply<act>(y[i], i % n);
}

enum class Layout { kRows, kKMajor, kPacked };  // [N, K] rows, Conv1D's [K, N], packed panels

template <typename W>
void launch_gemv(Layout layout, Act act, const float* x, int64_t m, int64_t k_len, const Tensor& weight, int64_t n,
                 Epilogue epi, float* y) {
  const W* w = weight.data_ptr<W>();
  if (layout != Layout::kRows) {
    const bool packed = layout == Layout::kPacked;
    return launch_panels(act, x, m, k_len, PanelWeights<W>{w, packed ? k_len * kPanel : kPanel,
                                                             packed ? kPanel : weight.stride(1)}, n, epi, y);
  }
  const unsigned grid_y = static_cast<unsigned>(std::min<int64_t>(ceil_div(m, kTileRows), kMaxGridY));
  dispatch_act(act, [&](auto act_c) {
    rows_kernel<W, LG_CONST(act_c)><<<dim3(ceil_div(n, kRowsWarps), grid_y), kRowsWarps * 32, 0,
                                      c10::cuda::getCurrentCUDAStream()>>>(x, m, k_len, w, n, epi, y);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// x: [..., K] float32. weight, float32 / bfloat16 / int8 (int8 with a per-output-channel scale [N]):
//   [N, K] row-major (nn.Linear); float32 [N, K] viewed from a contiguous [K, N] (Conv1D's weight.t());
//   or packed panels [ceil(N / 64), K, 64] with out_features = N. bias: [N] float32.
Tensor linear(const Tensor& x_in, const Tensor& weight_in, const c10::optional<Tensor>& scale_in,
              const c10::optional<Tensor>& bias_in, c10::string_view act_name, int64_t out_features) {
  const Act act = parse_act(kOp, act_name);
  const bool packed = weight_in.dim() == 3;
  {
    const Tensor& x = x_in;
    const Tensor& weight = weight_in;
    LG_CHECK_CUDA(kOp, x);
    LG_CHECK_CUDA(kOp, weight);
    LG_CHECK_SAME_DEVICE(kOp, x, weight);
    TORCH_CHECK(x.scalar_type() == at::kFloat, kOp, ": 'x' must be float32, got ", x.scalar_type());
    TORCH_CHECK(weight.dim() == 2 || (packed && weight.size(2) == kPanel), kOp,
                ": 'weight' must be [out_features, in_features] or packed [panels, in_features, ", kPanel,
                "], got ", weight.sizes());
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), kOp, ": 'x' must end in in_features=",
                weight.size(1), ", got ", x.sizes());
    TORCH_CHECK(!packed || (out_features > (weight.size(0) - 1) * kPanel && out_features <= weight.size(0) * kPanel),
                kOp, ": packed weights need out_features in (", (weight.size(0) - 1) * kPanel, ", ",
                weight.size(0) * kPanel, "], got ", out_features);
    TORCH_CHECK(packed || out_features < 0 || out_features == weight.size(0), kOp, ": out_features=", out_features,
                " does not match 'weight' ", weight.sizes());
    const auto wtype = weight.scalar_type();
    TORCH_CHECK(wtype == at::kFloat || wtype == at::kBFloat16 || wtype == at::kChar, kOp,
                ": 'weight' must be float32, bfloat16 or int8, got ", wtype);
    TORCH_CHECK(wtype != at::kChar || scale_in.has_value(), kOp,
                ": int8 weights need their per-output-channel 'scale'");
  }
  const int64_t n = packed ? out_features : weight_in.size(0), k_len = weight_in.size(1);
  Tensor epilogue_operands[2];  // scale, bias: contiguous float32 [N] on x's device
  for (int i = 0; i < 2; ++i) {
    const c10::optional<Tensor>& given = i == 0 ? scale_in : bias_in;
    if (!given) continue;
    const Tensor& t = *given;
    TORCH_CHECK(t.device() == x_in.device() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == n, kOp,
                ": '", i == 0 ? "scale" : "bias", "' must be a float32 tensor of shape [", n, "] on ", x_in.device(),
                ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
    epilogue_operands[i] = t.contiguous();
  }
  const Epilogue epi{epilogue_operands[0].defined() ? epilogue_operands[0].data_ptr<float>() : nullptr,
                     epilogue_operands[1].defined() ? epilogue_operands[1].data_ptr<float>() : nullptr};
  const bool k_major = !packed && weight_in.scalar_type() == at::kFloat && weight_in.stride(0) == 1 && n > 1 &&
                       weight_in.stride(1) >= n;
  const Layout layout = packed ? Layout::kPacked : k_major ? Layout::kKMajor : Layout::kRows;
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor weight = k_major ? weight_in : weight_in.contiguous();
  const Tensor x = x_in.contiguous();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  const int64_t m = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  if (m == 0 || n == 0) return at::empty(out_sizes, x.options());

  if (!packed && weight.scalar_type() == at::kFloat && m > kGemvMaxRows) {
    Tensor y = at::mm(x.view({m, k_len}), weight.t());
    if (epi.scale || epi.bias || act != Act::kNone) {
      constexpr int kThreads = 256;
      dispatch_act(act, [&](auto act_c) {
        epilogue_kernel<LG_CONST(act_c)><<<grid_for(m * n, kThreads), kThreads, 0,
                                                  c10::cuda::getCurrentCUDAStream()>>>(y.data_ptr<float>(), m * n,
                                                                                       n, epi);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    return y.view(out_sizes);
  }
  Tensor y = at::empty(out_sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (weight.scalar_type()) {
    case at::kFloat: launch_gemv<float>(layout, act, xp, m, k_len, weight, n, epi, yp); break;
    case at::kBFloat16: launch_gemv<c10::BFloat16>(layout, act, xp, m, k_len, weight, n, epi, yp); break;
    default: launch_gemv<int8_t>(layout, act, xp, m, k_len, weight, n, epi, yp); break;
  }
  return y;
}

// x: [..., K] float32; weight / scale / offset: group-wise quantized panels as in the CPU op
// (lightgen/csrc/cpu/linear.cpp, linear_grouped); bias: [out_features] float32.
Tensor linear_grouped(const Tensor& x_in, const Tensor& weight, const Tensor& scale,
                      const c10::optional<Tensor>& offset, const c10::optional<Tensor>& bias,
                      c10::string_view act_name, int64_t out_features, int64_t group_size) {
  constexpr const char* op = "lightgen.linear_grouped";
  const Act act = parse_act(op, act_name);
  LG_CHECK_CUDA(op, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const GroupedLinear g = check_grouped_linear(op, x_in, weight, scale, offset, bias, out_features, group_size, kPanel);
  auto out_sizes = g.x.sizes().vec();
  out_sizes.back() = out_features;
  Tensor y = at::empty(out_sizes, g.x.options());
  const int64_t m = c10::multiply_integers(g.x.sizes().slice(0, g.x.dim() - 1));
  if (m == 0) return y;
  // float16 scales and offsets (int4's) are widened here: this kernel reads float32 ones.
  const Tensor scales = g.scale.to(at::kFloat), offset_values = g.offset.defined() ? g.offset.to(at::kFloat) : Tensor();
  const float* offsets = offset_values.defined() ? offset_values.data_ptr<float>() : nullptr;
  const Epilogue epi{nullptr, g.bias.defined() ? g.bias.data_ptr<float>() : nullptr};
  if (g.nibbles) {
    launch_panels(act, g.x.data_ptr<float>(), m, g.k_len,
                  GroupedWeights<true>{g.weight.data_ptr(), scales.data_ptr<float>(), offsets, g.panel_k, g.groups,
                                       group_size}, out_features, epi, y.data_ptr<float>());
  } else {
    launch_panels(act, g.x.data_ptr<float>(), m, g.k_len,
                  GroupedWeights<false>{g.weight.data_ptr(), scales.data_ptr<float>(), offsets, g.panel_k, g.groups,
                                        group_size}, out_features, epi, y.data_ptr<float>());
  }
  return y;
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CUDA, m) {
  m.impl("linear", &lightgen::linear);
  m.impl("linear_grouped", &lightgen::linear_grouped);
}
