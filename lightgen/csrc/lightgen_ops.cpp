// Operator schemas: the single source of truth. The Python fallback in
// lightgen/_build.py reads the m.def lines below when this library cannot be built.
// Not here: cpu/decode_step.cpp's decode_layers, the native decoder step, which has no reference of its own
// (the Python Decoder is its specification and runs instead when this library is not built).
#include <torch/library.h>

TORCH_LIBRARY(lightgen, m) {
  m.def("layer_norm(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor weight, Tensor? bias, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("bias_act(Tensor x, Tensor? bias, str act) -> Tensor");
  m.def("gated_act(Tensor gate, Tensor up, str act) -> Tensor");
  m.def("attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_new, Tensor? v_new, Tensor? cache_pos, Tensor? mask, float scale, bool causal, int window=0, float softcap=0.0, bool stepwise=False, bool eager=False, bool upcast=False, bool softmax_in_dtype=False, bool pack_gqa=False, int static_slots=0) -> Tensor");
  m.def("embedding(Tensor ids, Tensor weight, float scale, Tensor? pos_weight, Tensor? positions) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, str act, int out_features=-1) -> Tensor");
  m.def("linear_grouped(Tensor x, Tensor weight, Tensor scale, Tensor? offset, Tensor? bias, str act, int out_features, int group_size) -> Tensor");
  m.def("linear_int8_dynamic(Tensor x, Tensor weight, Tensor scale, Tensor? offset, Tensor? sums, Tensor? bias, str act, int out_features, int group_size) -> Tensor");
  m.def("sample_tokens(Tensor probs) -> Tensor");
  m.def("beam_topk(Tensor scores, Tensor? beam_scores, int beams, int k, bool log_softmax, bool stable=False) -> (Tensor, Tensor, Tensor)");
}
