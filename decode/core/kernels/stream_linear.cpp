// y = x @ W^T (+ bias) for a few rows of x, streaming each weight once (decode/core/kernels/stream.py says why).
//
// W [N, K] is packed once (in Python) as [ceil(N / 32), K, 32]: block b holds output columns 32b .. 32b + 31,
// k-major, so one block is one sequential read. Each thread takes whole blocks; within a block the rows of x go
// kRows at a time (12 with AVX-512, 3 with AVX2: as many accumulators as the registers hold; the block stays in
// L1/L2 for the next rows), each row keeping 32 float accumulators. 12, not 8: a tree round scores up to 12
// positions, and a second pass over every block (from L2) cost ~10% of such a forward (runs/diag/s12_ab.py: 9 / 11
// positions 66.4 / 69.5 ms → 60.4 / 62.2, 4 and 8 unchanged, the same bits: a row's sums do not depend on kRows).
// Summation over k: float32 fused multiply-adds in chunks of 64 steps, the chunks then added up.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;    // floats per vector register (zmm)
constexpr int64_t kRows = 12;  // rows of x per pass over a block: 24 accumulators of the 32 registers
#else
constexpr int kLanes = 8;     // AVX2: ymm
constexpr int64_t kRows = 3;  // 12 accumulators + 4 weight vectors = the 16 registers
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
constexpr int64_t kCols = 32;                // output columns per packed block
constexpr int kVecs = kCols / kLanes;        // vectors per block row
constexpr int64_t kPrefetch = 16;  // k steps ahead that the block's stream is prefetched
constexpr int64_t kChunk = 64;     // k steps summed apart before joining the totals (float32 rounding ~ stock's)

template <int R>
inline void block_rows(const float* __restrict x, int64_t K, const float* __restrict w, const float* bias,
                       float* __restrict y, int64_t ldy, int64_t cols) {
  vec total[R][kVecs];  // over the finished chunks of k
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) total[r][v] = (vec){};
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    vec acc[R][kVecs];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) acc[r][v] = (vec){};
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int64_t k = k0; k < k1; ++k) {
      const float* wk = w + k * kCols;
      __builtin_prefetch(wk + kPrefetch * kCols, 0, 3);
      __builtin_prefetch(wk + kPrefetch * kCols + 16, 0, 3);
      vec wv[kVecs];
      for (int v = 0; v < kVecs; ++v) __builtin_memcpy(&wv[v], wk + v * kLanes, sizeof(vec));
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * K + k];
        for (int v = 0; v < kVecs; ++v) acc[r][v] += xv * wv[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) total[r][v] += acc[r][v];
  }
  for (int r = 0; r < R; ++r) {
    float out[kCols];
    for (int v = 0; v < kVecs; ++v) __builtin_memcpy(out + v * kLanes, &total[r][v], sizeof(vec));
    float* yr = y + r * ldy;
    if (bias) {
      for (int64_t j = 0; j < cols; ++j) yr[j] = out[j] + bias[j];
    } else {
      for (int64_t j = 0; j < cols; ++j) yr[j] = out[j];
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t);
constexpr BlockFn kBlock[13] = {nullptr,          block_rows<1>,  block_rows<2>,  block_rows<3>, block_rows<4>,
                                block_rows<5>,    block_rows<6>,  block_rows<7>,  block_rows<8>, block_rows<9>,
                                block_rows<10>,   block_rows<11>, block_rows<12>};
static_assert(kRows < 13, "kBlock holds a block function per row count up to kRows");

at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "stream_linear: float32 CPU input only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous() &&
              packed.scalar_type() == at::kFloat, "stream_linear: packed must be [blocks, K, 32] float32");
  const int64_t K = x.size(-1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "stream_linear: x has ", K, " features, the weight ", packed.size(1));
  TORCH_CHECK(n > (blocks - 1) * kCols && n <= blocks * kCols, "stream_linear: n does not match the packing");
  const at::Tensor xc = x.contiguous();
  const int64_t M = K ? xc.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "stream_linear: bias must be [n] float32");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t col = b * kCols, cols = std::min(kCols, n - col);
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min(kRows, M - m);
        kBlock[rows](xp + m * K, K, wp + b * K * kCols, bp ? bp + col : nullptr, yp + m * n + col, n, cols);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(adaspec_stream, m) { m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(adaspec_stream, CPU, m) { m.impl("linear", &stream_linear); }
