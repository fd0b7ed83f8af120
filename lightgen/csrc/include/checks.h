#pragma once
// Input checks whose messages name the op, the argument and what was expected.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/string_view.h>
#include <string>

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
