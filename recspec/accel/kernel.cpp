// recspec's small-row product on x86-64 CPUs with AVX2 and FMA: y = x W^T + b for x of 1..128 rows.
//
// The weight [out, in] is kept once in panels of 16 output columns, [ceil(out / 16), in, 16]: a panel
// is one contiguous run of memory, read from start to end. Each thread takes a contiguous range of
// panels, so the whole weight is streamed once, in order, whatever the row count. Within a panel,
// groups of up to 6 rows are computed by a 6 x 16 register tile (12 accumulators); the panel stays
// in L1/L2 between the groups of one call, so only the first group reads it from memory.
//
// Every output element is one chain of fused multiply-adds over k = 0..in-1 in order, then the bias:
// a row's output does not depend on which or how many rows share its call, nor on the columns beside
// it (sibling projections concatenated give the bits of each one apart).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;   // output columns per panel: two 8-float registers
constexpr int64_t kTile = 6;     // rows per register tile: 6 x 2 accumulators of 16 registers
constexpr int64_t kAhead = 32;   // panel lines (64 bytes each) prefetched ahead of the one in use

template <int R>
inline void tile(const float* x, int64_t in, const float* panel, const float* bias, float* y, int64_t out,
                 int64_t cols) {
  __m256 low[R], high[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    low[r] = _mm256_setzero_ps();
    high[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < in; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAhead) * kPanel), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_broadcast_ss(x + r * in + k);
      low[r] = _mm256_fmadd_ps(v, w0, low[r]);
      high[r] = _mm256_fmadd_ps(v, w1, high[r]);
    }
  }
  alignas(32) float shift[kPanel] = {0};
  if (bias != nullptr) std::copy(bias, bias + cols, shift);
  const __m256 b0 = _mm256_load_ps(shift), b1 = _mm256_load_ps(shift + 8);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 s0 = _mm256_add_ps(low[r], b0), s1 = _mm256_add_ps(high[r], b1);
    if (cols == kPanel) {
      _mm256_storeu_ps(y + r * out, s0);
      _mm256_storeu_ps(y + r * out + 8, s1);
    } else {
      alignas(32) float row[kPanel];
      _mm256_store_ps(row, s0);
      _mm256_store_ps(row + 8, s1);
      std::copy(row, row + cols, y + r * out);
    }
  }
}

// One panel over all rows: tiles of 6 rows, the remainder in one smaller tile.
void panel_rows(int64_t rows, const float* x, int64_t in, const float* panel, const float* bias, float* y,
                int64_t out, int64_t cols) {
  int64_t m = 0;
  for (; m + kTile <= rows; m += kTile) tile<6>(x + m * in, in, panel, bias, y + m * out, out, cols);
  const float* xr = x + m * in;
  float* yr = y + m * out;
  switch (rows - m) {
    case 1: tile<1>(xr, in, panel, bias, yr, out, cols); break;
    case 2: tile<2>(xr, in, panel, bias, yr, out, cols); break;
    case 3: tile<3>(xr, in, panel, bias, yr, out, cols); break;
    case 4: tile<4>(xr, in, panel, bias, yr, out, cols); break;
    case 5: tile<5>(xr, in, panel, bias, yr, out, cols); break;
    default: break;
  }
}

// weight [out, in] -> panels [ceil(out / 16), in, 16], the columns past out zero.
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "recspec_rows::pack: a 2-D float32 CPU weight [out, in]");
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t panels = (out + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({panels, kPanel, in}).transpose(1, 2).contiguous();
}

// x [rows, in] (row-major), panels from pack, out the weight's output width, bias [out] or none.
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, int64_t out, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "recspec_rows::linear: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kFloat &&
                  panels.size(1) == x.size(1) && panels.size(2) == kPanel && panels.size(0) * kPanel >= out &&
                  panels.size(0) * kPanel < out + kPanel,
              "recspec_rows::linear: panels do not match x and out (make them with recspec_rows::pack)");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "recspec_rows::linear: bias must be a contiguous float32 [out]");
  }
  const int64_t rows = x.size(0), in = x.size(1), count = panels.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t cols = std::min(kPanel, out - j * kPanel);
      panel_rows(rows, xp, in, pp + j * in * kPanel, bp == nullptr ? nullptr : bp + j * kPanel, yp + j * kPanel,
                 out, cols);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(recspec_rows, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor panels, int out, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(recspec_rows, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
