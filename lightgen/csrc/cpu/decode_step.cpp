// The layers of a decoder step in one call: pre- or post-norm blocks (RMSNorm or LayerNorm), self-attention over the
// static KV cache (grouped-query, optionally rotary, with q/k norms), optionally cross-attention over the encoder's
// cached K/V, and a gated or plain FFN (Llama, Mistral, Qwen2, Qwen3, BART, mBART, Marian, M2M-100, OPT...). It calls
// the kernels the Python step (lightgen/modules/decoder.py, the specification) dispatches one by one, on the same
// inputs in the same order, so its result is bit-identical; what it saves is ~15-25 Python op calls per layer
// (lightgen/modules/native_step.py).
// CPU only: the CUDA library does not define it, and its schema is not one of the ops in lightgen_ops.cpp
// (it has no reference of its own: without this library the Python step runs).
#include <torch/custom_class.h>
#include <torch/library.h>
#include <algorithm>
#include <vector>
#include "../include/checks.h"
#include "../include/cpu_ops.h"

namespace lightgen {
namespace {

using at::Tensor;

constexpr const char* kOp = "lightgen.decode_layers";
// Per layer, the norms: before self-attention, before cross-attention, before the FFN (weight, bias: LayerNorm's
// bias, undefined for RMSNorm or none), on q and on k (weights; undefined: none).
enum NormSlot : int64_t { kSelfNorm = 0, kCrossNorm = 2, kFfnNorm = 4, kQNorm = 6, kKNorm = 7, kNorms = 8 };
// Then each linear's weight, scale and offset (group-wise quantized only), bias, and with int8 activations
// (quantize="int8-dynamic" / "int4-dynamic") its dot-product layout and group sums (int8 only); undefined weight: none.
enum LinearIndex : int64_t { kQ, kK, kV, kOut, kCrossQ, kCrossOut, kFfnIn, kFfnUp, kFfnOut, kLinears };
constexpr int64_t kTensorsPerLinear = 6;
constexpr int64_t kTensorsPerLayer = kNorms + kTensorsPerLinear * kLinears;
// The sliding window, then each linear's out_features, group_size and the rows from which its int8-activation kernel
// runs (LinearWeights.dot_min_rows of lightgen/modules/linear.py).
constexpr int64_t kIntsPerLinear = 3;
constexpr int64_t kIntsPerLayer = 1 + kIntsPerLinear * kLinears;

// The layers' tensors (kTensorsPerLayer a layer) and ints (kIntsPerLayer), made once per request from
// native_step.plan: a step hands the dispatcher this one object, not a list it converts every call (SmolLM2: 1860
// entries, 150 us a call on a loaded machine).
struct LayerWeights : torch::CustomClassHolder {
  LayerWeights(const c10::List<c10::optional<Tensor>>& tensor_list, std::vector<int64_t> layer_ints)
      : tensors(tensor_list.vec()), ints(std::move(layer_ints)) {
    const int64_t layers = static_cast<int64_t>(tensors.size()) / kTensorsPerLayer;
    TORCH_CHECK(layers > 0 && static_cast<int64_t>(tensors.size()) == layers * kTensorsPerLayer, kOp,
                ": 'weights' must hold ", kTensorsPerLayer, " tensors per layer, got ", tensors.size());
    TORCH_CHECK(static_cast<int64_t>(ints.size()) == layers * kIntsPerLayer, kOp, ": 'layer_ints' must hold ",
                kIntsPerLayer, " values per layer (", layers * kIntsPerLayer, "), got ", ints.size());
  }
  int64_t layers() const { return static_cast<int64_t>(tensors.size()) / kTensorsPerLayer; }

  std::vector<c10::optional<Tensor>> tensors;
  std::vector<int64_t> ints;
};

struct Linear {
  c10::optional<Tensor> weight, scale, offset, bias, dot, dot_sums;
  int64_t out_features = 0, group_size = 0, dot_min_rows = 0;

  // LinearWeights.run of lightgen/modules/linear.py.
  Tensor operator()(const Tensor& x, c10::string_view act = "none") const {
    if (dynamic(x))
      return linear_int8_dynamic(x, *dot, *scale, offset, dot_sums, bias, act, out_features, group_size);
    if (group_size > 0) return linear_grouped(x, *weight, *scale, offset, bias, act, out_features, group_size);
    return linear(x, *weight, c10::nullopt, bias, act, out_features);
  }

  bool dynamic(const Tensor& x) const { return dot.has_value() && x.numel() >= dot_min_rows * x.size(-1); }
  bool in_panels(const Tensor& x) const { return weight->dim() == 3 || dynamic(x); }
};

// Layers of one input, e.g. q, k and v: in one parallel loop where every weight is in panels (the same outputs).
std::vector<Tensor> run_all(const std::vector<Linear>& layers, const Tensor& x) {
  if (!std::all_of(layers.begin(), layers.end(), [&](const Linear& l) { return l.in_panels(x); })) {
    std::vector<Tensor> outputs;
    for (const Linear& l : layers) outputs.push_back(l(x));
    return outputs;
  }
  std::vector<PanelLinear> panels;
  for (const Linear& l : layers) {
    const bool dynamic = l.dynamic(x);
    panels.push_back({*l.weight, l.scale, l.offset, l.bias, dynamic ? l.dot : c10::nullopt,
                      dynamic ? l.dot_sums : c10::nullopt, l.out_features, l.group_size});
  }
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

// What every layer shares: shapes, epsilons, scales and the block's form.
struct Shape {
  int64_t heads, kv_heads, head_dim, cross_heads, expand;
  double eps, qk_eps, scale, cross_scale, softcap;
  bool pre_norm, layer_norm, gated, scale_queries;
  c10::string_view act;
};

// hidden: float32 [N, T, E], the step's embedded tokens. weights: the layers' (LayerWeights). k_caches, v_caches: per layer [R, Hkv, Tmax, D] (R >= rows; rows 0..rows-1 decode),
// written in place at lengths[n] + t; lengths: int64 [N]; mask: bool [N, Tmax] (true = attend) or None;
// cos, sin: [N, T, D] (HF's rotary module's) or None (no rotary). cross_keys, cross_values: per layer the encoder
// output's [N / expand, H, S, D] (empty: no cross-attention), encoder_keep: bool [N / expand, S] or None.
// Returns the hidden states after the last layer.
Tensor decode_layers(const Tensor& hidden_in, const c10::intrusive_ptr<LayerWeights>& layer_weights,
                     at::TensorList k_caches, at::TensorList v_caches, int64_t rows,
                     const Tensor& lengths, const c10::optional<Tensor>& mask, const c10::optional<Tensor>& cos_in,
                     const c10::optional<Tensor>& sin_in, at::TensorList cross_keys, at::TensorList cross_values,
                     const c10::optional<Tensor>& encoder_keep, int64_t expand, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t cross_heads, double eps, double qk_eps, double scale,
                     double cross_scale, double softcap, c10::string_view act, bool pre_norm, bool layer_norm,
                     bool gated, bool scale_queries) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  LG_CHECK_CPU(kOp, hidden_in);
  TORCH_CHECK(hidden_in.scalar_type() == at::kFloat && hidden_in.dim() == 3, kOp,
              ": 'hidden' must be float32 [N, T, E], got ", hidden_in.scalar_type(), " ", hidden_in.sizes());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers, kOp,
              ": 'k_caches' and 'v_caches' must hold one cache per layer, got ", layers, " and ", v_caches.size());
  const bool cross = !cross_keys.empty();
  TORCH_CHECK(!cross || (static_cast<int64_t>(cross_keys.size()) == layers &&
                         static_cast<int64_t>(cross_values.size()) == layers),
              kOp, ": 'cross_keys' and 'cross_values' must hold one tensor per layer or none, got ", cross_keys.size(),
              " and ", cross_values.size());
  TORCH_CHECK(layer_weights->layers() == layers, kOp, ": 'weights' are ", layer_weights->layers(),
              " layers' but the caches are ", layers);
  TORCH_CHECK(cos_in.has_value() == sin_in.has_value(), kOp, ": 'cos' and 'sin' must be given together");
  const int64_t N = hidden_in.size(0), T = hidden_in.size(1);
  TORCH_CHECK(rows == N, kOp, ": the caches decode ", rows, " rows but 'hidden' has ", N);
  TORCH_CHECK(!cross || (expand > 0 && N % expand == 0), kOp, ": ", N, " rows are not sentences of expand=", expand);
  const std::vector<c10::optional<Tensor>>& weights = layer_weights->tensors;
  const at::IntArrayRef layer_ints(layer_weights->ints);
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
  auto weight_of = [&](int64_t layer, int64_t slot) -> const Tensor& {
    const c10::optional<Tensor>& t = tensor(layer, slot);
    TORCH_CHECK(t.has_value(), kOp, ": layer ", layer, " has no norm weight in slot ", slot);
    return *t;
  };
  // apply_norm / apply_add_norm of lightgen/modules/norm.py.
  auto norm = [&](int64_t layer, int64_t slot, const Tensor& x) {
    return layer_norm ? lightgen::layer_norm(x, weight_of(layer, slot), tensor(layer, slot + 1), eps)
                      : rms_norm(x, weight_of(layer, slot), eps);
  };
  auto add_norm = [&](int64_t layer, int64_t slot, const Tensor& x, const Tensor& residual) {
    return layer_norm ? add_layer_norm(x, residual, weight_of(layer, slot), tensor(layer, slot + 1), eps)
                      : add_rms_norm(x, residual, weight_of(layer, slot), eps);
  };
  auto projection = [&](int64_t layer, int64_t index) {
    const int64_t slot = kNorms + kTensorsPerLinear * index;
    const int64_t ints = layer * kIntsPerLayer + 1 + kIntsPerLinear * index;
    Linear l{tensor(layer, slot),     tensor(layer, slot + 1), tensor(layer, slot + 2), tensor(layer, slot + 3),
             tensor(layer, slot + 4), tensor(layer, slot + 5), layer_ints[ints],        layer_ints[ints + 1],
             layer_ints[ints + 2]};
    TORCH_CHECK(l.weight.has_value() && (l.group_size == 0 || l.scale.has_value()), kOp, ": layer ", layer,
                " linear ", index, " needs its weight (and, group-wise quantized, its scale)");
    return l;
  };

  // Decoder._self_attention: AttentionWeights.project, q/k norms, scaled queries, rotary, the cached attention.
  auto self_attention = [&](int64_t layer, const Tensor& x) {
    const std::vector<Tensor> qkv = run_all({projection(layer, kQ), projection(layer, kK), projection(layer, kV)}, x);
    Tensor q = qkv[0].view({N, T, heads, head_dim}).transpose(1, 2);
    Tensor k = qkv[1].view({N, T, kv_heads, head_dim}).transpose(1, 2);
    Tensor v = qkv[2].view({N, T, kv_heads, head_dim}).transpose(1, 2);
    if (tensor(layer, kQNorm).has_value()) {
      q = rms_norm(q, *tensor(layer, kQNorm), qk_eps);
      k = rms_norm(k, weight_of(layer, kKNorm), qk_eps);
    }
    if (scale_queries) q = q * scale;
    if (cos.defined()) {
      q = rotate(q, cos, sin);
      k = rotate(k, cos, sin);
    }
    Tensor k_cache = k_caches[layer].narrow(0, 0, rows), v_cache = v_caches[layer].narrow(0, 0, rows);
    Tensor out = attention(q, k_cache, v_cache, k, v, lengths, mask, scale_queries ? 1.0 : scale, true,
                           layer_ints[layer * kIntsPerLayer], softcap);
    return projection(layer, kOut)(out.view({N, T, heads * head_dim}));
  };
  // Decoder._cross_attention: each sentence's rows (beams) are extra queries over its encoder K/V.
  auto cross_attention = [&](int64_t layer, const Tensor& x) {
    const int64_t sentences = N / expand;
    Tensor q = projection(layer, kCrossQ)(x).view({sentences, expand * T, cross_heads, -1}).transpose(1, 2);
    Tensor keys = cross_keys[layer], values = cross_values[layer];
    Tensor out = attention(q, keys, values, c10::nullopt, c10::nullopt, c10::nullopt, encoder_keep, cross_scale,
                           false, 0, 0.0);
    return projection(layer, kCrossOut)(out.view({N, T, -1}));
  };
  // feed_forward of lightgen/modules/block.py: act(gate(x)) * up(x), or act(fc1(x)) fused; then the down projection.
  auto feed_forward = [&](int64_t layer, const Tensor& x) {
    if (!gated) return projection(layer, kFfnOut)(projection(layer, kFfnIn)(x, act));
    const std::vector<Tensor> gate_up = run_all({projection(layer, kFfnIn), projection(layer, kFfnUp)}, x);
    return projection(layer, kFfnOut)(gated_act(gate_up[0], gate_up[1], act));
  };

  if (!pre_norm) {  // run_block's post-norm residuals: norm(x + sublayer(x)) after each sublayer
    Tensor hidden = hidden_in;
    for (int64_t layer = 0; layer < layers; ++layer) {
      hidden = std::get<1>(add_norm(layer, kSelfNorm, self_attention(layer, hidden), hidden));
      if (cross) hidden = std::get<1>(add_norm(layer, kCrossNorm, cross_attention(layer, hidden), hidden));
      hidden = std::get<1>(add_norm(layer, kFfnNorm, feed_forward(layer, hidden), hidden));
    }
    return hidden;
  }
  // run_block's pre-norm residuals, each sublayer's residual add fused with the next sublayer's norm; the FFN's with
  // the next layer's first norm (fp32: the same sum as the unfused add, rounded once either way).
  Tensor residual = hidden_in, normed = norm(0, kSelfNorm, hidden_in);
  for (int64_t layer = 0; layer < layers; ++layer) {
    std::tie(residual, normed) =
        add_norm(layer, cross ? kCrossNorm : kFfnNorm, self_attention(layer, normed), residual);
    if (cross) std::tie(residual, normed) = add_norm(layer, kFfnNorm, cross_attention(layer, normed), residual);
    Tensor ffn = feed_forward(layer, normed);
    if (layer + 1 == layers) return ffn + residual;
    std::tie(residual, normed) = add_norm(layer + 1, kSelfNorm, ffn, residual);
  }
  return residual;  // not reached: layers > 0
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_FRAGMENT(lightgen, m) {
  m.class_<lightgen::LayerWeights>("LayerWeights")
      .def(torch::init<c10::List<c10::optional<at::Tensor>>, std::vector<int64_t>>());
  m.def("decode_layers(Tensor hidden, __torch__.torch.classes.lightgen.LayerWeights weights, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, int rows, Tensor lengths, Tensor? mask, Tensor? cos, Tensor? sin, Tensor[] cross_keys, "
        "Tensor[] cross_values, Tensor? encoder_keep, int expand, int heads, int kv_heads, int head_dim, "
        "int cross_heads, float eps, float qk_eps, float scale, float cross_scale, float softcap, str act, "
        "bool pre_norm, bool layer_norm, bool gated, bool scale_queries) -> Tensor");
}

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("decode_layers", &lightgen::decode_layers);
}
