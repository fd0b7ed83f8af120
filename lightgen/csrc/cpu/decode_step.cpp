// The layers of a decoder step in one call, for pre-RMSNorm blocks with rotary, grouped-query self-attention over
// the static KV cache and a gated FFN (Llama, Mistral, Qwen2, Qwen3). It calls the kernels the Python step
// (lightgen/modules/decoder.py, the specification) dispatches one by one, on the same inputs in the same order,
// so its result is bit-identical; what it saves is ~15 Python op calls per layer (lightgen/modules/native_step.py).
// CPU only: the CUDA library does not define it, and its schema is not one of the ops in lightgen_ops.cpp
// (it has no reference of its own: without this library the Python step runs).
#include <torch/library.h>
#include <algorithm>
#include <vector>
#include "../include/checks.h"
#include "../include/cpu_ops.h"

namespace lightgen {
namespace {

using at::Tensor;

constexpr const char* kOp = "lightgen.decode_layers";
constexpr int64_t kLinears = 7;  // q, k, v, out, gate, up, down
// Per layer: the norms before attention and before the FFN, on q and on k (undefined: none), then each linear's
// weight, scale and offset (group-wise quantized only) and bias.
constexpr int64_t kNorms = 4;
constexpr int64_t kTensorsPerLayer = kNorms + 4 * kLinears;
constexpr int64_t kIntsPerLayer = 1 + 2 * kLinears;  // the sliding window, then each linear's out_features, group_size

struct Linear {
  c10::optional<Tensor> weight, scale, offset, bias;
  int64_t out_features = 0, group_size = 0;

  // LinearWeights.run of lightgen/modules/linear.py.
  Tensor operator()(const Tensor& x) const {
    if (group_size > 0) return linear_grouped(x, *weight, *scale, offset, bias, "none", out_features, group_size);
    return linear(x, *weight, c10::nullopt, bias, "none", out_features);
  }

  bool in_panels() const { return weight->dim() == 3; }
};

// Layers of one input, e.g. q, k and v: in one parallel loop where every weight is in panels (the same outputs).
std::vector<Tensor> run_all(const std::vector<Linear>& layers, const Tensor& x) {
  if (!std::all_of(layers.begin(), layers.end(), [](const Linear& l) { return l.in_panels(); })) {
    std::vector<Tensor> outputs;
    for (const Linear& l : layers) outputs.push_back(l(x));
    return outputs;
  }
  std::vector<PanelLinear> panels;
  for (const Linear& l : layers) panels.push_back({*l.weight, l.scale, l.offset, l.bias, l.out_features, l.group_size});
  return linear_panels(x, panels);
}

// The product rounded to float on its own: HF multiplies and adds in separate ops, and GCC would otherwise
// contract a * b + c * d into a fused multiply-add (it does by default in C++), which rounds once.
inline float product(float a, float b) {
  float p = a * b;
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(p));
#else
  volatile float kept = p;
  p = kept;
#endif
  return p;
}

// HF's apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
// x: float32 [N, H, T, D] (last dimension contiguous); cos, sin: float32 [N, T, D]. Returns contiguous [N, H, T, D].
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t N = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  Tensor out = at::empty({N, H, T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* xr = xp + n * x.stride(0) + h * x.stride(1) + t * x.stride(2);
        const float* c = cp + (n * T + t) * D;
        const float* s = sp + (n * T + t) * D;
        float* o = op + ((n * H + h) * T + t) * D;
        for (int64_t d = 0; d < half; ++d) o[d] = product(xr[d], c[d]) + product(-xr[d + half], s[d]);
        for (int64_t d = half; d < D; ++d) o[d] = product(xr[d], c[d]) + product(xr[d - half], s[d]);
      }
  return out;
}

// hidden: float32 [N, T, E], the step's embedded tokens. weights: kTensorsPerLayer per layer; layer_ints:
// kIntsPerLayer per layer. k_caches, v_caches: per layer [R, Hkv, Tmax, D] (R >= rows; rows 0..rows-1 decode),
// written in place at lengths[n] + t; lengths: int64 [N]; mask: bool [N, Tmax] (true = attend) or None;
// cos, sin: [N, T, D] (HF's rotary module's) or None (no rotary). Returns the hidden states after the last layer.
Tensor decode_layers(const Tensor& hidden_in, const c10::List<c10::optional<Tensor>>& weight_list,
                     at::IntArrayRef layer_ints, at::TensorList k_caches, at::TensorList v_caches, int64_t rows,
                     const Tensor& lengths, const c10::optional<Tensor>& mask, const c10::optional<Tensor>& cos_in,
                     const c10::optional<Tensor>& sin_in, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     double eps, double qk_eps, double scale, double softcap, c10::string_view act) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  LG_CHECK_CPU(kOp, hidden_in);
  TORCH_CHECK(hidden_in.scalar_type() == at::kFloat && hidden_in.dim() == 3, kOp,
              ": 'hidden' must be float32 [N, T, E], got ", hidden_in.scalar_type(), " ", hidden_in.sizes());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers, kOp,
              ": 'k_caches' and 'v_caches' must hold one cache per layer, got ", layers, " and ", v_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weight_list.size()) == layers * kTensorsPerLayer, kOp, ": 'weights' must hold ",
              kTensorsPerLayer, " tensors per layer (", layers * kTensorsPerLayer, "), got ", weight_list.size());
  TORCH_CHECK(static_cast<int64_t>(layer_ints.size()) == layers * kIntsPerLayer, kOp, ": 'layer_ints' must hold ",
              kIntsPerLayer, " values per layer (", layers * kIntsPerLayer, "), got ", layer_ints.size());
  TORCH_CHECK(cos_in.has_value() == sin_in.has_value(), kOp, ": 'cos' and 'sin' must be given together");
  const int64_t N = hidden_in.size(0), T = hidden_in.size(1);
  TORCH_CHECK(rows == N, kOp, ": the caches decode ", rows, " rows but 'hidden' has ", N);
  const std::vector<c10::optional<Tensor>> weights = weight_list.vec();
  Tensor cos, sin;
  if (cos_in) {
    for (const Tensor* t : {&*cos_in, &*sin_in})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(1) == T &&
                      t->size(2) == head_dim && (t->size(0) == N || t->size(0) == 1),
                  kOp, ": 'cos' and 'sin' must be float32 CPU [N, T, D] = [", N, ", ", T, ", ", head_dim, "], got ",
                  t->scalar_type(), " ", t->sizes());
    cos = cos_in->expand({N, T, head_dim}).contiguous();
    sin = sin_in->expand({N, T, head_dim}).contiguous();
  }
  auto tensor = [&](int64_t layer, int64_t slot) -> const c10::optional<Tensor>& {
    return weights[layer * kTensorsPerLayer + slot];
  };
  auto norm = [&](int64_t layer, int64_t slot) -> const Tensor& {
    const c10::optional<Tensor>& t = tensor(layer, slot);
    TORCH_CHECK(t.has_value(), kOp, ": layer ", layer, " has no norm weight in slot ", slot);
    return *t;
  };
  auto projection = [&](int64_t layer, int64_t index) {
    const int64_t slot = kNorms + 4 * index, ints = layer * kIntsPerLayer + 1 + 2 * index;
    Linear l{tensor(layer, slot), tensor(layer, slot + 1), tensor(layer, slot + 2), tensor(layer, slot + 3),
             layer_ints[ints], layer_ints[ints + 1]};
    TORCH_CHECK(l.weight.has_value() && (l.group_size == 0 || l.scale.has_value()), kOp, ": layer ", layer,
                " linear ", index, " needs its weight (and, group-wise quantized, its scale)");
    return l;
  };

  // Decoder.step's layer loop with run_block's pre-norm residuals: the FFN's residual add is fused with the next
  // layer's first norm (fp32: the same sum as the unfused add, rounded once either way).
  Tensor residual = hidden_in, hidden;
  Tensor normed = rms_norm(hidden_in, norm(0, 0), eps);
  for (int64_t layer = 0; layer < layers; ++layer) {
    // AttentionWeights.project: [N, T, H * D] -> [N, H, T, D] views.
    const std::vector<Tensor> qkv = run_all({projection(layer, 0), projection(layer, 1), projection(layer, 2)}, normed);
    Tensor q = qkv[0].view({N, T, heads, head_dim}).transpose(1, 2);
    Tensor k = qkv[1].view({N, T, kv_heads, head_dim}).transpose(1, 2);
    Tensor v = qkv[2].view({N, T, kv_heads, head_dim}).transpose(1, 2);
    if (tensor(layer, 2).has_value()) {
      q = rms_norm(q, *tensor(layer, 2), qk_eps);
      k = rms_norm(k, norm(layer, 3), qk_eps);
    }
    if (cos.defined()) {
      q = rotate(q, cos, sin);
      k = rotate(k, cos, sin);
    }
    Tensor k_cache = k_caches[layer].narrow(0, 0, rows), v_cache = v_caches[layer].narrow(0, 0, rows);
    Tensor out = attention(q, k_cache, v_cache, k, v, lengths, mask, scale, true, layer_ints[layer * kIntsPerLayer],
                           softcap);
    Tensor attended = projection(layer, 3)(out.view({N, T, heads * head_dim}));
    std::tie(residual, normed) = add_rms_norm(attended, residual, norm(layer, 1), eps);
    // feed_forward, gated: act(gate(x)) * up(x), then down.
    const std::vector<Tensor> gate_up = run_all({projection(layer, 4), projection(layer, 5)}, normed);
    Tensor ffn = projection(layer, 6)(gated_act(gate_up[0], gate_up[1], act));
    if (layer + 1 < layers) {
      std::tie(residual, normed) = add_rms_norm(ffn, residual, norm(layer + 1, 0), eps);
    } else {
      hidden = ffn + residual;
    }
  }
  return hidden;
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_FRAGMENT(lightgen, m) {
  m.def("decode_layers(Tensor hidden, Tensor?[] weights, int[] layer_ints, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, int rows, Tensor lengths, Tensor? mask, Tensor? cos, Tensor? sin, int heads, "
        "int kv_heads, int head_dim, float eps, float qk_eps, float scale, float softcap, str act) -> Tensor");
}

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("decode_layers", &lightgen::decode_layers);
}
