// Sampling one token a row as torch.multinomial(probs, 1) does, with the same draws from the default CPU
// generator and the same tokens, but without the logarithm for tokens of probability 0, which top-k and top-p
// leave nearly everywhere: torch draws an Exp(1) for every one of the [rows, V] entries (one at a time, ~24 ns
// each: 38 ms for 32 rows of a 50k vocabulary at 1 thread, more than the model's step).
#include <torch/library.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>
#include <cmath>
#include <limits>
#include <mutex>
#include "../include/checks.h"

namespace lightgen {
namespace {

using at::Tensor;

constexpr const char* kOp = "lightgen.sample_tokens";

// CPUGeneratorImpl::random64 on a copy of the generator's engine: two words, the first the high half.
struct EngineWords {
  at::mt19937 engine;
  uint64_t random64() {
    const uint32_t high = engine();
    const uint32_t low = engine();
    return (static_cast<uint64_t>(high) << 32) | low;
  }
};

// torch.multinomial's one-sample path: q ~ Exp(1) over the whole tensor in row-major order (exponential_: a
// double from 53 of 64 random bits u, -log1p(-u), cast to float), then the first argmax of p / q, NaN above all.
// A zero p gives 0 / q = 0 whatever q is, except for q = 0 (all 53 bits 0: 0 / 0 = NaN, which wins): its bits
// are drawn, to keep the generator's stream, and only checked.
Tensor sample_tokens(const Tensor& probs_in) {
  LG_CHECK_CPU(kOp, probs_in);
  TORCH_CHECK(probs_in.dim() == 2 && probs_in.scalar_type() == at::kFloat, kOp,
              ": 'probs' must be float32 [rows, V], got ", probs_in.scalar_type(), " ", probs_in.sizes());
  const Tensor probs = probs_in.contiguous();
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  const float* p = probs.data_ptr<float>();
  Tensor tokens = at::empty({rows}, probs.options().dtype(at::kLong));
  if (rows == 0) return tokens;
  TORCH_CHECK(vocab > 0, "cannot sample from a distribution of 0 categories");
  // torch.multinomial's checks and messages, before anything is drawn.
  bool finite = true, empty_row = false;
  for (int64_t r = 0; r < rows; ++r) {
    bool positive = false;
    for (int64_t v = 0; v < vocab; ++v) {
      const float x = p[r * vocab + v];
      finite = finite && x >= 0.f && x < std::numeric_limits<float>::infinity();  // NaN fails both
      positive = positive || x > 0.f;
    }
    empty_row = empty_row || !positive;
  }
  TORCH_CHECK(finite, "probability tensor contains either `inf`, `nan` or element < 0");
  TORCH_CHECK(!empty_row, "invalid multinomial distribution (sum of probabilities <= 0)");

  auto* generator = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(generator->mutex_);
  EngineWords words{generator->engine()};
  const at::exponential_distribution<double> exponential(1.0);
  constexpr uint64_t kMantissa = (uint64_t{1} << std::numeric_limits<double>::digits) - 1;
  int64_t* out = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = p + r * vocab;
    int64_t best = -1, first_zero = -1, first_nan = -1;
    float best_value = -std::numeric_limits<float>::infinity();
    for (int64_t v = 0; v < vocab; ++v) {
      float value = 0.f;
      if (row[v] == 0.f) {
        if ((words.random64() & kMantissa) == 0 && first_nan < 0) first_nan = v;
      } else {
        value = row[v] / static_cast<float>(exponential(&words));
        if (std::isnan(value) && first_nan < 0) first_nan = v;
        if (value > best_value) best = v, best_value = value;
      }
      if (value == 0.f && first_zero < 0) first_zero = v;
    }
    // Every row has a positive p, so the maximum is positive, or 0 (subnormal p over a large q), which a zero p
    // before it ties first.
    if (best_value == 0.f) best = std::min(best, first_zero);
    out[r] = first_nan >= 0 ? first_nan : best;
  }
  generator->set_engine(words.engine);
  return tokens;
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("sample_tokens", &lightgen::sample_tokens);
}
