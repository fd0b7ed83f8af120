// What both attention kernels (CPU, CUDA) share: the shape checks of q and the caches, and the mask
// read through a broadcast [B, Hq, Tq, Tk] view of a bool (true = attend) or additive float mask.
#pragma once
#include <ATen/ATen.h>

namespace lightgen {

struct AttentionShape {
  int64_t B, Hq, Tq, D, Hkv, Tmax;
};

// q [B, Hq, Tq, D] against caches [B, Hkv, Tmax, D] (grouped-query: Hq a multiple of Hkv).
inline AttentionShape check_attention_shapes(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                             const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 4, op, ": 'q' must be [B, Hq, Tq, D], got ", q.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(3) == D, op,
              ": 'k_cache' must be [B, Hkv, Tmax, D] with B = ", B, " and D = ", D, ", got ", k_cache.sizes());
  const int64_t Hkv = k_cache.size(1), Tmax = k_cache.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, op, ": query heads (", Hq, ") must be a multiple of key/value heads (", Hkv,
              ")");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": 'v_cache' must have the shape of 'k_cache' ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  return {B, Hq, Tq, D, Hkv, Tmax};
}

struct MaskView {
  const bool* keep = nullptr;      // bool mask: true = attend
  const float* add = nullptr;      // additive float mask
  int64_t sb = 0, sh = 0, sq = 0;  // strides of the broadcast view; the last stride is 1
};

// Checks ``mask`` against the shapes and fills ``view``; returns the tensor owning the data, which
// the caller keeps alive while the kernel runs. Device checks are the caller's.
inline at::Tensor broadcast_mask(const char* op, const at::Tensor& mask, int64_t B, int64_t Hq, int64_t Tq,
                                 int64_t Tk, MaskView& view) {
  TORCH_CHECK(mask.dim() == 2 || mask.dim() == 4, op, ": 'mask' must be [B, Tk] or broadcastable to [B, Hq, Tq, Tk]",
              " = [", B, ", ", Hq, ", ", Tq, ", ", Tk, "], got ", mask.sizes());
  TORCH_CHECK(mask.size(-1) == Tk, op, ": 'mask' must cover all ", Tk, " cached keys, got last dimension ",
              mask.size(-1));
  at::Tensor m = mask.dim() == 2 ? mask.view({mask.size(0), 1, 1, Tk}) : mask;
  m = m.scalar_type() == at::kBool ? m : m.to(at::kFloat);
  TORCH_CHECK(m.stride(-1) == 1 || Tk == 1, op, ": the last dimension of 'mask' must be contiguous");
  at::Tensor e;
  try {
    e = m.expand({B, Hq, Tq, Tk});
  } catch (const c10::Error&) {
    TORCH_CHECK(false, op, ": 'mask' of shape ", mask.sizes(), " does not broadcast to [B, Hq, Tq, Tk] = [", B,
                ", ", Hq, ", ", Tq, ", ", Tk, "]");
  }
  view.sb = e.stride(0);
  view.sh = e.stride(1);
  view.sq = e.stride(2);
  if (e.scalar_type() == at::kBool)
    view.keep = e.data_ptr<bool>();
  else
    view.add = e.data_ptr<float>();
  return m;
}

}  // namespace lightgen
