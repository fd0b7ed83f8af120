// Beam-search candidate selection on CUDA, LightSeq's R-top-k: the exact top-k of
// log_softmax(scores) + beam_scores over each batch item's beams x V candidates without a full sort.
// log_softmax is ATen's own (a fused log-sum-exp sums in another order, and its last-bit differences
// reorder near-tied candidates: measured on an H200, 38 of 128000 indices at V = 32000).
// Kernel 1, one block per row: the maxima of k contiguous chunks (a warp per chunk) give a rough
// threshold (their minimum, <= the row's k-th largest value).
// Kernel 2, one block per batch item: every candidate above the largest of its beams' thresholds
// goes to a shared-memory queue, which a bitonic sort orders. An item whose survivors overflow the
// queue (masked rows, a k near V) is redone with a full ATen sort; results are identical either way.
#include <torch/library.h>
#include <climits>
#include <limits>
#include "../include/cuda_common.cuh"

namespace lightgen {
namespace {

using at::Tensor;
using namespace lightgen::cuda;

constexpr const char* kOp = "lightgen.beam_topk";
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kRowThreads = 256;
constexpr int kSelectThreads = 512;
constexpr int kQueue = 2048;  // candidates sorted in shared memory (16 KB)

// Descending value, then ascending index: torch.sort(stable=True, descending=True) order.
__device__ __forceinline__ bool ranks_before(float av, int ai, float bv, int bi) {
  return av > bv || (av == bv && ai < bi);
}

// errors[0]: smallest row of 'scores' holding NaN or +inf; errors[1]: of 'beam_scores'; both start at INT_MAX.
__global__ void __launch_bounds__(kRowThreads)
    row_thresholds_kernel(const float* __restrict__ scores, const float* __restrict__ beam_scores, int64_t vocab,
                          int64_t k, float* __restrict__ thresholds, int* __restrict__ errors) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  const float* x = scores + row * vocab;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  // With k > V the row alone cannot fill the top k: one chunk, for the max, and a -inf threshold.
  const int64_t chunks = k <= vocab ? k : 1;
  float warp_min = kInf;
  bool bad = false;
  for (int64_t g = warp; g < chunks; g += warps) {
    float m = -kInf;
    for (int64_t t = g * vocab / chunks + lane, end = (g + 1) * vocab / chunks; t < end; t += 32) {
      const float v = x[t];
      bad |= isnan(v) || v == kInf;
      m = fmaxf(m, v);
    }
    warp_min = fminf(warp_min, warp_reduce(m, Max{}));
  }
  if (bad) atomicMin(&errors[0], row);
  const float rough = k <= vocab ? block_reduce(warp_min, Min{}, kInf, scratch) : -kInf;
  if (threadIdx.x == 0) {
    const float beam = beam_scores ? beam_scores[row] : 0.f;
    if (isnan(beam) || beam == kInf) atomicMin(&errors[1], row);
    thresholds[row] = rough + beam;  // adding the beam's score keeps the order
  }
}

// One block per batch item: survivors[item] and, unless they overflow the queue, the item's top k.
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(const float* __restrict__ scores, const float* __restrict__ beam_scores,
                  const float* __restrict__ thresholds, int beams, int64_t vocab, int64_t k,
                  float* __restrict__ values, int64_t* __restrict__ indices, int64_t* __restrict__ survivors,
                  int* __restrict__ overflow) {
  __shared__ float queue_value[kQueue];
  __shared__ int queue_index[kQueue];
  __shared__ int count;
  const int64_t item = blockIdx.x, first = item * beams;
  // Each beam's k candidates above its own threshold are all above the smallest of the thresholds,
  // so at least k pass the largest one: the item's exact top k are among them.
  float threshold = -kInf;
  for (int b = 0; b < beams; ++b) threshold = fmaxf(threshold, thresholds[first + b]);
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  for (int b = 0; b < beams; ++b) {
    const int64_t row = first + b;
    const float* x = scores + row * vocab;
    const float beam = beam_scores ? beam_scores[row] : 0.f;
    for (int64_t t = threadIdx.x; t < vocab; t += blockDim.x) {
      const float v = x[t] + beam;
      if (v >= threshold) {
        const int slot = atomicAdd(&count, 1);
        if (slot < kQueue) {
          queue_value[slot] = v;
          queue_index[slot] = static_cast<int>(b * vocab + t);
        }
      }
    }
  }
  __syncthreads();
  const int n = count;
  if (threadIdx.x == 0) survivors[item] = n;
  if (n > kQueue) {
    if (threadIdx.x == 0) atomicExch(overflow, 1);
    return;
  }
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = n + threadIdx.x; i < size; i += blockDim.x) {  // padding ranks after every candidate
    queue_value[i] = -kInf;
    queue_index[i] = INT_MAX;
  }
  __syncthreads();
  // Bitonic sort into ranks_before order; indices are distinct, so the order is total.
  for (int span = 2; span <= size; span <<= 1) {
    for (int stride = span >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < size; i += blockDim.x) {
        const int j = i ^ stride;
        if (j <= i) continue;
        const float vi = queue_value[i], vj = queue_value[j];
        const int ii = queue_index[i], ij = queue_index[j];
        const bool forward = (i & span) == 0;
        if (forward ? ranks_before(vj, ij, vi, ii) : ranks_before(vi, ii, vj, ij)) {
          queue_value[i] = vj;
          queue_value[j] = vi;
          queue_index[i] = ij;
          queue_index[j] = ii;
        }
      }
      __syncthreads();
    }
  }
  // n >= k unless the input held NaN, which the host reports as an error after this kernel.
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    values[item * k + i] = i < n ? queue_value[i] : -kInf;
    indices[item * k + i] = i < n ? queue_index[i] : -1;
  }
}

// All candidates [B, beams * V], for the full-sort path.
__global__ void candidates_kernel(const float* __restrict__ scores, const float* __restrict__ beam_scores,
                                  int64_t vocab, float* __restrict__ out) {
  const int64_t row = blockIdx.x;
  const float beam = beam_scores ? beam_scores[row] : 0.f;
  for (int64_t t = threadIdx.x; t < vocab; t += blockDim.x) out[row * vocab + t] = scores[row * vocab + t] + beam;
}

// scores: float32 [B * beams, V]; beam_scores: float32 [B * beams].
// Returns values [B, k] (descending), flat indices beam * V + token [B, k], and survivors [B]:
// how many candidates passed the rough threshold and were sorted.
std::tuple<Tensor, Tensor, Tensor> beam_topk(const Tensor& scores_in, const c10::optional<Tensor>& beam_scores_in,
                                             int64_t beams, int64_t k, bool log_softmax, bool stable) {
  {
    const Tensor& scores = scores_in;
    LG_CHECK_CUDA(kOp, scores);
    TORCH_CHECK(scores.scalar_type() == at::kFloat, kOp, ": 'scores' must be float32, got ", scores.scalar_type());
    TORCH_CHECK(scores.dim() == 2 && scores.size(1) > 0, kOp, ": 'scores' must be [B * beams, V] with V > 0, got ",
                scores.sizes());
    TORCH_CHECK(beams >= 1, kOp, ": 'beams' must be >= 1, got ", beams);
    TORCH_CHECK(scores.size(0) % beams == 0, kOp, ": the ", scores.size(0),
                " rows of 'scores' are not a multiple of ", beams, " beams");
    const int64_t candidates = beams * scores.size(1);
    TORCH_CHECK(k >= 1 && k <= candidates, kOp, ": 'k' must be in [1, beams * V] = [1, ", candidates, "], got ", k);
    TORCH_CHECK(candidates < INT_MAX && scores.size(0) < INT_MAX, kOp,
                ": the CUDA kernel takes fewer than 2^31 candidates per item and rows");
    if (beam_scores_in) {
      const Tensor& beam_scores = *beam_scores_in;
      LG_CHECK_CUDA_LIKE(kOp, scores, beam_scores);
      LG_CHECK_SHAPE(kOp, beam_scores, scores.size(0));
    }
  }
  const c10::cuda::CUDAGuard guard(scores_in.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // A row of only -inf has a NaN log_softmax; its candidates stay -inf like any masked token (the reference's rule).
  const Tensor scores = log_softmax ? at::log_softmax(scores_in, 1).masked_fill_(scores_in == -kInf, -kInf)
                                    : scores_in.contiguous();
  const Tensor beam_scores = beam_scores_in ? beam_scores_in->contiguous() : Tensor();
  const int64_t rows = scores.size(0), vocab = scores.size(1), batch = rows / beams;
  const auto options = scores.options();
  Tensor values = at::empty({batch, k}, options);
  Tensor indices = at::empty({batch, k}, options.dtype(at::kLong));
  Tensor survivors = at::empty({batch}, options.dtype(at::kLong));
  if (batch == 0) return {values, indices, survivors};

  Tensor thresholds = at::empty({rows}, options);
  // errors: bad scores row, bad beam_scores row (INT_MAX: none), queue overflow flag.
  Tensor flags = at::tensor({INT_MAX, INT_MAX, 0}, options.dtype(at::kInt));
  const float* beam_p = beam_scores.defined() ? beam_scores.data_ptr<float>() : nullptr;
  row_thresholds_kernel<<<rows, kRowThreads, 0, stream>>>(scores.data_ptr<float>(), beam_p, vocab, k,
                                                           thresholds.data_ptr<float>(), flags.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  select_kernel<<<batch, kSelectThreads, 0, stream>>>(scores.data_ptr<float>(), beam_p, thresholds.data_ptr<float>(),
                                                      beams, vocab, k, values.data_ptr<float>(),
                                                      indices.data_ptr<int64_t>(), survivors.data_ptr<int64_t>(),
                                                      flags.data_ptr<int>() + 2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // One small copy back (a stream sync, as the reference's NaN check is): errors are raised as on the CPU.
  const Tensor host_flags = flags.cpu();
  const int* f = host_flags.data_ptr<int>();
  TORCH_CHECK(f[0] == INT_MAX, kOp, ": 'scores' row ", f[0], " contains NaN or +inf; mask tokens with -inf instead");
  TORCH_CHECK(f[1] == INT_MAX, kOp, ": 'beam_scores' row ", f[1],
              " is NaN or +inf; finished beams take -inf or a large negative score");
  // torch.topk's order among ties is its own (not index order): without `stable`, torch.topk on the
  // candidates picks and orders them (the select kernel above still counts survivors).
  if (f[2] || !stable) {
    Tensor all = at::empty({batch, beams * vocab}, options);
    candidates_kernel<<<rows, kRowThreads, 0, stream>>>(scores.data_ptr<float>(), beam_p, vocab, all.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (stable) {
      auto [sorted_values, sorted_indices] = at::sort(all, /*stable=*/true, /*dim=*/1, /*descending=*/true);
      values.copy_(sorted_values.narrow(1, 0, k));
      indices.copy_(sorted_indices.narrow(1, 0, k));
    } else {
      auto [top_values, top_indices] = at::topk(all, k, /*dim=*/1);
      values.copy_(top_values);
      indices.copy_(top_indices);
    }
  }
  return {values, indices, survivors};
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CUDA, m) {
  m.impl("beam_topk", &lightgen::beam_topk);
}
