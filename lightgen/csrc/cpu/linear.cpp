// Decode-shaped linear layer: y = act(x @ W^T * scale + bias) for a few rows of x (M = batch x
// beams x new tokens). Each thread owns a range of output columns and streams its share of the
// weight once for all M rows, so batch 8 costs little more memory traffic than batch 1. Three
// weight layouts: packed panels (what accelerate_model makes: fp32, bf16 or int8 with a
// per-output-channel scale, widened to float in registers), nn.Linear's own [N, K] and HF Conv1D's
// own [K, N] (fp32, read in place).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#include <torch/library.h>
#include <algorithm>
#include <utility>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>
#include <type_traits>
#include "../include/act.h"
#include "../include/checks.h"
#include "../include/cpu_ops.h"

namespace lightgen {
namespace {

using at::Tensor;

inline float widen(float w) { return w; }
inline float widen(int8_t w) { return static_cast<float>(w); }
inline float widen(c10::BFloat16 w) { return static_cast<float>(w); }
inline float widen(c10::Half w) { return static_cast<float>(w); }

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// out[0..3] = the lane sums of h[0..3], three horizontal adds for all four instead of four reductions.
inline void store_sum4(const __m256* h, float* out) {
  __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1)));
}
#endif

// One SIMD register of floats, with loads that widen int8 and bf16 weights on the way in.
#if defined(CPU_CAPABILITY_AVX512)
struct Lanes {
  using V = __m512;
  static constexpr int64_t size = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load(const c10::BFloat16* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // 16 bytes of two 4-bit values each: low nibbles -> *lo, high nibbles -> *hi.
  static void load_nibbles(const uint8_t* p, V* lo, V* hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V broadcast(float v) { return _mm512_set1_ps(v); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static void sum4(const V* v, float* out) {
    __m256 h[4];
    for (int j = 0; j < 4; ++j) h[j] = _mm256_add_ps(_mm512_castps512_ps256(v[j]), _mm512_extractf32x8_ps(v[j], 1));
    store_sum4(h, out);
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
struct Lanes {
  using V = __m256;
  static constexpr int64_t size = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V load(const c10::BFloat16* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static V load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void load_nibbles(const uint8_t* p, V* lo, V* hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V broadcast(float v) { return _mm256_set1_ps(v); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void sum4(const V* v, float* out) { store_sum4(v, out); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#else
struct Lanes {
  using V = float;
  static constexpr int64_t size = 1;
  static V zero() { return 0.f; }
  template <typename W>
  static V load(const W* p) { return widen(*p); }
  static void load_nibbles(const uint8_t* p, V* lo, V* hi) {
    *lo = static_cast<float>(*p & 15);
    *hi = static_cast<float>(*p >> 4);
  }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V mul(V a, V b) { return a * b; }
  static V broadcast(float v) { return v; }
  static void store(float* p, V v) { *p = v; }
  static float sum(V v) { return v; }
  static void sum4(const V* v, float* out) { std::copy(v, v + 4, out); }
};
#endif

using V = Lanes::V;

// The float sum of x[0..len) in one fixed order (per lane, the lanes, then the tail).
inline float group_sum(const float* x, int64_t len) {
  V lanes = Lanes::zero();
  int64_t k = 0;
  for (; k + Lanes::size <= len; k += Lanes::size) lanes = Lanes::fma(Lanes::load(x + k), Lanes::broadcast(1.f), lanes);
  float total = Lanes::sum(lanes);
  for (; k < len; ++k) total += x[k];
  return total;
}

// Register tile: kRows x kCols accumulators + kCols weight vectors. 3 x 8 measured best on AVX-512 (Zen 4)
// among 2x8, 3x8, 4x4, 8x2, 8x4, 2x12: 8 weight rows in flight keep the loads streaming at batch 1.
constexpr int64_t kCols = 8;
constexpr int64_t kRows = 3;

// out[i * ld_out + j] = dot(x row i, w row j) for an rows x cols tile.
template <int64_t rows, int64_t cols, typename W>
inline void dot_tile(const float* x, int64_t ld_x, const W* w, int64_t k_len, float* out, int64_t ld_out) {
  V acc[rows][cols];
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) acc[i][j] = Lanes::zero();
  int64_t k = 0;
  for (; k + Lanes::size <= k_len; k += Lanes::size) {
    V wv[cols];
    for (int64_t j = 0; j < cols; ++j) wv[j] = Lanes::load(w + j * k_len + k);
    for (int64_t i = 0; i < rows; ++i) {
      V xv = Lanes::load(x + i * ld_x + k);
      for (int64_t j = 0; j < cols; ++j) acc[i][j] = Lanes::fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* row = out + i * ld_out;
    if constexpr (cols % 4 == 0) {
      for (int64_t j = 0; j < cols; j += 4) Lanes::sum4(acc[i] + j, row + j);
    } else {
      for (int64_t j = 0; j < cols; ++j) row[j] = Lanes::sum(acc[i][j]);
    }
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t t = k; t < k_len; ++t) row[j] += x[i * ld_x + t] * widen(w[j * k_len + t]);
  }
}

// All M rows against ``cols`` weight rows, which stay in L1 across row tiles (tails: 1 or 2 rows).
template <int64_t cols, typename W>
inline void dot_columns(const float* x, int64_t m, int64_t ld_x, const W* w, int64_t k_len, float* y, int64_t ld_y) {
  int64_t i = 0;
  for (; i + kRows <= m; i += kRows) dot_tile<kRows, cols>(x + i * ld_x, ld_x, w, k_len, y + i * ld_y, ld_y);
  switch (m - i) {
    case 2: return dot_tile<2, cols>(x + i * ld_x, ld_x, w, k_len, y + i * ld_y, ld_y);
    case 1: return dot_tile<1, cols>(x + i * ld_x, ld_x, w, k_len, y + i * ld_y, ld_y);
    default: return;
  }
}

// y[:, lo:hi] = act(y * scale + bias), in place.
template <Act act>
void epilogue(float* y, int64_t m, int64_t ld_y, int64_t lo, int64_t hi, const float* scale, const float* bias) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = y + i * ld_y;
    for (int64_t j = lo; j < hi; j += fVec::size()) {
      const int64_t len = std::min<int64_t>(fVec::size(), hi - j);
      fVec v = fVec::loadu(row + j, len);
      if (scale) v = v * fVec::loadu(scale + j, len);
      if (bias) v = v + fVec::loadu(bias + j, len);
      apply_act<act>(v).store(row + j, len);
    }
  }
}

void run_epilogue(Act act, float* y, int64_t m, int64_t ld_y, int64_t lo, int64_t hi, const float* scale,
                  const float* bias) {
  switch (act) {
    case Act::kGelu: return epilogue<Act::kGelu>(y, m, ld_y, lo, hi, scale, bias);
    case Act::kGeluTanh: return epilogue<Act::kGeluTanh>(y, m, ld_y, lo, hi, scale, bias);
    case Act::kRelu: return epilogue<Act::kRelu>(y, m, ld_y, lo, hi, scale, bias);
    case Act::kSilu: return epilogue<Act::kSilu>(y, m, ld_y, lo, hi, scale, bias);
    case Act::kNone:
      if (scale || bias) epilogue<Act::kNone>(y, m, ld_y, lo, hi, scale, bias);
      return;
  }
}

// Column blocks per parallel task: each task streams at least ~64 KB of weights, below which
// OpenMP fork/join costs more than the second thread saves (decode shapes, measured).
inline int64_t column_grain(int64_t k_len, int64_t weight_bytes) {
  return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(k_len * weight_bytes * kCols, 1));
}

// Panel kernels: the weight is read as rows of kPanel output columns, k after k, and each step
// broadcasts one x value against a row segment, so no horizontal sums are needed. Two layouts:
// HF Conv1D's own [K, N] weight (row stride N, no copy) and packed panels [N / kPanel, K, kPanel]
// (row stride kPanel: one sequential stream per thread), which quantized weights are stored in.
constexpr int64_t kPanel = 64;
constexpr int64_t kPanelVecs = kPanel / Lanes::size;
// Tiles of a panel, rows x vectors (of Lanes::size columns): the accumulators must fit the register file with the
// weight vectors. AVX-512: 4 x 4 (the whole panel) for every kind. AVX2, measured (benchmarks' SmolLM2 step shapes,
// 1 thread, variants interleaved in one process; ms at 1 / 2 / 3 / 8 rows): packed 2 x 8 (41.2 / 55.4 / 59.6 /
// 80.3 against 1 x 8's 41.6 / 59.4 / 55.7 / 85.9 and 3 x 4's 42.3 / 85.3 / 80.2 / 103: half panels split fp32's
// stream into strided ones); group-wise int8 3 x 4 (in the per-weight form: 18.0 / 25.9 / 28.8 / 62.9 against
// 1 x 8's 18.3 / 31.8 / 39.8 / 103: its k rows are one cache line); int4 2 x 8 (13.3 / 13.8 / 18.6 / 44.1 against
// 3 x 4's 13.3 / 18.6 / 23.8 / 61.4). Scalar: 1 x 64. fp32 at more rows costs about memory time plus compute time;
// k-blocked tiles that keep 16-128 k of the panel in L1 for every row tile (2 x 8, 3 x 4, 4 x 2, 2 x 4; with and
// without prefetching the next block) were no faster at 3-16 rows (8 rows: 70.4 whole-panel 2 x 8 against 71.9-112).
struct TileShape {
  int64_t rows, vecs;
};
constexpr TileShape tile_shape(TileShape avx512, TileShape avx2) {
  return Lanes::size == 16 ? avx512 : Lanes::size == 8 ? avx2 : TileShape{1, kPanelVecs};
}
constexpr TileShape kPackedTile = tile_shape({4, 4}, {2, 8});
constexpr TileShape kGroupedInt8Tile = tile_shape({4, 4}, {3, 4});
constexpr TileShape kGroupedInt4Tile = tile_shape({4, 4}, {2, 8});
// Weight-only int8 takes int4's group-sum form (grouped_tile) on every ISA: y += scale[g] * sum x q
// (+ offset[g] * sum x), one multiply-add a weight instead of two, and no scales or offsets held in registers through
// the group (with them the compiler spilled). SmolLM2's step shapes, variants interleaved in one process, ms: AVX2,
// 1 thread, 1 / 2 / 3 / 8 rows, symmetric 18.5 / 24.5 / 30.4 / 62.1 -> 17.1 / 20.1 / 26.5 / 46.9, zero points
// 23.5 / 27.1 / 30.3 / 61.7 -> 20.5 / 21.2 / 26.6 / 46.6; AVX-512 (Zen 4), 2 threads, 1 / 2 / 4 / 8 rows:
// 10.40 / 10.69 / 13.15 / 21.55 -> 9.55 / 10.60 / 12.90 / 20.99 (1 thread: 13.75 / 16.43 / 21.43 / 36.07 ->
// 13.17 / 15.77 / 20.96 / 34.37). int4 keeps its 2 x 8 on AVX2: 3 x 4 lost 11-27% at 3-8 rows.

template <int64_t rows, typename W>
inline void panel_tile(const float* x, int64_t ld_x, const W* w, int64_t ld_w, int64_t k_len, float* y,
                       int64_t ld_y) {
  constexpr int64_t kTileVecs = kPackedTile.vecs, kTileCols = kTileVecs * Lanes::size;
  for (int64_t c0 = 0; c0 < kPanel; c0 += kTileCols) {
    V acc[rows][kTileVecs];
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t v = 0; v < kTileVecs; ++v) acc[i][v] = Lanes::zero();
    for (int64_t k = 0; k < k_len; ++k) {
      V wv[kTileVecs];
      for (int64_t v = 0; v < kTileVecs; ++v) wv[v] = Lanes::load(w + k * ld_w + c0 + v * Lanes::size);
      for (int64_t i = 0; i < rows; ++i) {
        V xv = Lanes::broadcast(x[i * ld_x + k]);
        for (int64_t v = 0; v < kTileVecs; ++v) acc[i][v] = Lanes::fma(xv, wv[v], acc[i][v]);
      }
    }
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t v = 0; v < kTileVecs; ++v) Lanes::store(y + i * ld_y + c0 + v * Lanes::size, acc[i][v]);
  }
}

// rows_constant<r>(rows, f): f(std::integral_constant<int64_t, rows>{}) for a runtime 1 <= rows <= r.
template <int64_t r, typename F>
inline void rows_constant(int64_t rows, const F& f) {
  if constexpr (r > 1) {
    if (rows < r) return rows_constant<r - 1>(rows, f);
  }
  f(std::integral_constant<int64_t, r>{});
}

// One panel (kPanel columns starting at y) for all m rows; ``cols`` < kPanel for a packed tail panel,
// whose padding columns go to a scratch row instead of y. ``tile(rows_constant, first_row, out, ld_out)``
// computes up to tile_rows rows of the panel.
template <int64_t tile_rows, typename Tile>
void panel_rows(int64_t m, int64_t cols, float* y, int64_t ld_y, const Tile& tile) {
  float scratch[tile_rows * kPanel];
  for (int64_t i = 0; i < m; i += tile_rows) {
    const int64_t rows = std::min(tile_rows, m - i);
    float* out = cols == kPanel ? y + i * ld_y : scratch;
    const int64_t ld_out = cols == kPanel ? ld_y : kPanel;
    rows_constant<tile_rows>(rows, [&](auto r) { tile(r, i, out, ld_out); });
    if (out == scratch)
      for (int64_t r = 0; r < rows; ++r)
        std::copy(scratch + r * kPanel, scratch + r * kPanel + cols, y + (i + r) * ld_y);
  }
}

template <typename W>
void panel_columns(const float* x, int64_t m, int64_t k_len, const W* w, int64_t ld_w, int64_t cols, float* y,
                   int64_t ld_y) {
  panel_rows<kPackedTile.rows>(m, cols, y, ld_y, [&](auto rows, int64_t i, float* out, int64_t ld_out) {
    panel_tile<decltype(rows)::value>(x + i * k_len, k_len, w, ld_w, k_len, out, ld_out);
  });
}

inline int64_t panel_grain(int64_t k_len, int64_t weight_bytes) {
  return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(k_len * kPanel * weight_bytes, 1));
}

// Conv1D's [K, N] weight in place; the last N % kPanel columns are plain dot products.
void linear_rows_k_major(const float* x, int64_t m, int64_t k_len, const float* w, int64_t ld_w, int64_t n,
                         const float* scale, const float* bias, Act act, float* y) {
  at::parallel_for(0, (n + kPanel - 1) / kPanel, panel_grain(k_len, 4), [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * kPanel, hi = std::min(n, end * kPanel);
    int64_t col = lo;
    for (; col + kPanel <= hi; col += kPanel) panel_columns(x, m, k_len, w + col, ld_w, kPanel, y + col, n);
    for (; col < hi; ++col) {
      for (int64_t i = 0; i < m; ++i) {
        float s = 0.f;
        for (int64_t k = 0; k < k_len; ++k) s += x[i * k_len + k] * w[k * ld_w + col];
        y[i * n + col] = s;
      }
    }
    run_epilogue(act, y, m, n, lo, hi, scale, bias);
  });
}

struct QuantizedRows;
enum class DotKernel { kPortable, kAvx2, kVnni };  // int8 activations: dot_tile_portable / _avx2 / _vnni

// One linear layer whose weight is in panels, as run_panels hands them out: packed [P, K, kPanel] float32,
// bfloat16 or int8 (a per-column scale applied after), group-wise quantized (grouped_tile, below), or group-wise
// in the dot-product layout times int8 activations (``rows``: linear_int8_dynamic, below); n <= P * kPanel columns
// (the tail padded).
struct PanelJob {
  const void* w = nullptr;
  at::ScalarType type = at::kFloat;
  bool grouped = false, nibbles = false;  // group-wise int8, or int4 (two k a byte)
  int64_t n = 0, group_size = 0, groups = 0;
  const float* scale = nullptr;  // packed: per column, in the epilogue; group-wise: [P, G, kPanel]
  const float* offset = nullptr;  // group-wise with zero points: [P, G, kPanel]
  const c10::Half* half_scale = nullptr;  // group-wise, stored as float16 (int4): in place of scale / offset
  const c10::Half* half_offset = nullptr;
  const float* x_sums = nullptr;  // group sums: each row's sum of x per group [M, G] (run_panels, once a call)
  const QuantizedRows* rows = nullptr;  // int8 activations: x rounded (w in the dot layout, grouped)
  const int32_t* sums = nullptr;  // their int8 weights' group sums [P, G, kPanel]
  DotKernel kernel = DotKernel::kPortable;  // theirs (dot_kernel, asked once a call)
  const float* bias = nullptr;
  Act act = Act::kNone;
  float* y = nullptr;

  int64_t panels() const { return (n + kPanel - 1) / kPanel; }
  bool has_offset() const { return offset || half_offset; }
  int64_t panel_k(int64_t k_len) const {  // bytes per column
    if (rows) return (k_len + (nibbles ? 7 : 3)) / (nibbles ? 8 : 4) * 4;
    return nibbles ? (k_len + 1) / 2 : k_len;
  }
  int64_t panel_bytes(int64_t k_len) const {
    return panel_k(k_len) * kPanel * (grouped ? 1 : static_cast<int64_t>(c10::elementSize(type)));
  }
  void run_panel(const float* x, int64_t m, int64_t k_len, int64_t panel) const;
};

template <typename W>
void packed_panel(const PanelJob& job, const float* x, int64_t m, int64_t k_len, int64_t panel) {
  const int64_t col = panel * kPanel;
  panel_columns(x, m, k_len, static_cast<const W*>(job.w) + panel * k_len * kPanel, kPanel,
                std::min(kPanel, job.n - col), job.y + col, job.n);
}

template <bool nibbles>
void grouped_panel(const PanelJob& job, const float* x, int64_t m, int64_t k_len, int64_t panel);
template <bool nibbles>
void dot_panel(const PanelJob& job, int64_t m, int64_t k_len, int64_t panel);

void PanelJob::run_panel(const float* x, int64_t m, int64_t k_len, int64_t panel) const {
  if (rows) return nibbles ? dot_panel<true>(*this, m, k_len, panel) : dot_panel<false>(*this, m, k_len, panel);
  if (grouped) return nibbles ? grouped_panel<true>(*this, x, m, k_len, panel)
                              : grouped_panel<false>(*this, x, m, k_len, panel);
  switch (type) {
    case at::kFloat: return packed_panel<float>(*this, x, m, k_len, panel);
    case at::kBFloat16: return packed_panel<c10::BFloat16>(*this, x, m, k_len, panel);
    default: return packed_panel<int8_t>(*this, x, m, k_len, panel);
  }
}

// The panels of every job (all of one input x [m, K]) in one parallel loop, each thread's run of panels followed
// by its columns' epilogue. A panel's result does not depend on which thread or call computes it.
void run_panels(const float* x, int64_t m, int64_t k_len, const PanelJob* given, int64_t count) {
  // The group sums of x (grouped_tile), the same for every panel: once a call per group size, not a panel.
  std::vector<PanelJob> jobs(given, given + count);
  std::vector<std::vector<float>> x_sums;
  std::vector<int64_t> summed_sizes;
  x_sums.reserve(count);
  for (PanelJob& job : jobs) {
    if (!job.grouped || !(job.nibbles || job.has_offset())) continue;
    auto same = std::find(summed_sizes.begin(), summed_sizes.end(), job.group_size);
    if (same == summed_sizes.end()) {
      std::vector<float> sums(m * job.groups);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t g = 0, k0 = 0; g < job.groups; ++g, k0 += job.group_size)
          sums[i * job.groups + g] = group_sum(x + i * k_len + k0, std::min(job.group_size, k_len - k0));
      x_sums.push_back(std::move(sums));
      same = summed_sizes.insert(summed_sizes.end(), job.group_size);
    }
    job.x_sums = x_sums[same - summed_sizes.begin()].data();
  }
  int64_t total = 0, bytes = 1;
  for (const PanelJob& job : jobs) {
    total += job.panels();
    bytes = std::max(bytes, job.panel_bytes(k_len));
  }
  // Tasks of at least ~64 KB of weights, below which OpenMP fork/join costs more than a second thread saves.
  at::parallel_for(0, total, std::max<int64_t>(1, (64 << 10) / bytes), [&](int64_t begin, int64_t end) {
    for (int64_t j = 0, first = 0; j < count; first += jobs[j].panels(), ++j) {
      const PanelJob& job = jobs[j];
      const int64_t lo = std::max(begin, first) - first, hi = std::min(end, first + job.panels()) - first;
      if (lo >= hi) continue;
      for (int64_t panel = lo; panel < hi; ++panel) job.run_panel(x, m, k_len, panel);
      run_epilogue(job.act, job.y, m, job.n, lo * kPanel, std::min(job.n, hi * kPanel),
                   job.grouped ? nullptr : job.scale, job.bias);
    }
  });
}

// Group-wise quantized panels (the Q8_0 / Q4_0 / Q4_1 idea in the panel layout): every group_size
// consecutive k of a column share one float scale, so an outlier only coarsens its own group:
//   int8:          w = q * scale[g] (+ offset[g])         (q int8; no offset: symmetric)
//   int4 (nibbles): w = u * scale[g] + offset[g]          (u in 0..15; no offset: symmetric, offset = -8 scale)
// Both sum a group's products on the integers, sum_k x q, and scale once at the group's end (int4, AVX-512, SmolLM2
// step, 1 thread, against dequantizing each weight: B=1 10.3-12.5 -> 8.2-8.7 ms; int8: the note after the tile shapes).
// Each row's arithmetic is the same in any tile, so a row's outputs do not depend on the batch.
// int4 stores k = 2p in the low and k = 2p + 1 in the high nibble of byte row p; group_size is even.
// Vectors of a group-sum tile: int8 takes the whole panel below a full tile of rows (one stream; 3 x 4 at 2 rows
// lost 15%), int4 its tile's.
template <int64_t rows, bool nibbles>
constexpr int64_t group_sum_vecs() {
  if constexpr (nibbles) return kGroupedInt4Tile.vecs;
  return rows < kGroupedInt8Tile.rows ? kPanelVecs : kGroupedInt8Tile.vecs;
}

// Quantized panels are read ahead of the hardware prefetcher, whose stream the widening slows: a byte row (64 k,
// one cache line) 2 KB on. AVX-512 (Zen 4), SmolLM2's step shapes, 2 threads, interleaved, ms at 1 / 2 rows: int8
// 11.53 / 13.07 -> 10.34 / 10.95 (1 KB: 10.61 / 11.07), int4 9.95 / 10.98 -> 8.84 / 9.56; 8 rows the same or
// better. fp32's plain stream needs none (1-4 KB on: 1-19% slower).
constexpr int64_t kPrefetchBytes = 2048;
inline void prefetch_ahead(const void* row) { __builtin_prefetch(static_cast<const char*>(row) + kPrefetchBytes); }

// The group-sum form: a group's products sum_k x q on the raw integers, scaled once at the group's end; the running
// sums live in y (L1) instead of registers, which then hold the group's partial sums alone (with both in registers
// the compiler spilled the widened weights in the inner loop; int4, AVX2, SmolLM2's step shapes, 1 thread,
// interleaved: 1 / 2 / 8 rows 13.7 / 12.9 / 36.4 -> 12.7 / 11.5 / 35.3 ms). ``x_sums``: each row's group sums of x
// (read for int4 and for int8 with zero points only). ``scale`` / ``offset``: float, or float16 (int4's) widened as
// they are loaded, in step with the weights' stream (widened into a buffer before each panel instead, the scales'
// separate read cost more than their halved bytes saved: SmolLM2 int4 step 5.75 -> 6.28 ms).
template <int64_t rows, bool nibbles, typename S>
inline void grouped_tile(const float* x, int64_t ld_x, const uint8_t* w, int64_t k_len, int64_t group_size,
                         const S* scale, const S* offset, const float* x_sums, int64_t groups, float* y,
                         int64_t ld_y) {
  constexpr int64_t kTileVecs = group_sum_vecs<rows, nibbles>(), kTileCols = kTileVecs * Lanes::size;
  for (int64_t c0 = 0; c0 < kPanel; c0 += kTileCols) {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t v = 0; v < kTileVecs; ++v) Lanes::store(y + i * ld_y + c0 + v * Lanes::size, Lanes::zero());
    for (int64_t k0 = 0, g = 0; k0 < k_len; k0 += group_size, ++g) {
      const int64_t k1 = std::min(k_len, k0 + group_size);
      V part[rows][kTileVecs];
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t v = 0; v < kTileVecs; ++v) part[i][v] = Lanes::zero();
      if constexpr (nibbles) {
        for (int64_t k = k0; k < k1; k += 2) {
          if (c0 == 0) prefetch_ahead(w + (k / 2) * kPanel);
          const bool pair = k + 1 < k1;  // false only for an odd k_len's last k (its high nibble is padding)
          for (int64_t v = 0; v < kTileVecs; ++v) {
            V lo, hi;
            Lanes::load_nibbles(w + (k / 2) * kPanel + c0 + v * Lanes::size, &lo, &hi);
            for (int64_t i = 0; i < rows; ++i) {
              part[i][v] = Lanes::fma(Lanes::broadcast(x[i * ld_x + k]), lo, part[i][v]);
              if (pair) part[i][v] = Lanes::fma(Lanes::broadcast(x[i * ld_x + k + 1]), hi, part[i][v]);
            }
          }
        }
      } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(w);
        for (int64_t k = k0; k < k1; ++k) {
          if (c0 == 0) prefetch_ahead(q + k * kPanel);
          for (int64_t v = 0; v < kTileVecs; ++v) {
            const V wv = Lanes::load(q + k * kPanel + c0 + v * Lanes::size);
            for (int64_t i = 0; i < rows; ++i)
              part[i][v] = Lanes::fma(Lanes::broadcast(x[i * ld_x + k]), wv, part[i][v]);
          }
        }
      }
      // int4 without zero points is centred by -8 steps; symmetric int8 has no offset.
      const bool shifted = nibbles || offset;
      for (int64_t v = 0; v < kTileVecs; ++v) {
        const V d = Lanes::load(scale + g * kPanel + c0 + v * Lanes::size);
        V o = Lanes::zero();
        if (shifted)
          o = offset ? Lanes::load(offset + g * kPanel + c0 + v * Lanes::size) : Lanes::mul(d, Lanes::broadcast(-8.f));
        for (int64_t i = 0; i < rows; ++i) {
          float* out = y + i * ld_y + c0 + v * Lanes::size;
          const V scaled = Lanes::fma(part[i][v], d, Lanes::load(out));
          Lanes::store(out, shifted ? Lanes::fma(Lanes::broadcast(x_sums[i * groups + g]), o, scaled) : scaled);
        }
      }
    }
  }
}

// Group-wise panels: weight [P, K (int8) or ceil(K / 2) (int4), kPanel], scale / offset [P, G, kPanel].
template <bool nibbles>
void grouped_panel(const PanelJob& job, const float* x, int64_t m, int64_t k_len, int64_t panel) {
  const int64_t col = panel * kPanel, panel_k = job.panel_k(k_len);
  const void* wp = static_cast<const int8_t*>(job.w) + panel * panel_k * kPanel;
  const int64_t at = panel * job.groups * kPanel;
  auto run = [&](auto sp, auto op) {
    panel_rows<(nibbles ? kGroupedInt4Tile : kGroupedInt8Tile).rows>(
        m, std::min(kPanel, job.n - col), job.y + col, job.n, [&](auto rows, int64_t i, float* out, int64_t ld_out) {
          constexpr int64_t r = decltype(rows)::value;
          grouped_tile<r, nibbles>(x + i * k_len, k_len, static_cast<const uint8_t*>(wp), k_len, job.group_size, sp,
                                   op, job.x_sums ? job.x_sums + i * job.groups : nullptr, job.groups, out, ld_out);
        });
  };
  if (job.half_scale) return run(job.half_scale + at, job.half_offset ? job.half_offset + at : nullptr);
  run(job.scale + at, job.offset ? job.offset + at : nullptr);
}

// int8 activations (lightgen.linear_int8_dynamic): each row's group of group_size k (the weight's groups) is
// rounded to a = round(x * 127 / amax) in -127..127 with its own step t = amax / 127, so a group's integer dot
// product I = sum a q is exact in int32 and y = sum_g t s[g] I[g] + offset[g] * S[g] (with zero points).
// vpdpbusd multiplies unsigned by signed bytes. Two weight formats, each in its own layout, 32-bit lanes of one
// column's consecutive k, [P, lanes, 64, 4]:
//   int8 (q signed): 4 k a lane. Activations go in as a + 128 (1..255) and each group's accumulator starts at
//     -128 * sum_g q (``sums``, made at pack time), which takes the shift back out exactly. S = sum_g x, the exact
//     float sum (q is centred: the zero points' offsets sit mid-range).
//   int4 (``nibbles``, u in 0..15 unsigned): 8 k a lane, k0..k3 in the low nibbles of its 4 bytes, k4..k7 in the
//     high ones. u is the unsigned operand and a the signed one as it is: no shift and no sums. S = t * sum_g a, the
//     rounded x's sum (Q8_1's s), so y is the exact product of the rounded x with the dequantized w: the offset is
//     the group's minimum, and with x's own sum the rounding error would meet w - min (0..15 steps, not centred)
//     instead of w (SmolLM2: 6x the KL, benchmarks/quantize_quality.py).
constexpr float kActFloor = 1e-30f;  // groups of smaller magnitude (zeros) quantize to 0 without inf / NaN

// k per 32-bit weight lane of the dot layout.
constexpr int64_t lane_k(bool nibbles) { return nibbles ? 8 : 4; }

struct QuantizedRows {
  std::vector<uint8_t> q;  // [M, lanes * lane_k]: a + 128 (int4: a as int8), padding k: a = 0
  std::vector<float> step, sum;  // [M, G]: t (NaN for a group holding inf / NaN) and S (above)
};

template <bool nibbles>
QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k_len, int64_t stride, int64_t group_size) {
  constexpr int32_t shift = nibbles ? 0 : 128;
  const int64_t groups = (k_len + group_size - 1) / group_size;
  QuantizedRows out{std::vector<uint8_t>(m * stride, static_cast<uint8_t>(shift)), std::vector<float>(m * groups),
                    std::vector<float>(m * groups)};
  at::parallel_for(0, m, row_grain(k_len), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = x + i * k_len;
      uint8_t* q = out.q.data() + i * stride;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = g * group_size, k1 = std::min(k_len, k0 + group_size);
        float amax = 0.f, total = 0.f;
#if defined(CPU_CAPABILITY_AVX512)
        // A NaN may drop out of the max; the sum keeps it (and inf is the max), so the check below sees both.
        auto lanes = [&](int64_t k) { return static_cast<__mmask16>(k1 - k >= 16 ? 0xFFFF : (1u << (k1 - k)) - 1); };
        __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += 16) {
          const __m512 v = _mm512_maskz_loadu_ps(lanes(k), xi + k);
          vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
          vsum = _mm512_add_ps(vsum, v);
        }
        amax = _mm512_reduce_max_ps(vmax);
        total = _mm512_reduce_add_ps(vsum);
#else
        for (int64_t k = k0; k < k1; ++k) {
          amax = std::max(amax, std::abs(xi[k]));
          total += xi[k];
        }
#endif
        out.sum[i * groups + g] = total;
        if (!std::isfinite(amax) || !std::isfinite(total)) {  // inf / NaN: the group's a stay 0, its t and S NaN
          out.step[i * groups + g] = std::numeric_limits<float>::quiet_NaN();
          if (nibbles) out.sum[i * groups + g] = out.step[i * groups + g];
          continue;
        }
        amax = std::max(amax, kActFloor);
        const float inv = 127.f / amax, step = amax / 127.f;
        out.step[i * groups + g] = step;
        int32_t rounded = 0;  // sum_g a
#if defined(CPU_CAPABILITY_AVX512)
        __m512i vrounded = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += 16) {  // the same rounding (to nearest even) as std::nearbyint below
          const __mmask16 mask = lanes(k);
          __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, xi + k), _mm512_set1_ps(inv)));
          v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
          vrounded = _mm512_add_epi32(vrounded, v);  // masked-off lanes loaded 0
          _mm512_mask_cvtepi32_storeu_epi8(q + k, mask, _mm512_add_epi32(v, _mm512_set1_epi32(shift)));
        }
        rounded = _mm512_reduce_add_epi32(vrounded);
#else
        for (int64_t k = k0; k < k1; ++k) {
          const int32_t a = static_cast<int32_t>(std::clamp(std::nearbyint(xi[k] * inv), -127.f, 127.f));
          rounded += a;
          q[k] = static_cast<uint8_t>(a + shift);
        }
#endif
        if (nibbles) out.sum[i * groups + g] = step * static_cast<float>(rounded);
      }
    }
  });
  return out;
}

// What one rows x 64 tile of a panel needs: the quantized rows and the panel's weights, scales, offsets, sums.
struct DotPanel {
  const uint8_t* q;  // first row's activations; row stride lanes * lane_k
  const float* step;  // [rows, G]
  const float* sum;
  const uint8_t* w;  // [lanes, 64, 4]: int8 q, or int4 u pairs (nibbles)
  const float* scale;  // [G, 64]
  const float* offset;  // [G, 64] or null
  const int32_t* sums;  // [G, 64]: -128 * sum of the group's q (int8), null (int4)
  int64_t lanes, group_lanes, groups;
  const c10::Half* half_scale = nullptr;  // float16 scales and offsets [G, 64], in place of scale / offset
  const c10::Half* half_offset = nullptr;

  // The weight lane range of group g.
  int64_t lane_end(int64_t g) const { return std::min(lanes, (g + 1) * group_lanes); }
  bool has_offset() const { return offset || half_offset; }
  // L::size scales (offsets) of group g from column c, widened as they are loaded.
  template <typename L>
  typename L::F load_scale(int64_t g, int64_t c) const {
    return half_scale ? L::load(half_scale + g * kPanel + c) : L::load(scale + g * kPanel + c);
  }
  template <typename L>
  typename L::F load_offset(int64_t g, int64_t c) const {
    return half_offset ? L::load(half_offset + g * kPanel + c) : L::load(offset + g * kPanel + c);
  }
};

// One float, for dot_tile_portable.
struct ScalarFloats {
  using F = float;
  static F load(const float* p) { return *p; }
  static F load(const c10::Half* p) { return static_cast<float>(*p); }
};

// Any CPU: the same integers, one column at a time, and the same float rounding as dot_tile_avx2 and _vnni
// (explicit fused multiply-adds in their order), so all give the same bits.
template <int64_t rows, bool nibbles>
void dot_tile_portable(const DotPanel& p, float* y, int64_t ld_y) {
  constexpr int64_t per_lane = lane_k(nibbles);
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* q = p.q + i * p.lanes * per_lane;
    for (int64_t c = 0; c < kPanel; ++c) {
      float acc = 0.f;
      for (int64_t g = 0; g < p.groups; ++g) {
        int32_t dot = nibbles ? 0 : p.sums[g * kPanel + c];
        for (int64_t lane = g * p.group_lanes; lane < p.lane_end(g); ++lane)
          for (int64_t b = 0; b < per_lane; ++b) {
            const uint8_t byte = p.w[(lane * kPanel + c) * 4 + b % 4];
            const uint8_t act = q[lane * per_lane + b];
            dot += nibbles ? int32_t(static_cast<int8_t>(act)) * ((byte >> (b / 4 * 4)) & 15)
                           : int32_t(act) * int32_t(static_cast<int8_t>(byte));
          }
        const float dt = p.load_scale<ScalarFloats>(g, c) * p.step[i * p.groups + g];
        acc = std::fma(float(dot), dt, acc);
        if (p.has_offset()) acc = std::fma(p.load_offset<ScalarFloats>(g, c), p.sum[i * p.groups + g], acc);
      }
      y[i * ld_y + c] = acc;
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The float intrinsics add_group needs, over 8 (AVX2) or 16 (AVX-512) columns a vector.
struct Avx2Floats {
  using F = __m256;
  using I = __m256i;
  static constexpr int64_t size = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
};
#if defined(CPU_CAPABILITY_AVX512)
struct Avx512Floats {
  using F = __m512;
  using I = __m512i;
  static constexpr int64_t size = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
};
#endif

// A SIMD dot kernel's group end, in dot_tile_portable's order: acc += float(dot) * (scale * step), then
// + offset * sum (with zero points).
template <typename L, int64_t rows, int64_t vecs>
inline void add_group(const DotPanel& p, int64_t g, const typename L::I (&dot)[rows][vecs],
                      typename L::F (&acc)[rows][vecs]) {
  for (int64_t v = 0; v < vecs; ++v) {
    const typename L::F d = p.template load_scale<L>(g, v * L::size);
    for (int64_t i = 0; i < rows; ++i)
      acc[i][v] = L::fma(L::to_float(dot[i][v]), L::mul(d, L::set1(p.step[i * p.groups + g])), acc[i][v]);
    if (p.has_offset()) {
      const typename L::F o = p.template load_offset<L>(g, v * L::size);
      for (int64_t i = 0; i < rows; ++i) acc[i][v] = L::fma(o, L::set1(p.sum[i * p.groups + g]), acc[i][v]);
    }
  }
}

// AVX2 (any CPU of the AVX2 and AVX-512 builds): vpmaddubsw multiplies unsigned by signed bytes into int16 pairs,
// vpmaddwd sums int16 pairs into int32 lanes, so a lane's 4 k (int4: 8) come out as one column's integer dot
// product, the same integers as the other kernels, and the same float rounding after.
//   int8: |q| is the unsigned operand and a * sign(q) the signed one: a pair is at most 2 * 128 * 127 < 2^15 (no
//     saturation), and the sum is sum a q itself (a = the stored a + 128, xor 0x80), without the group sums.
//   int4: u is the unsigned operand and a the signed one; a pair is at most 2 * 15 * 127, so the products of up to
//     4 lanes (8 vpmaddubsw) add up in int16 before one vpmaddwd.
// 2 rows x the whole panel (8 vectors of 8 columns), some accumulators spilled to L1: measured (SmolLM2's step
// shapes, 1 thread, interleaved; ms int8 / int4 at 1 and 8 rows) 22.9 / 14.8 and 50.9 / 44.5, against half a
// panel (in registers) 34.2 / 22.2 and 61.1 / 45.4: a half reads 128 of each lane's 256 bytes, two strided streams.
template <int64_t rows, bool nibbles>
__attribute__((target("avx2,fma"))) void dot_tile_avx2(const DotPanel& p, float* y, int64_t ld_y) {
  constexpr int64_t per_lane = lane_k(nibbles), vecs = kPanel / 8, lanes_in_int16 = nibbles ? 4 : 1;
  const __m256i ones = _mm256_set1_epi16(1), low_nibbles = _mm256_set1_epi8(15);
  __m256 acc[rows][vecs];
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t v = 0; v < vecs; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256i dot[rows][vecs];
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t v = 0; v < vecs; ++v) dot[i][v] = _mm256_setzero_si256();
    for (int64_t lane = g * p.group_lanes, end = p.lane_end(g); lane < end; lane += lanes_in_int16) {
      __m256i part[rows][vecs];
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t v = 0; v < vecs; ++v) part[i][v] = _mm256_setzero_si256();
      for (int64_t l = lane, stop = std::min(end, lane + lanes_in_int16); l < stop; ++l) {
        __m256i a[rows][per_lane / 4];
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t h = 0; h < per_lane / 4; ++h) {
            int32_t four;
            std::memcpy(&four, p.q + i * p.lanes * per_lane + l * per_lane + h * 4, 4);
            a[i][h] = _mm256_set1_epi32(nibbles ? four : four ^ static_cast<int32_t>(0x80808080u));
          }
        for (int64_t v = 0; v < vecs; ++v) {
          const __m256i raw =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.w + (l * kPanel + v * 8) * 4));
          if constexpr (nibbles) {
            const __m256i lo = _mm256_and_si256(raw, low_nibbles);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles);
            for (int64_t i = 0; i < rows; ++i)
              part[i][v] = _mm256_add_epi16(
                  part[i][v], _mm256_add_epi16(_mm256_maddubs_epi16(lo, a[i][0]), _mm256_maddubs_epi16(hi, a[i][1])));
          } else {
            const __m256i magnitude = _mm256_abs_epi8(raw);
            for (int64_t i = 0; i < rows; ++i)
              part[i][v] = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a[i][0], raw));
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t v = 0; v < vecs; ++v)
          dot[i][v] = _mm256_add_epi32(dot[i][v], _mm256_madd_epi16(part[i][v], ones));
    }
    add_group<Avx2Floats>(p, g, dot, acc);
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t v = 0; v < vecs; ++v) _mm256_storeu_ps(y + i * ld_y + v * 8, acc[i][v]);
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// AVX-512 VNNI, compiled for it here and run only where the CPU reports it (dot_kernel). 3 rows x 4 vectors of 16
// columns: 12 int32 and 12 float accumulators, 4 weight vectors and a broadcast fit the 32 registers (int4: the
// nibbles split into 8, the float accumulators wait in L1 between groups).

template <int64_t rows, bool nibbles>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void dot_tile_vnni(const DotPanel& p, float* y,
                                                                          int64_t ld_y) {
  constexpr int64_t per_lane = lane_k(nibbles);
  __m512 acc[rows][4];
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i dot[rows][4];
    for (int64_t v = 0; v < 4; ++v) {
      const __m512i start = nibbles ? _mm512_setzero_si512() : _mm512_loadu_si512(p.sums + g * kPanel + v * 16);
      for (int64_t i = 0; i < rows; ++i) dot[i][v] = start;
    }
    for (int64_t lane = g * p.group_lanes, end = p.lane_end(g); lane < end; ++lane) {
      // int8: the weight is the signed operand; int4: its low and high nibbles are the unsigned ones.
      __m512i wv[nibbles ? 8 : 4];
      for (int64_t v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_loadu_si512(p.w + lane * kPanel * 4 + v * 64);
        if constexpr (nibbles) {
          wv[v] = _mm512_and_si512(raw, _mm512_set1_epi8(15));
          wv[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(15));
        } else {
          wv[v] = raw;
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        const uint8_t* a = p.q + i * p.lanes * per_lane + lane * per_lane;
        for (int64_t half = 0; half < per_lane / 4; ++half) {
          int32_t four;
          std::memcpy(&four, a + half * 4, 4);
          const __m512i av = _mm512_set1_epi32(four);
          for (int64_t v = 0; v < 4; ++v)
            dot[i][v] = nibbles ? _mm512_dpbusd_epi32(dot[i][v], wv[v + 4 * half], av)
                                : _mm512_dpbusd_epi32(dot[i][v], av, wv[v]);
        }
      }
    }
    add_group<Avx512Floats>(p, g, dot, acc);
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t v = 0; v < 4; ++v) _mm512_storeu_ps(y + i * ld_y + v * 16, acc[i][v]);
}
#endif

// The int8-activation kernel of a call: the best this build and CPU have, or the one LIGHTGEN_INT8_DOT_KERNEL names
// (auto, portable, avx2, vnni; read per call, so tests run each kernel there is).
DotKernel dot_kernel() {
#if defined(CPU_CAPABILITY_AVX512)
  static const DotKernel best = __builtin_cpu_supports("avx512vnni") ? DotKernel::kVnni : DotKernel::kAvx2;
#elif defined(CPU_CAPABILITY_AVX2)
  constexpr DotKernel best = DotKernel::kAvx2;
#else
  constexpr DotKernel best = DotKernel::kPortable;
#endif
  const char* env = std::getenv("LIGHTGEN_INT8_DOT_KERNEL");
  std::string name = env ? env : "";
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (name.empty() || name == "auto") return best;
  const char* names[] = {"portable", "avx2", "vnni"};
  for (int kernel = 0; kernel < 3; ++kernel) {
    if (name != names[kernel]) continue;
    TORCH_CHECK(kernel <= static_cast<int>(best), "LIGHTGEN_INT8_DOT_KERNEL=", env,
                ": this CPU or build has no such kernel (the best here: ", names[static_cast<int>(best)], ")");
    return static_cast<DotKernel>(kernel);
  }
  TORCH_CHECK(false, "LIGHTGEN_INT8_DOT_KERNEL must be auto, portable, avx2 or vnni, got '", env, "'");
}

// Rows a tile of the dot kernels: 3 (VNNI's register file), 2 (AVX2's), 1 (portable: one column at a time).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kDotRows = 3;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kDotRows = 2;
#else
constexpr int64_t kDotRows = 1;
#endif

// One panel of a dot-layout job, all m rows: weight [P, lanes, kPanel, 4], scale / offset / sums [P, G, kPanel].
template <bool nibbles>
void dot_panel(const PanelJob& job, int64_t m, int64_t k_len, int64_t panel) {
  constexpr int64_t per_lane = lane_k(nibbles);
  const int64_t lanes = (k_len + per_lane - 1) / per_lane, groups = job.groups, at = panel * groups * kPanel;
  DotPanel p{nullptr, nullptr, nullptr, static_cast<const uint8_t*>(job.w) + panel * lanes * 4 * kPanel,
             job.scale ? job.scale + at : nullptr, job.offset ? job.offset + at : nullptr,
             job.sums ? job.sums + at : nullptr, lanes, job.group_size / per_lane, groups};
  if (job.half_scale) {
    p.half_scale = job.half_scale + at;
    p.half_offset = job.half_offset ? job.half_offset + at : nullptr;
  }
  const int64_t col = panel * kPanel;
  panel_rows<kDotRows>(m, std::min(kPanel, job.n - col), job.y + col, job.n,
                       [&](auto r, int64_t i, float* out, int64_t ld) {
                         DotPanel tile = p;
                         tile.q = job.rows->q.data() + i * lanes * per_lane;
                         tile.step = job.rows->step.data() + i * groups;
                         tile.sum = job.rows->sum.data() + i * groups;
#if defined(CPU_CAPABILITY_AVX512)
                         if (job.kernel == DotKernel::kVnni)
                           return dot_tile_vnni<decltype(r)::value, nibbles>(tile, out, ld);
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
                         if (job.kernel == DotKernel::kAvx2)
                           return dot_tile_avx2<decltype(r)::value, nibbles>(tile, out, ld);
#endif
                         dot_tile_portable<decltype(r)::value, nibbles>(tile, out, ld);
                       });
}

// x [m, K] rounded for a dot-layout job (int8: a + 128, int4: a), once for all the jobs of one group size and kind.
QuantizedRows quantize_for(const PanelJob& job, const float* x, int64_t m, int64_t k_len) {
  const int64_t per_lane = lane_k(job.nibbles), stride = (k_len + per_lane - 1) / per_lane * per_lane;
  return job.nibbles ? quantize_rows<true>(x, m, k_len, stride, job.group_size)
                     : quantize_rows<false>(x, m, k_len, stride, job.group_size);
}

template <typename W>
void linear_rows(const float* x, int64_t m, int64_t k_len, const W* w, int64_t n, const float* scale,
                 const float* bias, Act act, float* y) {
  const int64_t blocks = (n + kCols - 1) / kCols;
  at::parallel_for(0, blocks, column_grain(k_len, sizeof(W)), [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * kCols, hi = std::min(n, end * kCols);
    int64_t col = lo;
    for (; col + kCols <= hi; col += kCols) dot_columns<kCols>(x, m, k_len, w + col * k_len, k_len, y + col, n);
    for (; col < hi; ++col) dot_columns<1>(x, m, k_len, w + col * k_len, k_len, y + col, n);
    run_epilogue(act, y, m, n, lo, hi, scale, bias);
  });
}

enum class Layout { kRows, kKMajor, kPacked };  // [N, K] rows, Conv1D's [K, N], packed panels

template <typename W>
void dispatch_layout(Layout layout, const float* x, int64_t m, int64_t k_len, const W* w, int64_t ld_w, int64_t n,
                     const float* scale, const float* bias, Act act, float* y) {
  if (layout == Layout::kRows) return linear_rows(x, m, k_len, w, n, scale, bias, act, y);
  if constexpr (std::is_same_v<W, float>) {
    if (layout == Layout::kKMajor) return linear_rows_k_major(x, m, k_len, w, ld_w, n, scale, bias, act, y);
  }
  PanelJob job;
  job.w = w;
  job.type = c10::CppTypeToScalarType<W>::value;
  job.n = n;
  job.scale = scale;
  job.bias = bias;
  job.act = act;
  job.y = y;
  run_panels(x, m, k_len, &job, 1);
}

// A group-wise job's scales and offsets (offset undefined: none), float32 or float16 (checked alike).
void set_group_scales(PanelJob& job, const Tensor& scale, const Tensor& offset) {
  if (scale.scalar_type() == at::kHalf) {
    job.half_scale = scale.data_ptr<c10::Half>();
    job.half_offset = offset.defined() ? offset.data_ptr<c10::Half>() : nullptr;
  } else {
    job.scale = scale.data_ptr<float>();
    job.offset = offset.defined() ? offset.data_ptr<float>() : nullptr;
  }
}

PanelJob grouped_job(const GroupedLinear& g, int64_t out_features, int64_t group_size, Act act, Tensor& y) {
  PanelJob job;
  job.w = g.weight.data_ptr();
  job.grouped = true;
  job.nibbles = g.nibbles;
  job.n = out_features;
  job.group_size = group_size;
  job.groups = g.groups;
  set_group_scales(job, g.scale, g.offset);
  job.bias = g.bias.defined() ? g.bias.data_ptr<float>() : nullptr;
  job.act = act;
  job.y = y.data_ptr<float>();
  return job;
}

// A dot-layout layer's tensors, checked against x [..., K] and made contiguous (linear_int8_dynamic's arguments).
struct DotLinear {
  bool nibbles;
  Tensor weight, scale, offset, sums, bias;
};

DotLinear check_dot_linear(const char* op, const Tensor& x, const Tensor& weight, const Tensor& scale_in,
                           const c10::optional<Tensor>& offset_in, const c10::optional<Tensor>& sums_in,
                           const c10::optional<Tensor>& bias_in, int64_t out_features, int64_t group_size) {
  const bool nibbles = weight.scalar_type() == at::kByte;
  const int64_t per_lane = lane_k(nibbles), bits = nibbles ? 4 : 8;
  TORCH_CHECK(group_size >= per_lane && group_size % per_lane == 0, op, ": group_size must be a positive multiple of ",
              per_lane, ", got ", group_size, " (int", bits, " weights)");
  const int64_t k_len = x.size(-1), lanes = (k_len + per_lane - 1) / per_lane;
  const int64_t groups = (k_len + group_size - 1) / group_size;
  TORCH_CHECK(weight.device() == x.device() && weight.dim() == 4 && weight.size(1) == lanes &&
                  weight.size(2) == kPanel && weight.size(3) == 4,
              op, ": 'weight' must be int8 [panels, ", (k_len + 3) / 4, ", ", kPanel, ", 4] or int4 as uint8 [panels, ",
              (k_len + 7) / 8, ", ", kPanel, ", 4] for in_features=", k_len, ", got ", weight.scalar_type(), " ",
              weight.sizes());
  TORCH_CHECK(nibbles || weight.scalar_type() == at::kChar, op, ": 'weight' must be int8 or uint8 (int4), got ",
              weight.scalar_type());
  TORCH_CHECK(nibbles != sums_in.has_value(), op,
              nibbles ? ": int4 weights take no 'sums' (their values are unsigned)"
                      : ": int8 weights need their 'sums'");
  TORCH_CHECK(!nibbles || offset_in.has_value(), op, ": int4 weights need their 'offset' (zero points)");
  const int64_t panels = weight.size(0);
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel, op,
              ": packed weights need out_features in (", (panels - 1) * kPanel, ", ", panels * kPanel, "], got ",
              out_features);
  const std::vector<int64_t> per_group{panels, groups, kPanel}, per_column{out_features};
  DotLinear out{nibbles, weight.contiguous(), {}, {}, {}, {}};
  const at::ScalarType scale_type = group_scale_type(scale_in);  // the offset's too
  for (auto [given, kept, name, shape, dtype] :
       {std::tuple{&scale_in, &out.scale, "scale", &per_group, scale_type},
        std::tuple{offset_in ? &*offset_in : nullptr, &out.offset, "offset", &per_group, scale_type},
        std::tuple{sums_in ? &*sums_in : nullptr, &out.sums, "sums", &per_group, at::kInt},
        std::tuple{bias_in ? &*bias_in : nullptr, &out.bias, "bias", &per_column, at::kFloat}}) {
    if (given == nullptr) continue;
    TORCH_CHECK(given->device() == x.device() && given->scalar_type() == dtype &&
                    given->sizes() == at::IntArrayRef(*shape),
                op, ": '", name, "' must be a ", dtype, " tensor of shape ", at::IntArrayRef(*shape), " on ",
                x.device(), ", got ", given->scalar_type(), " ", given->sizes(), " on ", given->device());
    *kept = given->contiguous();
  }
  return out;
}

// The job of a checked dot-layout layer; its ``rows`` (x rounded: quantize_for) are set by the caller.
PanelJob dot_job(const DotLinear& d, int64_t out_features, int64_t group_size, Act act, Tensor& y) {
  PanelJob job;
  job.w = d.weight.data_ptr();
  job.grouped = true;
  job.nibbles = d.nibbles;
  job.kernel = dot_kernel();
  job.n = out_features;
  job.group_size = group_size;
  job.groups = d.scale.size(1);
  set_group_scales(job, d.scale, d.offset);
  job.sums = d.sums.defined() ? d.sums.data_ptr<int32_t>() : nullptr;
  job.bias = d.bias.defined() ? d.bias.data_ptr<float>() : nullptr;
  job.act = act;
  job.y = y.data_ptr<float>();
  return job;
}

}  // namespace

// Entry points (cpu_ops.h): the native decode step calls them directly, without the dispatcher.
// x: [..., K] float32. weight, float32 / bfloat16 / int8 (int8 with a per-output-channel scale [N]):
//   [N, K] row-major (nn.Linear); float32 [N, K] viewed from a contiguous [K, N] (Conv1D's weight.t());
//   or packed panels [ceil(N / 64), K, 64] with out_features = N. bias: [N] float32.
Tensor linear(const Tensor& x_in, const Tensor& weight_in, const c10::optional<Tensor>& scale_in,
              const c10::optional<Tensor>& bias_in, c10::string_view act_name, int64_t out_features) {
  constexpr const char* op = "lightgen.linear";
  const Act act = parse_act(op, act_name);
  const bool packed = weight_in.dim() == 3;
  {
    const Tensor& x = x_in;
    const Tensor& weight = weight_in;
    LG_CHECK_CPU(op, x);
    LG_CHECK_CPU(op, weight);
    TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": 'x' must be float32, got ", x.scalar_type());
    TORCH_CHECK(weight.dim() == 2 || (packed && weight.size(2) == kPanel), op,
                ": 'weight' must be [out_features, in_features] or packed [panels, in_features, ", kPanel, "], got ",
                weight.sizes());
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), op, ": 'x' must end in in_features=",
                weight.size(1), ", got ", x.sizes());
    TORCH_CHECK(!packed || (out_features > (weight.size(0) - 1) * kPanel && out_features <= weight.size(0) * kPanel),
                op, ": packed weights need out_features in (", (weight.size(0) - 1) * kPanel, ", ",
                weight.size(0) * kPanel, "], got ", out_features);
    TORCH_CHECK(packed || out_features < 0 || out_features == weight.size(0), op, ": out_features=", out_features,
                " does not match 'weight' ", weight.sizes());
    const auto wtype = weight.scalar_type();
    TORCH_CHECK(wtype == at::kFloat || wtype == at::kBFloat16 || wtype == at::kChar, op,
                ": 'weight' must be float32, bfloat16 or int8, got ", wtype);
    TORCH_CHECK(wtype != at::kChar || scale_in.has_value(), op,
                ": int8 weights need their per-output-channel 'scale'");
  }
  const int64_t n = packed ? out_features : weight_in.size(0), k_len = weight_in.size(1);
  const float* scale = nullptr;
  const float* bias = nullptr;
  Tensor scale_t, bias_t;
  for (auto [given, kept, ptr, name] : {std::tuple{&scale_in, &scale_t, &scale, "scale"},
                                        std::tuple{&bias_in, &bias_t, &bias, "bias"}}) {
    if (!given->has_value()) continue;
    const Tensor& t = given->value();
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == n, op,
                ": '", name, "' must be a float32 CPU tensor of shape [", n, "], got ", t.scalar_type(), " ",
                t.sizes());
    *kept = t.contiguous();
    *ptr = kept->data_ptr<float>();
  }
  const bool k_major = !packed && weight_in.scalar_type() == at::kFloat && weight_in.stride(0) == 1 && n > 1 &&
                       weight_in.stride(1) >= n;
  const Layout layout = packed ? Layout::kPacked : k_major ? Layout::kKMajor : Layout::kRows;
  Tensor weight = k_major ? weight_in : weight_in.contiguous();
  const int64_t ld_w = k_major ? weight.stride(1) : 0;
  Tensor x = x_in.contiguous();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  Tensor y = at::empty(out_sizes, x.options());
  const int64_t m = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  if (m == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (weight.scalar_type()) {
    case at::kFloat:
      dispatch_layout(layout, xp, m, k_len, weight.data_ptr<float>(), ld_w, n, scale, bias, act, yp);
      break;
    case at::kBFloat16:
      dispatch_layout(layout, xp, m, k_len, weight.data_ptr<c10::BFloat16>(), ld_w, n, scale, bias, act, yp);
      break;
    default: dispatch_layout(layout, xp, m, k_len, weight.data_ptr<int8_t>(), ld_w, n, scale, bias, act, yp); break;
  }
  return y;
}

// x: [..., K] float32. weight: group-wise quantized panels, int8 [P, K, 64] or int4 as uint8 [P, ceil(K / 2), 64]
// (two k per byte), P = ceil(out_features / 64). scale: float32 [P, G, 64], G = ceil(K / group_size).
// offset: float32 [P, G, 64] (with zero points) or None. bias: [out_features] float32.
Tensor linear_grouped(const Tensor& x_in, const Tensor& weight, const Tensor& scale,
                      const c10::optional<Tensor>& offset, const c10::optional<Tensor>& bias,
                      c10::string_view act_name, int64_t out_features, int64_t group_size) {
  constexpr const char* op = "lightgen.linear_grouped";
  const Act act = parse_act(op, act_name);
  LG_CHECK_CPU(op, x_in);
  const GroupedLinear g = check_grouped_linear(op, x_in, weight, scale, offset, bias, out_features, group_size, kPanel);
  auto out_sizes = g.x.sizes().vec();
  out_sizes.back() = out_features;
  Tensor y = at::empty(out_sizes, g.x.options());
  const int64_t m = c10::multiply_integers(g.x.sizes().slice(0, g.x.dim() - 1));
  if (m == 0) return y;
  const PanelJob job = grouped_job(g, out_features, group_size, act, y);
  run_panels(g.x.data_ptr<float>(), m, g.k_len, &job, 1);
  return y;
}

// Several layers of one input x [..., K] (q/k/v, gate/up) in one parallel loop: one fork/join instead of one each,
// and the threads share out all the panels at once (SmolLM2's k and v projections have 3 panels each, which two
// threads split 2:1). Each output equals the layer's own linear / linear_grouped / linear_int8_dynamic call bit for
// bit (int8 activations: x is rounded once for the layers of one kind and group size).
std::vector<Tensor> linear_panels(const Tensor& x_in, const std::vector<PanelLinear>& layers) {
  constexpr const char* op = "lightgen.linear_panels";
  LG_CHECK_CPU(op, x_in);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1, op, ": 'x' must be float32 [..., K], got ",
              x_in.scalar_type(), " ", x_in.sizes());
  const Tensor x = x_in.contiguous();
  const int64_t k_len = x.size(-1), m = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  std::vector<GroupedLinear> kept;  // the contiguous tensors the jobs point into
  std::vector<DotLinear> kept_dot;
  std::vector<QuantizedRows> rounded;  // x for the dot jobs, one per kind and group size
  kept.reserve(layers.size());
  kept_dot.reserve(layers.size());
  rounded.reserve(layers.size());
  std::vector<PanelJob> jobs;
  std::vector<bool> dot;  // per job: int8 activations
  std::vector<Tensor> outputs;
  for (const PanelLinear& layer : layers) {
    auto out_sizes = x.sizes().vec();
    out_sizes.back() = layer.out_features;
    outputs.push_back(at::empty(out_sizes, x.options()));
    dot.push_back(layer.dot.has_value());
    if (layer.dot) {
      TORCH_CHECK(layer.scale.has_value(), op, ": dot-layout weights need their 'scale'");
      kept_dot.push_back(check_dot_linear(op, x, *layer.dot, *layer.scale, layer.offset, layer.dot_sums, layer.bias,
                                          layer.out_features, layer.group_size));
      jobs.push_back(dot_job(kept_dot.back(), layer.out_features, layer.group_size, Act::kNone, outputs.back()));
      continue;
    }
    if (layer.group_size > 0) {
      TORCH_CHECK(layer.scale.has_value(), op, ": group-wise weights need their 'scale'");
      kept.push_back(check_grouped_linear(op, x, layer.weight, *layer.scale, layer.offset, layer.bias,
                                          layer.out_features, layer.group_size, kPanel));
      jobs.push_back(grouped_job(kept.back(), layer.out_features, layer.group_size, Act::kNone, outputs.back()));
      continue;
    }
    const Tensor& w = layer.weight;
    TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() == 3 && w.size(1) == k_len && w.size(2) == kPanel &&
                    (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
                op, ": 'weight' must be contiguous packed float32 or bfloat16 [panels, ", k_len, ", ", kPanel,
                "], got ", w.scalar_type(), " ", w.sizes());
    TORCH_CHECK(layer.out_features > (w.size(0) - 1) * kPanel && layer.out_features <= w.size(0) * kPanel, op,
                ": packed weights need out_features in (", (w.size(0) - 1) * kPanel, ", ", w.size(0) * kPanel,
                "], got ", layer.out_features);
    TORCH_CHECK(!layer.bias || (layer.bias->is_contiguous() && layer.bias->scalar_type() == at::kFloat &&
                                layer.bias->numel() == layer.out_features),
                op, ": 'bias' must be contiguous float32 [", layer.out_features, "]");
    PanelJob job;
    job.w = w.data_ptr();
    job.type = w.scalar_type();
    job.n = layer.out_features;
    job.bias = layer.bias ? layer.bias->data_ptr<float>() : nullptr;
    job.y = outputs.back().data_ptr<float>();
    jobs.push_back(job);
  }
  if (m == 0) return outputs;
  std::vector<std::pair<bool, int64_t>> rounded_as;  // (nibbles, group_size) of each of ``rounded``
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (!dot[j]) continue;
    const std::pair<bool, int64_t> kind{jobs[j].nibbles, jobs[j].group_size};
    auto same = std::find(rounded_as.begin(), rounded_as.end(), kind);
    if (same == rounded_as.end()) {
      rounded.push_back(quantize_for(jobs[j], x.data_ptr<float>(), m, k_len));
      same = rounded_as.insert(rounded_as.end(), kind);
    }
    jobs[j].rows = &rounded[same - rounded_as.begin()];
  }
  run_panels(x.data_ptr<float>(), m, k_len, jobs.data(), static_cast<int64_t>(jobs.size()));
  return outputs;
}


// x: [..., K] float32. weight (pack_int8_dot, P = ceil(out_features / 64), zero-padded): int8 [P, ceil(K / 4), 64, 4],
// 4 consecutive k of a column per 32-bit lane; or int4 as uint8 [P, ceil(K / 8), 64, 4], 8 consecutive k per lane
// (k0..k3 in its bytes' low nibbles, k4..k7 in the high ones). scale / offset: float32 [P, G, 64],
// G = ceil(K / group_size), as linear_grouped's (int4: offset required). sums: int8 only, int32 [P, G, 64], -128 x
// the sum of each group's q. group_size: a multiple of the k per lane.
Tensor linear_int8_dynamic(const Tensor& x_in, const Tensor& weight, const Tensor& scale,
                           const c10::optional<Tensor>& offset, const c10::optional<Tensor>& sums,
                           const c10::optional<Tensor>& bias, c10::string_view act_name, int64_t out_features,
                           int64_t group_size) {
  constexpr const char* op = "lightgen.linear_int8_dynamic";
  const Act act = parse_act(op, act_name);
  LG_CHECK_CPU(op, x_in);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1, op, ": 'x' must be float32 [..., in_features], got ",
              x_in.scalar_type(), " ", x_in.sizes());
  const DotLinear d = check_dot_linear(op, x_in, weight, scale, offset, sums, bias, out_features, group_size);
  const Tensor x = x_in.contiguous();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = out_features;
  Tensor y = at::empty(out_sizes, x.options());
  const int64_t m = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  if (m == 0) return y;
  PanelJob job = dot_job(d, out_features, group_size, act, y);
  const QuantizedRows rows = quantize_for(job, x.data_ptr<float>(), m, x.size(-1));
  job.rows = &rows;
  run_panels(x.data_ptr<float>(), m, x.size(-1), &job, 1);
  return y;
}
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("linear", &lightgen::linear);
  m.impl("linear_grouped", &lightgen::linear_grouped);
  m.impl("linear_int8_dynamic", &lightgen::linear_int8_dynamic);
}
