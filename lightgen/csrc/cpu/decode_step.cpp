// The layers of a decoder step in one call: pre-norm, post-norm or parallel residuals (RMSNorm, LayerNorm or Gemma's
// (1 + w) RMSNorm, optionally on sublayer outputs too), self-attention over the static KV cache (separate or fused
// q/k/v projections, grouped-query, optionally rotary on all or the first dimensions of each head, with q/k norms,
// soft-capped, with an additive position bias), optionally cross-attention over the encoder's cached K/V, and a
// gated (separate or fused gate|up) or plain FFN (Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3, GPT-2, GPT-NeoX, OPT,
// BART, mBART, Marian, M2M-100, Pegasus, T5...). It calls
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
// bias, undefined for RMSNorm or none), on q and on k (weights; undefined: none), on the self-attention's and the
// FFN's outputs before their residual adds (Gemma 2/3; weight, bias; undefined: none).
enum NormSlot : int64_t {
  kSelfNorm = 0, kCrossNorm = 2, kFfnNorm = 4, kQNorm = 6, kKNorm = 7, kSelfOutNorm = 8, kFfnOutNorm = 10, kNorms = 12
};
// Then each linear's weight, scale and offset (group-wise quantized only), bias, and with int8 activations
// (quantize="int8-dynamic" / "int4-dynamic") its dot-product layout and group sums (int8 only); undefined weight: none.
// A fused q|k|v projection takes kQ's slot (kK and kV empty), a fused gate|up kFfnIn's (kFfnUp empty).
enum LinearIndex : int64_t { kQ, kK, kV, kOut, kCrossQ, kCrossOut, kFfnIn, kFfnUp, kFfnOut, kLinears };
constexpr int64_t kTensorsPerLinear = 6;
constexpr int64_t kTensorsPerLayer = kNorms + kTensorsPerLinear * kLinears;
// The sliding window, the layer's rotary table (an index into 'cos' / 'sin'; -1: none), then each linear's
// out_features and group_size.
enum LayerInt : int64_t { kWindow, kRotary, kLinearInts };
constexpr int64_t kIntsPerLinear = 2;
constexpr int64_t kIntsPerLayer = kLinearInts + kIntsPerLinear * kLinears;

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
  int64_t out_features = 0, group_size = 0;

  // LinearWeights.run of lightgen/modules/linear.py.
  Tensor operator()(const Tensor& x, c10::string_view act = "none") const {
    if (dot.has_value())
      return linear_int8_dynamic(x, *dot, *scale, offset, dot_sums, bias, act, out_features, group_size);
    if (group_size > 0) return linear_grouped(x, *weight, *scale, offset, bias, act, out_features, group_size);
    return linear(x, *weight, c10::nullopt, bias, act, out_features);
  }

  bool in_panels() const { return weight->dim() == 3 || dot.has_value(); }
};

// Layers of one input, e.g. q, k and v: in one parallel loop where every weight is in panels (the same outputs).
std::vector<Tensor> run_all(const std::vector<Linear>& layers, const Tensor& x) {
  if (!std::all_of(layers.begin(), layers.end(), [](const Linear& l) { return l.in_panels(); })) {
    std::vector<Tensor> outputs;
    for (const Linear& l : layers) outputs.push_back(l(x));
    return outputs;
  }
  std::vector<PanelLinear> panels;
  for (const Linear& l : layers)
    panels.push_back({*l.weight, l.scale, l.offset, l.bias, l.dot, l.dot_sums, l.out_features, l.group_size});
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

// HF's apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), on the first R
// dimensions of each head, the rest kept (Phi-3's and GPT-NeoX's partial rotary: cat(rotated, x[..., R:])).
// x: float32 [N, H, T, D] (last dimension contiguous); cos, sin: contiguous float32 [N, T, R], R <= D even.
// Returns contiguous [N, H, T, D].
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t N = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), R = cos.size(2), half = R / 2;
  Tensor out = at::empty({N, H, T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* xr = xp + n * x.stride(0) + h * x.stride(1) + t * x.stride(2);
        const float* c = cp + (n * T + t) * R;
        const float* s = sp + (n * T + t) * R;
        float* o = op + ((n * H + h) * T + t) * D;
        for (int64_t d = 0; d < half; ++d) o[d] = product(xr[d], c[d]) + product(-xr[d + half], s[d]);
        for (int64_t d = half; d < R; ++d) o[d] = product(xr[d], c[d]) + product(xr[d - half], s[d]);
        std::copy(xr + R, xr + D, o + R);
      }
  return out;
}

// Gemma's RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + w), as unit_offset_rms_norm of lightgen/modules/norm.py
// computes it (float32: the same ATen ops, so the same roundings).
Tensor unit_offset_rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return (x * at::rsqrt(x.pow(2).mean({-1}, true) + eps)) * (weight + 1.0);
}

enum class NormKind { kRms, kLayer, kRmsOffset };

NormKind norm_kind(c10::string_view name) {
  if (name == "rms") return NormKind::kRms;
  if (name == "layer") return NormKind::kLayer;
  TORCH_CHECK(name == "rms_offset", kOp, ": 'norm' must be 'rms', 'layer' or 'rms_offset', got '", name, "'");
  return NormKind::kRmsOffset;
}

// hidden: float32 [N, T, E], the step's embedded tokens. weights: the layers' (LayerWeights). k_caches, v_caches:
// per layer [R, Hkv, Tmax, D] (R >= rows; rows 0..rows-1 decode), written in place at lengths[n] + t; lengths: int64
// [N]; mask: bool [N, Tmax] (true = attend), an additive float mask ops.attention takes (T5's position bias), or
// None; cos, sin: the rotary tables the layers index ([N or 1, T, R] each, HF's rotary modules'; R < D only with
// partial_rotary), empty: no rotary. cross_keys, cross_values: per layer the encoder output's [N / expand, H, S, D]
// (empty: no cross-attention), encoder_keep: bool [N / expand, S] or None. Returns the hidden states after the last
// layer.
Tensor decode_layers(const Tensor& hidden_in, const c10::intrusive_ptr<LayerWeights>& layer_weights,
                     at::TensorList k_caches, at::TensorList v_caches, int64_t rows,
                     const Tensor& lengths, const c10::optional<Tensor>& mask, at::TensorList cos_in,
                     at::TensorList sin_in, at::TensorList cross_keys, at::TensorList cross_values,
                     const c10::optional<Tensor>& encoder_keep, int64_t expand, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t cross_heads, double eps, double qk_eps, double scale,
                     double cross_scale, double softcap, c10::string_view act, bool pre_norm,
                     c10::string_view norm_name, bool gated, bool scale_queries, bool parallel_residual,
                     bool fused_gate_up, bool interleaved_qkv, bool partial_rotary) {
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
  TORCH_CHECK(cos_in.size() == sin_in.size(), kOp, ": 'cos' and 'sin' must hold as many tables, got ", cos_in.size(),
              " and ", sin_in.size());
  TORCH_CHECK(!interleaved_qkv || heads == kv_heads, kOp, ": q/k/v interleaved per head need heads == kv_heads, got ",
              heads, " and ", kv_heads);
  const NormKind kind = norm_kind(norm_name);
  const int64_t N = hidden_in.size(0), T = hidden_in.size(1);
  TORCH_CHECK(rows == N, kOp, ": the caches decode ", rows, " rows but 'hidden' has ", N);
  TORCH_CHECK(!cross || (expand > 0 && N % expand == 0), kOp, ": ", N, " rows are not sentences of expand=", expand);
  const std::vector<c10::optional<Tensor>>& weights = layer_weights->tensors;
  const at::IntArrayRef layer_ints(layer_weights->ints);
  std::vector<Tensor> cos, sin;
  for (size_t table = 0; table < cos_in.size(); ++table) {
    const int64_t width = cos_in[table].dim() == 3 ? cos_in[table].size(2) : -1;
    for (const Tensor* t : {&cos_in[table], &sin_in[table]})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(1) == T &&
                      t->size(2) == width && width % 2 == 0 && (partial_rotary ? width <= head_dim : width == head_dim) &&
                      (t->size(0) == N || t->size(0) == 1),
                  kOp, ": 'cos' and 'sin' must be float32 CPU [N, T, R] = [", N, ", ", T, ", ", head_dim,
                  partial_rotary ? " or fewer (even)" : "", "], got ", t->scalar_type(), " ", t->sizes());
    cos.push_back(cos_in[table].expand({N, T, width}).contiguous());
    sin.push_back(sin_in[table].expand({N, T, width}).contiguous());
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
  auto norm_with = [&](int64_t layer, int64_t slot, const Tensor& x, double epsilon) {
    switch (kind) {
      case NormKind::kLayer: return lightgen::layer_norm(x, weight_of(layer, slot), tensor(layer, slot + 1), epsilon);
      case NormKind::kRmsOffset: return unit_offset_rms_norm(x, weight_of(layer, slot), epsilon);
      default: return rms_norm(x, weight_of(layer, slot), epsilon);
    }
  };
  auto norm = [&](int64_t layer, int64_t slot, const Tensor& x) { return norm_with(layer, slot, x, eps); };
  auto add_norm = [&](int64_t layer, int64_t slot, const Tensor& x, const Tensor& residual) {
    switch (kind) {
      case NormKind::kLayer:
        return add_layer_norm(x, residual, weight_of(layer, slot), tensor(layer, slot + 1), eps);
      case NormKind::kRmsOffset: {
        Tensor total = x + residual;
        return std::make_tuple(total, unit_offset_rms_norm(total, weight_of(layer, slot), eps));
      }
      default: return add_rms_norm(x, residual, weight_of(layer, slot), eps);
    }
  };
  // decoder._with_out_norm: a sublayer's output norm where the layer has one (Gemma 2/3).
  auto out_norm = [&](int64_t layer, int64_t slot, const Tensor& x) {
    return tensor(layer, slot).has_value() ? norm(layer, slot, x) : x;
  };
  auto projection = [&](int64_t layer, int64_t index) {
    const int64_t slot = kNorms + kTensorsPerLinear * index;
    const int64_t ints = layer * kIntsPerLayer + kLinearInts + kIntsPerLinear * index;
    Linear l{tensor(layer, slot),     tensor(layer, slot + 1), tensor(layer, slot + 2), tensor(layer, slot + 3),
             tensor(layer, slot + 4), tensor(layer, slot + 5), layer_ints[ints],        layer_ints[ints + 1]};
    TORCH_CHECK(l.weight.has_value() && (l.group_size == 0 || l.scale.has_value()), kOp, ": layer ", layer,
                " linear ", index, " needs its weight (and, group-wise quantized, its scale)");
    return l;
  };

  auto has_linear = [&](int64_t layer, int64_t index) {
    return tensor(layer, kNorms + kTensorsPerLinear * index).has_value();
  };
  // Decoder._self_attention: AttentionWeights.project (views of one fused q|k|v output: all q, all k, all v, or
  // q|k|v per head as GPT-NeoX lays them out), q/k norms, scaled queries, rotary, the cached attention.
  auto self_attention = [&](int64_t layer, const Tensor& x) {
    Tensor q, k, v;
    if (!has_linear(layer, kK)) {
      const Tensor qkv = projection(layer, kQ)(x);
      if (interleaved_qkv) {
        const std::vector<Tensor> parts = qkv.view({N, T, heads, 3 * head_dim}).transpose(1, 2).chunk(3, -1);
        q = parts[0], k = parts[1], v = parts[2];
      } else {
        const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
        q = qkv.narrow(-1, 0, q_width).view({N, T, heads, head_dim}).transpose(1, 2);
        k = qkv.narrow(-1, q_width, kv_width).view({N, T, kv_heads, head_dim}).transpose(1, 2);
        v = qkv.narrow(-1, q_width + kv_width, kv_width).view({N, T, kv_heads, head_dim}).transpose(1, 2);
      }
    } else {
      const std::vector<Tensor> qkv = run_all({projection(layer, kQ), projection(layer, kK), projection(layer, kV)}, x);
      q = qkv[0].view({N, T, heads, head_dim}).transpose(1, 2);
      k = qkv[1].view({N, T, kv_heads, head_dim}).transpose(1, 2);
      v = qkv[2].view({N, T, kv_heads, head_dim}).transpose(1, 2);
    }
    if (tensor(layer, kQNorm).has_value()) {
      q = norm_with(layer, kQNorm, q, qk_eps);
      k = norm_with(layer, kKNorm, k, qk_eps);
    }
    if (scale_queries) q = q * scale;
    const int64_t table = layer_ints[layer * kIntsPerLayer + kRotary];
    TORCH_CHECK(table < static_cast<int64_t>(cos.size()), kOp, ": layer ", layer, " rotates with table ", table,
                " of ", cos.size());
    if (table >= 0) {
      q = rotate(q, cos[table], sin[table]);
      k = rotate(k, cos[table], sin[table]);
    }
    Tensor k_cache = k_caches[layer].narrow(0, 0, rows), v_cache = v_caches[layer].narrow(0, 0, rows);
    Tensor out = attention(q, k_cache, v_cache, k, v, lengths, mask, scale_queries ? 1.0 : scale, true,
                           layer_ints[layer * kIntsPerLayer + kWindow], softcap);
    return out_norm(layer, kSelfOutNorm, projection(layer, kOut)(out.view({N, T, heads * head_dim})));
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
  // feed_forward of lightgen/modules/block.py: act(gate(x)) * up(x) (gate and up: the halves of one fused output,
  // Phi-3's), or act(fc1(x)) fused; then the down projection, and the output norm where the layer has one.
  auto feed_forward = [&](int64_t layer, const Tensor& x) {
    Tensor hidden;
    if (!gated) {
      hidden = projection(layer, kFfnIn)(x, act);
    } else if (fused_gate_up) {
      const std::vector<Tensor> gate_up = projection(layer, kFfnIn)(x).chunk(2, -1);
      hidden = gated_act(gate_up[0], gate_up[1], act);
    } else {
      const std::vector<Tensor> gate_up = run_all({projection(layer, kFfnIn), projection(layer, kFfnUp)}, x);
      hidden = gated_act(gate_up[0], gate_up[1], act);
    }
    return out_norm(layer, kFfnOutNorm, projection(layer, kFfnOut)(hidden));
  };

  if (parallel_residual) {  // run_block's parallel residual: every sublayer reads norm(x); x + (ffn + ... + attn)
    Tensor hidden = hidden_in;
    for (int64_t layer = 0; layer < layers; ++layer) {
      Tensor attn = self_attention(layer, norm(layer, kSelfNorm, hidden));
      Tensor cross_out = cross ? cross_attention(layer, norm(layer, kCrossNorm, hidden)) : Tensor();
      Tensor total = feed_forward(layer, norm(layer, kFfnNorm, hidden));
      if (cross) total = total + cross_out;
      hidden = (total + attn) + hidden;
    }
    return hidden;
  }

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
        "Tensor(b!)[] v_caches, int rows, Tensor lengths, Tensor? mask, Tensor[] cos, Tensor[] sin, Tensor[] cross_keys, "
        "Tensor[] cross_values, Tensor? encoder_keep, int expand, int heads, int kv_heads, int head_dim, "
        "int cross_heads, float eps, float qk_eps, float scale, float cross_scale, float softcap, str act, "
        "bool pre_norm, str norm, bool gated, bool scale_queries, bool parallel_residual, bool fused_gate_up, "
        "bool interleaved_qkv, bool partial_rotary) -> Tensor");
}

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("decode_layers", &lightgen::decode_layers);
}
