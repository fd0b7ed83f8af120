// Beam-search candidate selection as LightSeq does it ("R-top-k"): the exact top-k of
// log_softmax(scores) + beam_scores over each batch item's beams x V candidates, found by a rough
// threshold and a sort of the few candidates above it instead of a full log_softmax and top-k.
// Pass 1 (per row, in parallel): max, log-sum-exp and rough threshold, then the candidates above
// that threshold while the row is in cache. Pass 2 (per item): keep those above the largest of its
// beams' thresholds and partially sort them. Per-item queues replace LightSeq's batch offset.
#include <torch/library.h>
#include <ATen/cpu/vec/functional.h>
#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include "../include/checks.h"
#include "../include/vec_math.h"

namespace lightgen {
namespace {

using at::Tensor;

constexpr const char* kOp = "lightgen.beam_topk";
constexpr float kInf = std::numeric_limits<float>::infinity();

// One row's map from a score x to its candidate value, ((x - shift) - log_sum) + beam: the
// operations and order of ATen's log_softmax followed by the beam add, so that values equal the
// reference's bitwise. Without log_softmax, shift and log_sum are 0 and the map is x + beam.
struct RowMap {
  float shift = 0.f;
  float log_sum = 0.f;
  float beam = 0.f;

  float operator()(float x) const { return x - shift - log_sum + beam; }
  fVec operator()(const fVec& x) const { return x - fVec(shift) - fVec(log_sum) + fVec(beam); }
};

struct Candidate {
  float value;
  int64_t index;  // beam * V + token
};

// Descending value, then ascending index: torch.sort(stable=True, descending=True) order.
inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// torch.topk's order on the CPU (ATen's topk_impl_loop, TopKImpl.h): the whole row as (value, index)
// pairs in index order, then std::partial_sort when k * 64 <= n, else std::nth_element and a sort of the
// first k - 1, all with this comparison (NaN first). Among equal values that order depends on every
// element of the row, not only on the top k, so it is reproduced on the whole row, not on survivors.
using TopkElement = std::pair<float, int64_t>;

inline bool topk_greater(const TopkElement& a, const TopkElement& b) {
  return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
}

void torch_topk_order(std::vector<TopkElement>& row, int64_t k) {
  const int64_t n = static_cast<int64_t>(row.size());
  if (k * 64 <= n) {
    std::partial_sort(row.begin(), row.begin() + k, row.end(), topk_greater);
  } else {
    std::nth_element(row.begin(), row.begin() + k - 1, row.end(), topk_greater);
    std::sort(row.begin(), row.begin() + k - 1, topk_greater);
  }
}

// Whether the sorted top k of `queue` (all candidates >= some threshold <= the k-th value) holds two
// equal values or one equal to a candidate left out: only then can torch.topk's order differ from
// (value, index) order.
bool has_ties(const std::vector<Candidate>& queue, int64_t k) {
  for (int64_t i = 1; i < k; ++i)
    if (queue[i].value == queue[i - 1].value) return true;
  const float kth = queue[k - 1].value;
  return std::any_of(queue.begin() + k, queue.end(), [kth](const Candidate& c) { return c.value == kth; });
}

// Max of n floats; NaN anywhere gives NaN (at::vec::maximum propagates it). Four accumulators keep
// the loop throughput-bound rather than waiting on one max chain.
inline float chunk_max(const float* p, int64_t n) {
  constexpr int64_t W = fVec::size();
  const fVec lowest(-kInf);
  fVec acc[4] = {lowest, lowest, lowest, lowest};
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W)
    for (int u = 0; u < 4; ++u) acc[u] = at::vec::maximum(acc[u], fVec::loadu(p + i + u * W));
  for (; i < n; i += W) {
    const int64_t len = std::min(W, n - i);
    acc[0] = at::vec::maximum(acc[0], fVec::set(lowest, fVec::loadu(p + i, len), len));
  }
  const fVec all = at::vec::maximum(at::vec::maximum(acc[0], acc[1]), at::vec::maximum(acc[2], acc[3]));
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, all);
}

// log(sum(exp(x - max))) exactly as ATen's _vec_log_softmax_lastdim computes it: the same
// map_reduce_all accumulation order and the same vectorised exp and log.
inline float log_sum_exp_shifted(const float* x, int64_t n, float max) {
  const float sum = at::vec::map_reduce_all<float>([max](fVec v) { return (v - fVec(max)).exp(); },
                                                   [](fVec a, fVec b) { return a + b; }, x, n);
  alignas(64) float lanes[fVec::size()];
  fVec(sum).log().store(lanes);
  return lanes[0];
}

// A row's candidate map and its rough k-th largest candidate. The row is split into k contiguous
// chunks; their k maxima are k distinct elements, so the smallest of them is <= the row's true k-th
// largest value (LightSeq's R-top-k), and the row max comes for free. With k > V the row alone
// cannot fill the top k and the threshold is -inf.
float scan_row(const float* x, int64_t V, int64_t k, bool log_softmax, float beam, int64_t row, RowMap& map) {
  const int64_t chunks = k <= V ? k : 1;
  float row_max = -kInf, rough = kInf;
  for (int64_t g = 0; g < chunks; ++g) {
    const int64_t begin = g * V / chunks, end = (g + 1) * V / chunks;
    const float m = chunk_max(x + begin, end - begin);
    TORCH_CHECK(!std::isnan(m) && m != kInf, kOp, ": 'scores' row ", row,
                " contains NaN or +inf; mask tokens with -inf instead");
    row_max = std::max(row_max, m);
    rough = std::min(rough, m);
  }
  if (k > V) rough = -kInf;
  map.beam = beam;
  // A row of only -inf keeps shift = log_sum = 0, so its candidates stay -inf instead of NaN.
  if (log_softmax && row_max != -kInf) {
    map.shift = row_max;
    map.log_sum = log_sum_exp_shifted(x, V, row_max);
  }
  return map(rough);  // the map is monotone, so this is the rough k-th largest candidate
}

// Append the candidates >= threshold to `out`.
void collect_row(const float* x, int64_t V, const RowMap& map, float threshold, int64_t base,
                 std::vector<Candidate>& out) {
  const fVec t(threshold);
  constexpr int kAllLanes = (1 << fVec::size()) - 1;
  alignas(64) float lanes[fVec::size()];
  int64_t i = 0;
  for (; i + fVec::size() <= V; i += fVec::size()) {
    const fVec v = map(fVec::loadu(x + i));
    int hits = ~v.ge(t).zero_mask() & kAllLanes;
    if (!hits) continue;  // the common case: nothing in this vector reaches the threshold
    v.store(lanes);
    for (; hits; hits &= hits - 1) {
      const int lane = __builtin_ctz(hits);
      out.push_back({lanes[lane], base + i + lane});
    }
  }
  for (; i < V; ++i) {
    const float v = map(x[i]);
    if (v >= threshold) out.push_back({v, base + i});
  }
}

void check_inputs(const Tensor& scores, const c10::optional<Tensor>& beam_scores_opt, int64_t beams, int64_t k) {
  LG_CHECK_CPU(kOp, scores);
  TORCH_CHECK(scores.scalar_type() == at::kFloat, kOp, ": 'scores' must be float32, got ", scores.scalar_type());
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) > 0, kOp, ": 'scores' must be [B * beams, V] with V > 0, got ",
              scores.sizes());
  TORCH_CHECK(beams >= 1, kOp, ": 'beams' must be >= 1, got ", beams);
  TORCH_CHECK(scores.size(0) % beams == 0, kOp, ": the ", scores.size(0), " rows of 'scores' are not a multiple of ",
              beams, " beams");
  const int64_t candidates = beams * scores.size(1);
  TORCH_CHECK(k >= 1 && k <= candidates, kOp, ": 'k' must be in [1, beams * V] = [1, ", candidates, "], got ", k);
  if (beam_scores_opt) {
    const Tensor& beam_scores = *beam_scores_opt;
    LG_CHECK_CPU(kOp, beam_scores);
    TORCH_CHECK(beam_scores.scalar_type() == at::kFloat, kOp, ": 'beam_scores' must be float32, got ",
                beam_scores.scalar_type());
    LG_CHECK_SHAPE(kOp, beam_scores, scores.size(0));
  }
}

// scores: float32 [B * beams, V]; beam_scores: float32 [B * beams].
// Returns values [B, k] (descending), flat indices beam * V + token [B, k], and survivors [B]:
// how many candidates passed the rough threshold and were sorted.
// stable: ties to the smaller index (torch.sort(stable=True), argmax); otherwise torch.topk's order.
std::tuple<Tensor, Tensor, Tensor> beam_topk(const Tensor& scores_in, const c10::optional<Tensor>& beam_scores_in,
                                             int64_t beams, int64_t k, bool log_softmax, bool stable) {
  check_inputs(scores_in, beam_scores_in, beams, k);
  const Tensor scores = scores_in.contiguous();
  const int64_t rows = scores.size(0), V = scores.size(1), batch = rows / beams;
  std::vector<float> beam(rows, 0.f);
  if (beam_scores_in) {
    const Tensor beam_scores = beam_scores_in->contiguous();
    std::copy_n(beam_scores.data_ptr<float>(), rows, beam.begin());
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(!std::isnan(beam[r]) && beam[r] != kInf, kOp, ": 'beam_scores' row ", r, " is ", beam[r],
                  "; finished beams take -inf or a large negative score");
  }
  const float* x = scores.data_ptr<float>();

  // Per row: its rough threshold and the candidates reaching it, collected while the row is hot.
  std::vector<float> thresholds(rows);
  std::vector<RowMap> maps(rows);
  std::vector<std::vector<Candidate>> row_candidates(rows);
  at::parallel_for(0, rows, row_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      thresholds[r] = scan_row(x + r * V, V, k, log_softmax, beam[r], r, maps[r]);
      collect_row(x + r * V, V, maps[r], thresholds[r], (r % beams) * V, row_candidates[r]);
    }
  });

  Tensor values = at::empty({batch, k}, scores.options());
  Tensor indices = at::empty({batch, k}, scores.options().dtype(at::kLong));
  Tensor survivors = at::empty({batch}, scores.options().dtype(at::kLong));
  float* values_p = values.data_ptr<float>();
  int64_t* indices_p = indices.data_ptr<int64_t>();
  int64_t* survivors_p = survivors.data_ptr<int64_t>();
  int64_t collected = 0;
  for (const auto& c : row_candidates) collected += static_cast<int64_t>(c.size());
  at::parallel_for(0, batch, row_grain(collected / std::max<int64_t>(batch, 1)), [&](int64_t begin, int64_t end) {
    std::vector<Candidate> queue;
    std::vector<TopkElement> item;
    for (int64_t b = begin; b < end; ++b) {
      // Each beam's k candidates above its own rough threshold are in the union, so the largest of
      // the beams' thresholds still leaves at least k candidates: the item's exact top k.
      const int64_t first = b * beams;
      const float threshold = *std::max_element(thresholds.begin() + first, thresholds.begin() + first + beams);
      queue.clear();
      for (int64_t r = first; r < first + beams; ++r)
        std::copy_if(row_candidates[r].begin(), row_candidates[r].end(), std::back_inserter(queue),
                     [threshold](const Candidate& c) { return c.value >= threshold; });
      TORCH_INTERNAL_ASSERT(static_cast<int64_t>(queue.size()) >= k, kOp, ": fewer than k candidates passed");
      std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), ranks_before);
      survivors_p[b] = static_cast<int64_t>(queue.size());
      if (!stable && has_ties(queue, k)) {
        // Exact ties (forced tokens, identical beams): torch.topk's order, over the item's whole row.
        item.resize(beams * V);
        for (int64_t r = first; r < first + beams; ++r)
          for (int64_t t = 0; t < V; ++t) {
            const int64_t j = (r - first) * V + t;
            item[j] = {maps[r](x[r * V + t]), j};
          }
        torch_topk_order(item, k);
        for (int64_t i = 0; i < k; ++i) {
          values_p[b * k + i] = item[i].first;
          indices_p[b * k + i] = item[i].second;
        }
        continue;
      }
      for (int64_t i = 0; i < k; ++i) {
        values_p[b * k + i] = queue[i].value;
        indices_p[b * k + i] = queue[i].index;
      }
    }
  });
  return {values, indices, survivors};
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("beam_topk", &lightgen::beam_topk);
}
