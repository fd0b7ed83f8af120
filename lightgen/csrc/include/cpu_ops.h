#pragma once
// The CPU kernels' entry points (csrc/cpu/*.cpp), for C++ that runs several of them in one call: the native
// decode step (cpu/decode_step.cpp) calls the very functions the dispatcher registers, without its overhead.
#include <ATen/ATen.h>
#include <c10/util/string_view.h>
#include <tuple>
#include <vector>

namespace lightgen {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                  const c10::optional<at::Tensor>& bias, c10::string_view act, int64_t out_features);
at::Tensor linear_grouped(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& offset, const c10::optional<at::Tensor>& bias,
                          c10::string_view act, int64_t out_features, int64_t group_size);
// A linear layer with its weight in panels: packed float32 / bfloat16 (group_size 0) or group-wise quantized; with
// ``dot`` (and int8's ``dot_sums``), group-wise in linear_int8_dynamic's layout, run on int8 activations.
struct PanelLinear {
  at::Tensor weight;
  c10::optional<at::Tensor> scale, offset, bias, dot, dot_sums;
  int64_t out_features = 0, group_size = 0;
};
std::vector<at::Tensor> linear_panels(const at::Tensor& x, const std::vector<PanelLinear>& layers);
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, double eps);
std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                                  double eps);
at::Tensor linear_int8_dynamic(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                               const c10::optional<at::Tensor>& offset, const c10::optional<at::Tensor>& sums,
                               const c10::optional<at::Tensor>& bias, c10::string_view act, int64_t out_features,
                               int64_t group_size);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor gated_act(const at::Tensor& gate, const at::Tensor& up, c10::string_view act);
at::Tensor attention(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                     const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                     const c10::optional<at::Tensor>& cache_pos, const c10::optional<at::Tensor>& mask, double scale,
                     bool causal, int64_t window, double softcap, bool stepwise = false, bool eager = false,
                     bool upcast = false, bool softmax_in_dtype = false, bool pack_gqa = false,
                     int64_t static_slots = 0);

}  // namespace lightgen
