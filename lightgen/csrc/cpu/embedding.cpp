// Token embedding lookup x scale + positional embedding lookup, in one pass.
#include <torch/library.h>
#include "../include/checks.h"
#include "../include/vec_math.h"

namespace lightgen {
namespace {

using at::Tensor;

constexpr const char* kOp = "lightgen.embedding";

void check_ids_in_range(const char* what, const Tensor& ids, int64_t limit) {
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < limit, kOp, ": ", what, " ", p[i], " at flat index ", i,
                " is outside the table [0, ", limit, ")");
}

// ids: int64 [...]; weight: [V, D]; pos_weight: [P, D]; positions: int64, same shape as ids. Returns [..., D].
Tensor embedding(const Tensor& ids_in, const Tensor& weight_in, double scale, const c10::optional<Tensor>& pos_weight_in,
                 const c10::optional<Tensor>& positions_in) {
  {
    const Tensor& ids = ids_in;
    const Tensor& weight = weight_in;
    LG_CHECK_CPU(kOp, ids);
    LG_CHECK_CPU(kOp, weight);
    LG_CHECK_FLOAT(kOp, weight);
    TORCH_CHECK(ids.scalar_type() == at::kLong, kOp, ": 'ids' must be int64, got ", ids.scalar_type());
    TORCH_CHECK(weight.dim() == 2, kOp, ": 'weight' must be [V, D], got ", weight.sizes());
  }
  TORCH_CHECK(pos_weight_in.has_value() == positions_in.has_value(), kOp,
              ": 'pos_weight' and 'positions' must be given together");
  const int64_t D = weight_in.size(1);
  Tensor ids = ids_in.contiguous();
  Tensor weight = weight_in.contiguous();
  check_ids_in_range("token id", ids, weight.size(0));
  Tensor pos_weight, positions;
  if (pos_weight_in) {
    pos_weight = *pos_weight_in;
    positions = *positions_in;
    LG_CHECK_CPU(kOp, pos_weight);
    LG_CHECK_CPU(kOp, positions);
    LG_CHECK_SAME_DTYPE(kOp, weight_in, pos_weight);
    TORCH_CHECK(pos_weight.dim() == 2 && pos_weight.size(1) == D, kOp, ": 'pos_weight' must be [P, ", D, "], got ",
                pos_weight.sizes());
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.sizes() == ids.sizes(), kOp,
                ": 'positions' must be int64 with the shape of 'ids' ", ids.sizes(), ", got ", positions.scalar_type(),
                " ", positions.sizes());
    pos_weight = pos_weight.contiguous();
    positions = positions.contiguous();
    check_ids_in_range("position", positions, pos_weight.size(0));
  }
  std::vector<int64_t> out_shape(ids.sizes().begin(), ids.sizes().end());
  out_shape.push_back(D);
  Tensor out = at::empty(out_shape, weight.options());
  const int64_t n = ids.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), kOp, [&] {
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const scalar_t* pw = pos_weight.defined() ? pos_weight.data_ptr<scalar_t>() : nullptr;
    const int64_t* idp = ids.data_ptr<int64_t>();
    const int64_t* pp = positions.defined() ? positions.data_ptr<int64_t>() : nullptr;
    scalar_t* o = out.data_ptr<scalar_t>();
    const float s = static_cast<float>(scale);
    at::parallel_for(0, n, row_grain(D), [&](int64_t begin, int64_t end) {
      std::vector<float> row(D);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* wr = w + idp[t] * D;
        // Round the scaled token embedding first, as the unfused `embed(x) * scale + pos` does.
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(static_cast<scalar_t>(static_cast<float>(wr[d]) * s));
        if (pw) {
          const scalar_t* pr = pw + pp[t] * D;
          for (int64_t d = 0; d < D; ++d) row[d] += static_cast<float>(pr[d]);
        }
        store_row(row.data(), o + t * D, D);
      }
    });
  });
  return out;
}

}  // namespace
}  // namespace lightgen

TORCH_LIBRARY_IMPL(lightgen, CPU, m) {
  m.impl("embedding", &lightgen::embedding);
}
