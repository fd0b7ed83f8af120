// Attention over a preallocated KV cache: the step's new K/V are written in place at each row's
// cache position, then scale + mask + softmax + weighted sum run per (batch, head, query).
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include "../include/attention_mask.h"
#include "../include/checks.h"
#include "../include/cpu_ops.h"
#include "../include/vec_math.h"

namespace lightgen {
namespace {

using at::Tensor;

constexpr const char* kOp = "lightgen.attention";

float mask_bias(const MaskView& mask, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t off = b * mask.sb + h * mask.sh + i * mask.sq + j;
  if (mask.keep) return mask.keep[off] ? 0.f : -std::numeric_limits<float>::infinity();
  return mask.add ? mask.add[off] : 0.f;
}

template <typename scalar_t>
void write_new_kv(const Tensor& src, Tensor& cache, const std::vector<int64_t>& pos) {
  const int64_t B = src.size(0), H = src.size(1), T = src.size(2), D = src.size(3);
  const scalar_t* src_base = src.data_ptr<scalar_t>();
  scalar_t* cache_base = cache.data_ptr<scalar_t>();
  // Tasks of row_grain's size: a decode step's few rows x heads of one position each (SmolLM2 at batch 1: 3 x 64
  // values) copy in less time than a fork/join takes (~2-3 us, 2 threads).
  at::parallel_for(0, B * H, row_grain(T * D), [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      for (int64_t t = 0; t < T; ++t) {
        const scalar_t* s = src_base + b * src.stride(0) + h * src.stride(1) + t * src.stride(2);
        scalar_t* d = cache_base + b * cache.stride(0) + h * cache.stride(1) + (pos[b] + t) * cache.stride(2);
        std::copy(s, s + D, d);
      }
    }
  });
}

// exp(x[j] - shift) in place over a row, vectorised (ATen's Sleef exp, 1 ulp), and their float sum.
inline float exp_shifted(float* x, int64_t n, float shift) {
  const fVec by(shift);
  fVec total(0.f);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) {
    const fVec e = (fVec::loadu(x + j) - by).exp();
    e.store(x + j);
    total = total + e;
  }
  if (j < n) {
    const fVec e = (fVec::loadu(x + j, n - j) - by).exp();
    e.store(x + j, n - j);
    total = total + fVec::set(fVec(0.f), e, n - j);
  }
  return lane_sum(total);
}

// acc[0..kValueBlock) += sum_j p[j] v_j over the rows' block of kValueBlock values, the sums held in registers:
// accumulating in memory made every key wait for the previous one's store (36% of a 400-key attend in `perf`).
constexpr int64_t kValueVecs = 4, kValueBlock = kValueVecs * fVec::size();
template <typename scalar_t>
inline void weigh_values(const float* p, int64_t first, int64_t last, const scalar_t* v, int64_t stride, float* acc,
                         std::vector<float>& buf) {
  fVec sums[kValueVecs];
  for (int64_t c = 0; c < kValueVecs; ++c) sums[c] = fVec::loadu(acc + c * fVec::size());
  for (int64_t j = first; j <= last; ++j) {
    if (p[j] == 0.f) continue;
    const float* row = as_float(v + j * stride, kValueBlock, buf);
    const fVec weight(p[j]);
    for (int64_t c = 0; c < kValueVecs; ++c)
      sums[c] = at::vec::fmadd(weight, fVec::loadu(row + c * fVec::size()), sums[c]);
  }
  for (int64_t c = 0; c < kValueVecs; ++c) sums[c].store(acc + c * fVec::size());
}

// acc[0..D) += sum over keys first..last of p[j] v_j.
template <typename scalar_t>
void weigh_all_values(const float* p, int64_t first, int64_t last, const scalar_t* vb, int64_t stride, int64_t D,
                      float* acc, std::vector<float>& buf) {
  for (int64_t d0 = 0; d0 < D; d0 += kValueBlock) {
    const int64_t width = std::min(kValueBlock, D - d0);
    if (width == kValueBlock) {
      weigh_values(p, first, last, vb + d0, stride, acc + d0, buf);
    } else {
      for (int64_t j = first; j <= last; ++j) {
        if (p[j] != 0.f) row_axpy(p[j], as_float(vb + j * stride + d0, width, buf), acc + d0, width);
      }
    }
  }
}

// x rounded to the dtype, as a tensor of it stores it.
template <typename scalar_t>
inline float rounded(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

// fp16 / bf16 weights at the rounding points of PyTorch's CPU flash attention, for softcapped scores, which torch's
// sdpa cannot take (attend_with_torch runs every other fp16 / bf16 call but GPT-2's upcast eager one): per block of
// 512 keys from key 0 (the last one ends at the row's key count, ``len``), exponentiated against the running maximum
// (the sum so far rescaled when it grows) with its exp (ATen's fast fexp_u20 on whole vectors from the block's
// start, std::exp on the rest), rounded to the input dtype before they weigh the values; the sum of the unrounded
// ones divides at the end. Key 0 is the first key HF hands attention, ``origin`` here, and the last block ends at
// the last key HF hands, ``end``. ``scores`` holds the row's scores over keys first..last and room up to ``end``.
// Returns the sum; ``acc`` the weighted values.
constexpr int64_t kFlashKeyBlock = 512;
template <typename scalar_t>
float weigh_rounded(float* scores, int64_t origin, int64_t first, int64_t last, int64_t len_end, const scalar_t* vb,
                    int64_t stride, int64_t D, float* acc, std::vector<float>& buf) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  float running = kNone, denom = 0.f;
  for (int64_t start = origin + (first - origin) / kFlashKeyBlock * kFlashKeyBlock; start <= last;
       start += kFlashKeyBlock) {
    const int64_t lo = std::max(first, start), hi = std::min(last, start + kFlashKeyBlock - 1);
    const int64_t end = std::min(len_end, start + kFlashKeyBlock);
    float top = running;
    for (int64_t j = lo; j <= hi; ++j) top = std::max(top, scores[j]);
    if (top == kNone) continue;  // every key so far masked
    std::fill(scores + start, scores + lo, kNone);
    std::fill(scores + hi + 1, scores + end, kNone);
    const fVec shift(top);
    fVec lanes(0.f);
    int64_t j = start;
    for (; j + fVec::size() <= end; j += fVec::size()) {
      const fVec e = (fVec::loadu(scores + j) - shift).fexp_u20();
      e.store(scores + j);
      lanes = lanes + e;
    }
    float block_sum = lane_sum(lanes);
    for (; j < end; ++j) {
      scores[j] = std::exp(scores[j] - top);
      block_sum += scores[j];
    }
    const float rescale = std::exp(running - top);
    denom = block_sum + rescale * denom;
    if (running != kNone) {
      for (int64_t d = 0; d < D; ++d) acc[d] *= rescale;
    }
    for (int64_t k = lo; k <= hi; ++k) scores[k] = rounded<scalar_t>(scores[k]);
    weigh_all_values(scores, lo, hi, vb, stride, D, acc, buf);
    running = top;
  }
  return denom;
}

// GPT-2's reorder_and_upcast_attn eager attention in fp16 / bf16 (its scores float32): a float softmax normalised by
// 1/sum and rounded to the dtype, then a float matmul with the values. ``scores`` holds the row's scores over keys
// first..last.
template <typename scalar_t>
void weigh_eager(float* scores, int64_t first, int64_t last, float top, const scalar_t* vb, int64_t stride,
                 int64_t D, float* acc, std::vector<float>& buf) {
  const float inv = 1.f / exp_shifted(scores + first, last - first + 1, top);
  for (int64_t j = first; j <= last; ++j) scores[j] = rounded<scalar_t>(scores[j] * inv);
  weigh_all_values(scores, first, last, vb, stride, D, acc, buf);
}

// Tasks of at least this many key values (keys x head_dim) a chunk. A decode step finds its K/V cold (a step's weights
// went through the caches since), so even a short cache is worth two threads' memory streams: SmolLM2's int8 step,
// 33 keys, ~11.7 / 12.7 us a layer's attention at 8192 / 65536 (two threads / one).
constexpr int64_t kAttendGrain = 8192;

template <typename scalar_t>
void attend(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int64_t>& key_len,
            const MaskView& mask, float scale, bool causal, int64_t window, float softcap, bool stepwise,
            bool upcast_eager, Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t group = Hq / k.size(1);
  const int64_t Tk = k.size(2);
  // The keys a task reads, not the cache's capacity: a decode step over a long static cache reads few of them.
  const int64_t longest =
      key_len.empty() ? 1 : std::max<int64_t>(1, *std::max_element(key_len.begin(), key_len.end()));
  const int64_t grain = std::max<int64_t>(1, kAttendGrain / (std::min(longest, Tk) * D));
  // Base pointers and strides once, not per (batch, head, query) task.
  const scalar_t* q_base = q.data_ptr<scalar_t>();
  const scalar_t* k_base = k.data_ptr<scalar_t>();
  const scalar_t* v_base = v.data_ptr<scalar_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  at::parallel_for(0, B * Hq * Tq, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(Tk), acc(D), qbuf, kbuf, vbuf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task % Tq, h = (task / Tq) % Hq, b = task / (Tq * Hq);
      const int64_t hk = h / group;
      const int64_t len = key_len[b];
      const int64_t slot = len - Tq + i;  // the query's own cache position (bottom-right aligned)
      const int64_t last = causal ? slot : len - 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, slot - window + 1) : 0;  // sliding window
      const float* qf = as_float(q_base + b * qs0 + h * qs1 + i * qs2, D, qbuf);
      const scalar_t* kb = k_base + b * ks0 + hk * ks1;
      const scalar_t* vb = v_base + b * vs0 + hk * vs1;
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t j = first; j <= last; ++j) {
        float s = row_dot(qf, as_float(kb + j * ks2, D, kbuf), D) * scale;
        if (softcap > 0.f) s = std::tanh(s / softcap) * softcap;  // Gemma 2: before the mask
        s += mask_bias(mask, b, h, i, j);
        scores[j] = s;
        max_score = std::max(max_score, s);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      if (max_score != -std::numeric_limits<float>::infinity()) {  // a fully masked query yields zeros
        if (upcast_eager) {
          weigh_eager(scores.data(), first, last, max_score, vb, vs2, D, acc.data(), vbuf);  // normalised weights
        } else {
          float denom;
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
            // The keys HF hands attention: a prefill's (every query: the cached and new ones), or with ``stepwise``
            // each query's own one-token step's (the keys up to its own).
            const int64_t past = stepwise ? slot : len - Tq, end = stepwise ? slot + 1 : len;
            const int64_t origin = window > 0 ? std::max<int64_t>(0, past - (window - 1)) : 0;
            denom = weigh_rounded(scores.data(), origin, first, last, end, vb, vs2, D, acc.data(), vbuf);
          } else {
            denom = exp_shifted(scores.data() + first, last - first + 1, max_score);
            weigh_all_values(scores.data(), first, last, vb, vs2, D, acc.data(), vbuf);
          }
          const float inv = 1.f / denom;
          for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
        }
      }
      store_row(acc.data(), out_base + ((b * Tq + i) * Hq + h) * D, D);
    }
  });
}

// The keys HF's cache hands one attention call, [origin, end), and the queries' own positions from ``past``.
struct KeySpan {
  int64_t past, end, origin;
  bool operator==(const KeySpan& other) const {
    return past == other.past && end == other.end && origin == other.origin;
  }
};

// A prefill's span (every query over the cached and new keys), or with ``stepwise`` query i's own one-token step's;
// a sliding-window layer's cache (DynamicSlidingWindowLayer) hands its last window - 1 cached keys and the new ones.
KeySpan span_of(int64_t len, int64_t Tq, int64_t window, bool stepwise, int64_t i) {
  const int64_t past = stepwise ? len - Tq + i : len - Tq, end = stepwise ? past + 1 : len;
  return {past, end, window > 0 ? std::max<int64_t>(0, past - (window - 1)) : 0};
}

// The lowest value of q's dtype, which HF's additive masks put on hidden keys.
double lowest(const Tensor& q) {
  return q.scalar_type() == at::kHalf ? std::numeric_limits<c10::Half>::lowest()
                                      : std::numeric_limits<c10::BFloat16>::lowest();
}

// K/V heads repeated for ``group`` query heads each as HF's repeat_kv does: expanded and reshaped, a view where it
// can be (one K/V head), which torch's matmul then runs otherwise than a copy (fp16 values an ulp apart).
Tensor repeat_kv(const Tensor& t, int64_t group) {
  if (group == 1) return t;
  const int64_t B = t.size(0), H = t.size(1), S = t.size(2), D = t.size(3);
  return t.unsqueeze(2).expand({B, H, group, S, D}).reshape({B, H * group, S, D});
}

// HF's eager attention in the dtype, op for op (eager_attention_forward; Gemma 2's with its softcap): the scores'
// matmul over K/V heads repeated per query head (repeat_kv), scaled, capped, masked (``mask``: bool, hidden keys
// at the dtype's lowest value as HF's additive mask holds them, or additive), a float32 softmax rounded to the
// dtype (``softmax_in_dtype``: torch's softmax in the dtype, as the BART family's, GPT-2's and T5's eager functions
// take it; the two differ at ~5e-5 of fp16 values), the values' matmul. A query that sees no key yields zeros here,
// as the kernel's (the engine spreads it).
Tensor eager_attention(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& mask,
                       double scale, double softcap, bool softmax_in_dtype) {
  const Tensor keys = repeat_kv(k, q.size(1) / k.size(1));
  const Tensor values = repeat_kv(v, q.size(1) / k.size(1));
  Tensor scores = at::matmul(q, keys.transpose(2, 3)) * scale;
  if (softcap > 0) scores = (scores / softcap).tanh() * softcap;
  Tensor sees;
  if (mask && mask->scalar_type() == at::kBool) {
    scores = scores + at::zeros_like(*mask, q.options()).masked_fill(mask->logical_not(), lowest(q));
    sees = mask->any(-1, true);
  } else if (mask) {
    scores = scores + *mask;
  }
  const Tensor weights = softmax_in_dtype ? at::softmax(scores, -1) : at::softmax(scores, -1, at::kFloat);
  Tensor out = at::matmul(weights.to(q.scalar_type()), values);
  return sees.defined() ? out.masked_fill(sees.logical_not(), 0) : out;
}

// fp16 / bf16 through torch's own ops, as HF's attention runs them: sdpa (its flash kernel takes the q.k and
// weights.values products from the CPU BLAS, whose summation order is the machine's: oneDNN's vdpbf16ps pairs, AMX
// tiles, ATen's fp16 gemv), or with ``eager`` HF's eager function (eager_attention: matmuls in that BLAS too). No
// kernel of ours sums as that BLAS does everywhere (ours, at their rounding points but not in that order, differed
// at up to 1.2e-3 of bf16 and 2.3% of fp16 values through sdpa, 0.37% / 0.57% eager). Each call sees the keys HF's
// cache would hand that step, and a mask only where a key in them is hidden (HF's causal, window and padding), or
// always an additive one (T5's position bias, hidden keys at the dtype's lowest) where ``mask`` adds. Rows (and,
// stepwise, queries) whose spans agree share a call; q's rows are [B, Hq, Tq, D], ``mask`` [B, Hq, Tq, Tmax] (bool
// or float, broadcast; undefined: none), out [B, Tq, Hq, D].
void attend_with_torch(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int64_t>& key_len,
                       const Tensor& mask_in, double scale, bool causal, int64_t window, bool stepwise, bool eager,
                       bool softmax_in_dtype, bool pack_gqa, int64_t static_slots, double softcap, Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2);
  const bool gqa = Hq != k.size(1);
  // One query at a time when stepwise (each its own step), else all of a row's queries at once.
  const int64_t query_groups = stepwise ? Tq : 1, per_call = stepwise ? 1 : Tq;
  for (int64_t group = 0; group < query_groups; ++group) {
    const int64_t first_query = group * per_call;
    std::vector<KeySpan> spans;
    for (int64_t b = 0; b < B; ++b) spans.push_back(span_of(key_len[b], Tq, window, stepwise, first_query));
    const bool shared = std::all_of(spans.begin(), spans.end(), [&](const KeySpan& s) { return s == spans[0]; });
    for (int64_t b0 = 0; b0 < B; b0 += shared ? B : 1) {
      const int64_t rows = shared ? B : 1;
      const KeySpan span = spans[b0];
      // HF's static cache layer hands every one of its ``static_slots`` (the unwritten ones zeros, masked) until a
      // sliding one is full, but sdpa's first prompt pass without padding takes the prompt's keys (is_causal).
      const bool static_span = static_slots > 0 && span.end <= static_slots;
      const bool unpadded_prompt = static_span && window == 0 && !eager && per_call > 1 && span.past == 0 &&
                                   (!mask_in.defined() || mask_in.narrow(3, 0, span.end).all().item<bool>());
      const int64_t end = static_span && !unpadded_prompt ? static_slots : span.end;
      const int64_t width = end - span.origin, written = span.end - span.origin;
      Tensor queries = q.narrow(0, b0, rows).narrow(2, first_query, per_call);
      Tensor keys = k.narrow(0, b0, rows).narrow(2, span.origin, written);
      Tensor values = v.narrow(0, b0, rows).narrow(2, span.origin, written);
      if (end > span.end) {
        const Tensor empty = at::zeros({rows, k.size(1), end - span.end, k.size(3)}, k.options());
        keys = at::cat({keys, empty}, 2);
        values = at::cat({values, empty}, 2);
      }
      // One query sees every key of its own span (causal up to itself, the window from its first); several, or
      // empty slots, need a causal (and window) mask.
      Tensor visible;
      if (per_call > 1 || end > span.end) {
        const Tensor positions = at::arange(span.origin, end, q.options().dtype(at::kLong));
        const Tensor slots = at::arange(span.past, span.past + per_call, positions.options()).unsqueeze(1);
        visible = causal ? positions.le(slots) : at::ones({per_call, width}, positions.options().dtype(at::kBool));
        if (window > 0) visible = visible.logical_and(positions.gt(slots - window));
      }
      Tensor given;
      if (mask_in.defined()) {
        const int64_t held = std::min(end, mask_in.size(3)) - span.origin;  // past the mask: empty slots, hidden
        given = mask_in.narrow(0, b0, rows).narrow(2, first_query, per_call).narrow(3, span.origin, held);
        if (held < width) {
          given = at::cat({given, at::zeros({rows, given.size(1), per_call, width - held}, given.options())}, 3);
        }
      }
      c10::optional<Tensor> mask;
      if (given.defined() && given.scalar_type() != at::kBool) {
        const Tensor bias = visible.defined() ? given.masked_fill(visible.logical_not(), lowest(q)) : given;
        mask = bias.to(q.scalar_type());
      } else {
        if (given.defined()) visible = visible.defined() ? given.logical_and(visible) : given;
        if (visible.defined() && !visible.all().item<bool>()) {
          mask = visible.dim() == 2 ? visible.view({1, 1, per_call, width}) : visible;
        }
      }
      // HF hands sdpa a mask where the prompt was padded (``mask_in``), the window is full or static slots are
      // unwritten, and from transformers 5.23 on (``pack_gqa``) a single query's grouped heads then go in as queries
      // of their K/V head: other query blocks, other roundings (~5-25% of fp16 calls differ by an ulp).
      const bool packed = pack_gqa && gqa && per_call == 1 &&
                          (mask_in.defined() || (window > 0 && width >= window) || end > span.end);
      Tensor result;
      if (eager) {
        result = eager_attention(queries, keys, values, mask, scale, softcap, softmax_in_dtype);
      } else if (packed) {
        const int64_t kv_heads = k.size(1), group_size = Hq / kv_heads, D = q.size(3);
        if (mask && mask->size(1) != 1) mask = mask->reshape({rows, kv_heads, group_size, width});
        result = at::scaled_dot_product_attention(queries.reshape({rows, kv_heads, group_size, D}), keys, values,
                                                  mask, 0.0, false, scale)
                     .reshape({rows, Hq, 1, D});
      } else {
        result = at::scaled_dot_product_attention(queries, keys, values, mask, 0.0, false, scale, gqa);
      }
      out.narrow(0, b0, rows).narrow(1, first_query, per_call).copy_(result.transpose(1, 2));
    }
  }
}

}  // namespace

// Entry points (cpu_ops.h): the native decode step calls them directly, without the dispatcher.
// q: [B, Hq, Tq, D]; k_cache, v_cache: [B, Hkv, Tmax, D] (mutated when k_new is given);
// k_new, v_new: [B, Hkv, Tq, D], written at cache_pos[b] + t; cache_pos: int64 [B] (default 0);
// mask: bool (true = attend) or additive, [B, Tk] or broadcastable to [B, Hq, Tq, Tk] with Tk = Tmax.
// Row b attends to keys [0, cache_pos[b] + Tq) with new K/V, else to all Tmax keys. Returns [B, Tq, Hq, D].
// window > 0: query i (at cache position len - Tq + i) sees only keys j > len - Tq + i - window (HF's sliding
// window); softcap > 0: scores become tanh(s / softcap) * softcap before the mask is added. ``stepwise`` (causal
// fp16 / bf16 only): each query rounds as HF's one-token step for it would (a verification pass of drafts),
// not as one prefill. ``eager`` (fp16 / bf16 only): HF's eager attention (its ops), not its sdpa; with ``upcast``
// the scores stay float32 (GPT-2's reorder_and_upcast_attn, on the kernel); ``softmax_in_dtype``: its softmax runs
// in the dtype, not in float32. ``pack_gqa`` (fp16 / bf16 sdpa): as transformers 5.23+'s sdpa_attention_forward,
// which hands a masked single query's grouped heads to sdpa as queries of their K/V head (pack_gqa).
// ``static_slots`` > 0 (fp16 / bf16): the slots of HF's static cache layer, every one of which its attention gets.
Tensor attention(const Tensor& q, Tensor& k_cache, Tensor& v_cache, const c10::optional<Tensor>& k_new,
                 const c10::optional<Tensor>& v_new, const c10::optional<Tensor>& cache_pos,
                 const c10::optional<Tensor>& mask, double scale, bool causal, int64_t window, double softcap,
                 bool stepwise, bool eager, bool upcast, bool softmax_in_dtype, bool pack_gqa,
                 int64_t static_slots) {
  LG_CHECK_CPU(kOp, q);
  LG_CHECK_CPU(kOp, k_cache);
  LG_CHECK_CPU(kOp, v_cache);
  LG_CHECK_FLOAT(kOp, q);
  LG_CHECK_SAME_DTYPE(kOp, q, k_cache);
  LG_CHECK_SAME_DTYPE(kOp, q, v_cache);
  const AttentionShape shape = check_attention_shapes(kOp, q, k_cache, v_cache);
  const int64_t B = shape.B, Hq = shape.Hq, Tq = shape.Tq, D = shape.D, Hkv = shape.Hkv, Tmax = shape.Tmax;
  LG_CHECK_LAST_CONTIGUOUS(kOp, q);
  LG_CHECK_LAST_CONTIGUOUS(kOp, k_cache);
  LG_CHECK_LAST_CONTIGUOUS(kOp, v_cache);
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), kOp, ": 'k_new' and 'v_new' must be given together");
  TORCH_CHECK(window >= 0 && softcap >= 0, kOp, ": 'window' and 'softcap' must be >= 0 (0: none), got ", window, ", ",
              softcap);

  std::vector<int64_t> pos(B, 0);
  if (cache_pos) {
    TORCH_CHECK(k_new.has_value(), kOp, ": 'cache_pos' only applies when new keys are written ('k_new')");
    TORCH_CHECK(cache_pos->scalar_type() == at::kLong && cache_pos->dim() == 1 && cache_pos->size(0) == B, kOp,
                ": 'cache_pos' must be int64 [B] = [", B, "], got ", cache_pos->scalar_type(), " ",
                cache_pos->sizes());
    Tensor p = cache_pos->to(at::kCPU).contiguous();
    std::copy(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + B, pos.begin());
  }
  std::vector<int64_t> key_len(B, Tmax);
  if (k_new) {
    for (const Tensor* t : {&*k_new, &*v_new}) {
      LG_CHECK_CPU(kOp, (*t));
      LG_CHECK_SAME_DTYPE(kOp, q, (*t));
      TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == Hkv && t->size(2) == Tq && t->size(3) == D, kOp,
                  ": new keys/values must be [B, Hkv, Tq, D] = [", B, ", ", Hkv, ", ", Tq, ", ", D, "], got ",
                  t->sizes());
    }
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(pos[b] >= 0 && pos[b] + Tq <= Tmax, kOp, ": row ", b, " writes positions [", pos[b], ", ",
                  pos[b] + Tq, ") but the cache holds ", Tmax, " (cache overflow)");
      key_len[b] = pos[b] + Tq;
    }
  } else {
    TORCH_CHECK(Tq <= Tmax || !causal, kOp, ": causal attention needs at least as many keys as queries");
  }

  MaskView view;
  Tensor mask_keepalive;
  if (mask) {
    TORCH_CHECK(mask->device().is_cpu(), kOp, ": 'mask' must be on the CPU, got ", mask->device());
    mask_keepalive = broadcast_mask(kOp, *mask, B, Hq, Tq, Tmax, view);
  }

  Tensor out = at::empty({B, Tq, Hq, D}, q.options());
  const bool half = q.scalar_type() != at::kFloat && q.scalar_type() != at::kDouble;
  // HF's sdpa attention in fp16 / bf16 (HF's sdpa refuses Gemma 2's softcap), or its eager one (but GPT-2's
  // reorder_and_upcast_attn, whose float32 scores the kernel forms), through torch's own ops.
  const bool as_torch = half && (eager ? !upcast : softcap == 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), kOp, [&] {
    if (k_new) {
      write_new_kv<scalar_t>(*k_new, k_cache, pos);
      write_new_kv<scalar_t>(*v_new, v_cache, pos);
    }
    if (!as_torch) {
      attend<scalar_t>(q, k_cache, v_cache, key_len, view, static_cast<float>(scale), causal, window,
                       static_cast<float>(softcap), stepwise && causal, half && eager && upcast, out);
    }
  });
  if (as_torch) {
    const Tensor expanded = mask_keepalive.defined() ? mask_keepalive.expand({B, Hq, Tq, Tmax}) : Tensor();
    attend_with_torch(q, k_cache, v_cache, key_len, expanded, scale, causal, window, stepwise && causal, eager,
                      softmax_in_dtype, pack_gqa, static_slots, softcap, out);
  }
  return out;
}

}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("attention", &lightgen::attention);
}
