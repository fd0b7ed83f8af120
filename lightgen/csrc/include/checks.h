#pragma once
// Input checks whose messages name the op, the argument and what was expected.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/string_view.h>
#include <string>
#include <tuple>
#include <vector>

#define LG_CHECK_CPU(op, t) \
  TORCH_CHECK((t).device().is_cpu(), op, ": '" #t "' must be on the CPU, got ", (t).device())
#define LG_CHECK_FLOAT(op, t)                                                                  \
  TORCH_CHECK(at::isFloatingType((t).scalar_type()), op, ": '" #t "' must be float32, float16 or " \
              "bfloat16, got ", (t).scalar_type())
#define LG_CHECK_SAME_DTYPE(op, a, b)                                                                \
  TORCH_CHECK((a).scalar_type() == (b).scalar_type(), op, ": '" #a "' and '" #b "' must share a dtype, " \
              "got ", (a).scalar_type(), " and ", (b).scalar_type())
#define LG_CHECK_SHAPE(op, t, ...)                                                         \
  TORCH_CHECK((t).sizes() == at::IntArrayRef({__VA_ARGS__}), op, ": '" #t "' must have shape ", \
              at::IntArrayRef({__VA_ARGS__}), ", got ", (t).sizes())
#define LG_CHECK_LAST_CONTIGUOUS(op, t) \
  TORCH_CHECK((t).stride(-1) == 1, op, ": the last dimension of '" #t "' must be contiguous")

namespace lightgen {

enum class Act { kGelu, kGeluTanh, kRelu, kSilu, kNone };

// lightgen.linear_grouped's arguments, for every backend: shapes, dtypes and devices checked, operands
// contiguous. weight: int8 [P, K, panel] or int4 as uint8 [P, ceil(K / 2), panel]; scale / offset [P, G, panel].
struct GroupedLinear {
  bool nibbles;
  int64_t k_len, panel_k, groups;
  at::Tensor x, weight, scale, offset, bias;  // offset / bias undefined when not given
};

// Group-wise scales (and offsets, of the same type) are float32, or float16 where they hold the grid exactly enough
// (int4: quantize_grouped of lightgen/ops/linear.py): the type the scale tensor has, float32 for any other.
inline at::ScalarType group_scale_type(const at::Tensor& scale) {
  return scale.scalar_type() == at::kHalf ? at::kHalf : at::kFloat;
}

inline GroupedLinear check_grouped_linear(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                          const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                                          const c10::optional<at::Tensor>& bias, int64_t out_features,
                                          int64_t group_size, int64_t panel) {
  TORCH_CHECK(weight.device() == x.device(), op, ": 'weight' must be on ", x.device(), ", got ", weight.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": 'x' must be float32, got ", x.scalar_type());
  const auto wtype = weight.scalar_type();
  TORCH_CHECK(wtype == at::kChar || wtype == at::kByte, op,
              ": 'weight' must be int8 or uint8 (two int4 values a byte), got ", wtype);
  const bool nibbles = wtype == at::kByte;
  TORCH_CHECK(x.dim() >= 1, op, ": 'x' must have an in_features dimension");
  const int64_t k_len = x.size(-1), panel_k = nibbles ? (k_len + 1) / 2 : k_len;
  TORCH_CHECK(weight.dim() == 3 && weight.size(1) == panel_k && weight.size(2) == panel, op,
              ": 'weight' must be packed [panels, ", panel_k, ", ", panel, "] for in_features=", k_len, ", got ",
              weight.sizes());
  TORCH_CHECK(out_features > (weight.size(0) - 1) * panel && out_features <= weight.size(0) * panel, op,
              ": packed weights need out_features in (", (weight.size(0) - 1) * panel, ", ",
              weight.size(0) * panel, "], got ", out_features);
  TORCH_CHECK(group_size >= 1 && (!nibbles || group_size % 2 == 0), op, ": group_size must be ",
              nibbles ? "even and " : "", "positive, got ", group_size);
  const int64_t groups = (k_len + group_size - 1) / group_size;
  GroupedLinear out{nibbles, k_len, panel_k, groups, x.contiguous(), weight.contiguous(), {}, {}, {}};
  const std::vector<int64_t> per_group{weight.size(0), groups, panel}, per_column{out_features};
  const at::ScalarType scale_type = group_scale_type(scale);  // the offset's too
  for (auto [given, kept, name, shape, dtype] :
       {std::tuple{&scale, &out.scale, "scale", &per_group, scale_type},
        std::tuple{offset ? &*offset : nullptr, &out.offset, "offset", &per_group, scale_type},
        std::tuple{bias ? &*bias : nullptr, &out.bias, "bias", &per_column, at::kFloat}}) {
    if (given == nullptr) continue;
    TORCH_CHECK(given->device() == x.device() && given->scalar_type() == dtype &&
                    given->sizes() == at::IntArrayRef(*shape),
                op, ": '", name, "' must be a ", dtype == at::kHalf ? "float16" : "float32", " tensor of shape ",
                at::IntArrayRef(*shape), " on ", x.device(),
                ", got ", given->scalar_type(), " ", given->sizes(), " on ", given->device());
    *kept = given->contiguous();
  }
  return out;
}

inline Act parse_act(const char* op, c10::string_view name) {
  if (name == "gelu") return Act::kGelu;
  if (name == "gelu_tanh") return Act::kGeluTanh;
  if (name == "relu") return Act::kRelu;
  if (name == "silu") return Act::kSilu;
  if (name == "none") return Act::kNone;
  TORCH_CHECK(false, op, ": unknown activation '", std::string(name),
              "'; expected one of gelu, gelu_tanh, relu, silu, none");
}

// Rows per parallel task so that each task touches at least ~8K elements: smaller tasks cost more
// in OpenMP fork/join than they save (measured at decode shapes).
inline int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, 8192 / std::max<int64_t>(row_len, 1));
}

}  // namespace lightgen
