// Attention over a preallocated KV cache on CUDA. One kernel writes the step's new K/V in place at
// each row's cache position; the other runs one block per (query, head, batch row): its warps take
// keys in turn, each keeping an online softmax (running max, sum and weighted values in registers),
// and the block merges the warps' partial results. One pass over K and V, no scores buffer, so any
// cache length fits.
#include <torch/library.h>
#include <limits>
#include "../include/attention_mask.h"
#include "../include/cuda_common.cuh"

namespace lightgen {
namespace {

using at::Tensor;
using namespace lightgen::cuda;

constexpr const char* kOp = "lightgen.attention";
constexpr int kWarps = 4;
constexpr int kMaxChunks = 16;  // head_dim <= 32 * kMaxChunks = 512

struct Strides3 {
  int64_t b, h, t;  // the last dimension is contiguous
};

inline Strides3 strides3(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// Copies k_new/v_new [B, Hkv, Tq, D] into the caches at rows cache_pos[b] + t. One block per (b, h, t).
template <typename scalar_t>
__global__ void write_kv_kernel(const scalar_t* __restrict__ k_new, const scalar_t* __restrict__ v_new, Strides3 ks,
                                Strides3 vs, scalar_t* __restrict__ k_cache,
                                scalar_t* __restrict__ v_cache, Strides3 kcs, Strides3 vcs,
                                const int64_t* __restrict__ cache_pos, int64_t heads, int64_t q_len, int64_t max_len,
                                int64_t dim) {
  const int64_t t = blockIdx.x % q_len, h = (blockIdx.x / q_len) % heads, b = blockIdx.x / (q_len * heads);
  const int64_t pos = (cache_pos ? cache_pos[b] : 0) + t;
  CUDA_KERNEL_ASSERT_MSG(pos >= t && pos < max_len, "lightgen.attention: a row writes past its cache (cache overflow)");
  const scalar_t* ks_row = k_new + b * ks.b + h * ks.h + t * ks.t;
  const scalar_t* vs_row = v_new + b * vs.b + h * vs.h + t * vs.t;
  scalar_t* kd = k_cache + b * kcs.b + h * kcs.h + pos * kcs.t;
  scalar_t* vd = v_cache + b * vcs.b + h * vcs.h + pos * vcs.t;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    kd[d] = ks_row[d];
    vd[d] = vs_row[d];
  }
}

// out[b, i, h, :] for query i of head h in batch row b; lane l holds dims l, l + 32, ... of the query
// and of the running weighted sum.
template <typename scalar_t, int kChunks>
__global__ void __launch_bounds__(kWarps * 32)
    attention_kernel(const scalar_t* __restrict__ q, Strides3 qs, const scalar_t* __restrict__ k, Strides3 ks,
                     const scalar_t* __restrict__ v, Strides3 vs, const int64_t* __restrict__ cache_pos, bool has_new,
                     int64_t max_len, int64_t group, int64_t dim, MaskView mask, float scale, bool causal,
                     int64_t window, float softcap, scalar_t* __restrict__ out) {
  __shared__ float part_max[kWarps], part_sum[kWarps], part_acc[kWarps][32 * kChunks];
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t q_len = gridDim.x, q_heads = gridDim.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t len = has_new ? (cache_pos ? cache_pos[b] : 0) + q_len : max_len;
  const int64_t slot = len - q_len + i;  // the query's own cache position (bottom-right aligned)
  const int64_t last = causal ? slot : len - 1;
  const int64_t first = window > 0 ? (slot - window + 1 > 0 ? slot - window + 1 : 0) : 0;  // sliding window
  const scalar_t* qr = q + b * qs.b + h * qs.h + i * qs.t;
  const scalar_t* kb = k + b * ks.b + (h / group) * ks.h;
  const scalar_t* vb = v + b * vs.b + (h / group) * vs.h;
  const int64_t mask_row = b * mask.sb + h * mask.sh + i * mask.sq;

  float qv[kChunks], acc[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t d = lane + 32 * c;
    qv[c] = d < dim ? static_cast<float>(qr[d]) : 0.f;
    acc[c] = 0.f;
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float run_max = kNegInf, run_sum = 0.f;
  for (int64_t j = first + warp; j <= last; j += kWarps) {
    const scalar_t* kr = kb + j * ks.t;
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t d = lane + 32 * c;
      if (d < dim) dot += qv[c] * static_cast<float>(kr[d]);
    }
    // The xor butterfly leaves the same sum in every lane, so the branches below are warp-uniform.
    float s = warp_reduce(dot, Sum{}) * scale;
    if (softcap > 0.f) s = tanhf(s / softcap) * softcap;  // Gemma 2: capped before the mask
    if (mask.keep) s = mask.keep[mask_row + j] ? s : kNegInf;
    if (mask.add) s += mask.add[mask_row + j];
    if (s == kNegInf) continue;  // masked: weight 0, and its (maybe unwritten) value is never read
    const float new_max = fmaxf(run_max, s);
    const float rescale = expf(run_max - new_max);  // 0 while run_max is -inf
    const float p = expf(s - new_max);
    run_sum = run_sum * rescale + p;
    const scalar_t* vr = vb + j * vs.t;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t d = lane + 32 * c;
      acc[c] = acc[c] * rescale + (d < dim ? p * static_cast<float>(vr[d]) : 0.f);
    }
    run_max = new_max;
  }
  if (lane == 0) {
    part_max[warp] = run_max;
    part_sum[warp] = run_sum;
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) part_acc[warp][lane + 32 * c] = acc[c];
  __syncthreads();

  float block_max = kNegInf;
  for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, part_max[w]);
  float weight[kWarps], denom = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    weight[w] = block_max == kNegInf ? 0.f : expf(part_max[w] - block_max);
    denom += part_sum[w] * weight[w];
  }
  scalar_t* o = out + ((b * q_len + i) * q_heads + h) * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += part_acc[w][d] * weight[w];
    o[d] = static_cast<scalar_t>(denom > 0.f ? total / denom : 0.f);  // no visible key: zeros
  }
}

template <typename F>
void dispatch_chunks(int64_t dim, F&& f) {
  if (dim <= 32) return f(std::integral_constant<int, 1>{});
  if (dim <= 64) return f(std::integral_constant<int, 2>{});
  if (dim <= 128) return f(std::integral_constant<int, 4>{});
  if (dim <= 256) return f(std::integral_constant<int, 8>{});
  f(std::integral_constant<int, kMaxChunks>{});
}

// q: [B, Hq, Tq, D]; k_cache, v_cache: [B, Hkv, Tmax, D] (mutated when k_new is given);
// k_new, v_new: [B, Hkv, Tq, D], written at cache_pos[b] + t; cache_pos: int64 [B] (default 0);
// mask: bool (true = attend) or additive, [B, Tk] or broadcastable to [B, Hq, Tq, Tk] with Tk = Tmax.
// Row b attends to keys [0, cache_pos[b] + Tq) with new K/V, else to all Tmax keys. Returns [B, Tq, Hq, D].
// window > 0 and softcap > 0: as the CPU op (sliding window over cache positions; tanh capping before the mask).
Tensor attention(const Tensor& q, Tensor& k_cache, Tensor& v_cache, const c10::optional<Tensor>& k_new,
                 const c10::optional<Tensor>& v_new, const c10::optional<Tensor>& cache_pos,
                 const c10::optional<Tensor>& mask, double scale, bool causal, int64_t window, double softcap,
                 bool /*stepwise*/, bool /*eager*/, bool /*upcast*/, bool /*softmax_in_dtype*/, bool /*pack_gqa*/,
                 int64_t /*static_slots: these six are the CPU kernels' fp16 / bf16 rounding, as PyTorch's CPU's*/) {
  LG_CHECK_CUDA(kOp, q);
  LG_CHECK_FLOAT(kOp, q);
  LG_CHECK_CUDA_LIKE(kOp, q, k_cache);
  LG_CHECK_CUDA_LIKE(kOp, q, v_cache);
  const AttentionShape shape = check_attention_shapes(kOp, q, k_cache, v_cache);
  const int64_t B = shape.B, Hq = shape.Hq, Tq = shape.Tq, D = shape.D, Hkv = shape.Hkv, Tmax = shape.Tmax;
  TORCH_CHECK(D <= 32 * kMaxChunks, kOp, ": head_dim ", D, " is above the CUDA kernel's ", 32 * kMaxChunks);
  LG_CHECK_LAST_CONTIGUOUS(kOp, q);
  LG_CHECK_LAST_CONTIGUOUS(kOp, k_cache);
  LG_CHECK_LAST_CONTIGUOUS(kOp, v_cache);
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), kOp, ": 'k_new' and 'v_new' must be given together");
  TORCH_CHECK(window >= 0 && softcap >= 0, kOp, ": 'window' and 'softcap' must be >= 0 (0: none), got ", window, ", ",
              softcap);
  TORCH_CHECK(!cache_pos || k_new, kOp, ": 'cache_pos' only applies when new keys are written ('k_new')");
  const c10::cuda::CUDAGuard guard(q.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();

  TORCH_CHECK(Hq <= 65535 && B <= 65535, kOp, ": the CUDA kernel takes at most 65535 heads and batch rows");
  Tensor pos;  // int64 [B] on q's device, or undefined for all zeros
  Tensor new_kv[2];  // k_new, v_new with a dense last dimension
  if (k_new) {
    for (const Tensor* t : {&*k_new, &*v_new}) {
      LG_CHECK_CUDA_LIKE(kOp, q, (*t));
      TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == Hkv && t->size(2) == Tq && t->size(3) == D, kOp,
                  ": new keys/values must be [B, Hkv, Tq, D] = [", B, ", ", Hkv, ", ", Tq, ", ", D, "], got ",
                  t->sizes());
    }
    new_kv[0] = k_new->stride(3) == 1 ? *k_new : k_new->contiguous();
    new_kv[1] = v_new->stride(3) == 1 ? *v_new : v_new->contiguous();
    TORCH_CHECK(Tq <= Tmax, kOp, ": row 0 writes positions [0, ", Tq, ") but the cache holds ", Tmax,
                " (cache overflow)");
    if (cache_pos) {
      TORCH_CHECK(cache_pos->scalar_type() == at::kLong && cache_pos->dim() == 1 && cache_pos->size(0) == B, kOp,
                  ": 'cache_pos' must be int64 [B] = [", B, "], got ", cache_pos->scalar_type(), " ",
                  cache_pos->sizes());
      if (cache_pos->is_cpu()) {
        // Host positions are checked here, as the CPU op does; device positions by the write kernel's
        // assert, since reading them here would stall the stream on every layer of every step.
        const Tensor p = cache_pos->contiguous();
        for (int64_t b = 0; b < B; ++b) {
          const int64_t start = p.data_ptr<int64_t>()[b];
          TORCH_CHECK(start >= 0 && start + Tq <= Tmax, kOp, ": row ", b, " writes positions [", start, ", ",
                      start + Tq, ") but the cache holds ", Tmax, " (cache overflow)");
        }
      }
      TORCH_CHECK(cache_pos->is_cpu() || cache_pos->device() == q.device(), kOp,
                  ": 'cache_pos' must be on the CPU or on the device of 'q', got ", cache_pos->device());
      pos = cache_pos->to(q.device()).contiguous();
    }
  } else {
    TORCH_CHECK(Tq <= Tmax || !causal, kOp, ": causal attention needs at least as many keys as queries");
  }

  MaskView mask_args;
  Tensor mask_keepalive;
  if (mask) {
    TORCH_CHECK(mask->device() == q.device(), kOp, ": 'mask' must be on the device of 'q' (", q.device(),
                "), got ", mask->device());
    mask_keepalive = broadcast_mask(kOp, *mask, B, Hq, Tq, Tmax, mask_args);
  }

  Tensor out = at::empty({B, Tq, Hq, D}, q.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), kOp, [&] {
    const int64_t* pos_p = pos.defined() ? pos.data_ptr<int64_t>() : nullptr;
    if (k_new) {
      write_kv_kernel<scalar_t><<<B * Hkv * Tq, row_threads(D, 256), 0, stream>>>(
          new_kv[0].data_ptr<scalar_t>(), new_kv[1].data_ptr<scalar_t>(), strides3(new_kv[0]), strides3(new_kv[1]),
          k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), strides3(k_cache), strides3(v_cache), pos_p,
          Hkv, Tq, Tmax, D);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    dispatch_chunks(D, [&](auto chunks_c) {
      attention_kernel<scalar_t, LG_CONST(chunks_c)><<<dim3(Tq, Hq, B), kWarps * 32, 0, stream>>>(
          q.data_ptr<scalar_t>(), strides3(q), k_cache.data_ptr<scalar_t>(), strides3(k_cache),
          v_cache.data_ptr<scalar_t>(), strides3(v_cache), pos_p, k_new.has_value(), Tmax, Hq / Hkv, D, mask_args,
          static_cast<float>(scale), causal, window, static_cast<float>(softcap), out.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CUDA, m) {
  m.impl("attention", &lightgen::attention);
}
