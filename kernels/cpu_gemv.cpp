// Few-row linear layers over bf16 weights for CPUs without a native bf16 GEMM
// (torch.ops.tierkv.gemv_bf16; kernels/layer_ops.py dispatches to it). A decode step reads
// every weight once for a handful of rows, so it is bound by memory: reading the bf16 weights
// (2 bytes each) beats torch's fp32 GEMM over the widened copy (4 bytes each). Each product
// is computed in fp32 (weights widened in registers, x as fp32) and rounded to x's dtype:
// the math of a bf16 GEMM with fp32 accumulation, in another summation order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace tierkv_vec;

constexpr int NB = 4;  // weight rows per register block
constexpr int MB = 2;  // x rows per register block: 4 x 2 accumulators fit AVX2's 16 registers

// out[j][n + i] (j < R rows of x, i < C weight rows) = x[j] . w[n + i] (+ bias), K % W == 0.
// x and out in the caller's dtype (fp32 or bf16): widened in registers, each sum rounded once.
template <int C, int R, typename T>
void block(const at::BFloat16* w, const T* x, int64_t K, const float* bias, int64_t n, T* out,
           int64_t N) {
  vfw acc[C][R];
  for (int i = 0; i < C; ++i)
    for (int j = 0; j < R; ++j) acc[i][j] = vfw{};
  for (int64_t k = 0; k < K; k += W) {
    vfw wv[C];
    if (k % 32 == 0)  // one prefetch per cache line of the next block's rows, a few KB ahead
      for (int i = 0; i < C; ++i) __builtin_prefetch(w + (n + i + C) * K + k);
    for (int i = 0; i < C; ++i) wv[i] = loadw(w + (n + i) * K + k, nullptr);
    for (int j = 0; j < R; ++j) {
      const vfw xv = loadw(x + j * K + k, nullptr);
      for (int i = 0; i < C; ++i) acc[i][j] += wv[i] * xv;
    }
  }
  for (int i = 0; i < C; ++i)
    for (int j = 0; j < R; ++j)
      out[j * N + n + i] = static_cast<T>(reduce_w(acc[i][j], [](vfw a, vfw b) { return a + b; }) + (bias ? bias[n + i] : 0.f));
}

template <int C, typename T>
void rows(const at::BFloat16* w, const T* x, int64_t M, int64_t K, const float* bias, int64_t n, T* out,
          int64_t N) {
  int64_t j = 0;
  for (; j + MB <= M; j += MB) block<C, MB>(w, x + j * K, K, bias, n, out + j * N, N);
  if (j < M) block<C, 1>(w, x + j * K, K, bias, n, out + j * N, N);
}

#if defined(__AVX512BF16__)
// bf16 x on CPUs with AVX512-BF16: vdpbf16ps takes 32 weights and 32 of x as they are (two
// products per lane, summed in fp32), half the instructions of widening both to fp32, so
// steps of up to DOT_ROWS rows stay bound by reading the weights. A block is 4 weight rows x 4
// rows of x: its 16 accumulators reduce in one transposed pass (sum_rows_w), lane i * 4 + j.
constexpr int DB = 4;

inline __m512i load32(const at::BFloat16* p) { return _mm512_loadu_si512(p); }

template <int CN, int RM>  // weight rows, rows of x: compile-time, so the accumulators stay in registers
void dot_block(const at::BFloat16* w, const at::BFloat16* x, int64_t K, const float* bias, int64_t n,
               at::BFloat16* out, int64_t N) {
  vfw acc[DB * DB] = {};
  for (int64_t k = 0; k < K; k += 32) {
    __m512i wv[CN];
    for (int i = 0; i < CN; ++i) __builtin_prefetch(w + (n + i + 4 * DB) * K + k);  // each line, 16 rows ahead
    for (int i = 0; i < CN; ++i) wv[i] = load32(w + (n + i) * K + k);
    for (int j = 0; j < RM; ++j) {
      const __m512bh xv = (__m512bh)load32(x + j * K + k);
      for (int i = 0; i < CN; ++i) acc[i * DB + j] = (vfw)_mm512_dpbf16_ps((__m512)acc[i * DB + j], (__m512bh)wv[i], xv);
    }
  }
  const vfw sum = sum_rows_w(acc);
  for (int i = 0; i < CN; ++i)
    for (int j = 0; j < RM; ++j)
      out[j * N + n + i] = static_cast<at::BFloat16>(sum[i * DB + j] + (bias ? bias[n + i] : 0.f));
}

using DotFn = void (*)(const at::BFloat16*, const at::BFloat16*, int64_t, const float*, int64_t, at::BFloat16*,
                       int64_t);
template <int CN>
constexpr DotFn kDotRow[DB] = {dot_block<CN, 1>, dot_block<CN, 2>, dot_block<CN, 3>, dot_block<CN, 4>};
constexpr const DotFn* kDot[DB] = {kDotRow<1>, kDotRow<2>, kDotRow<3>, kDotRow<4>};  // [CN - 1][RM - 1]

bool gemv_dot(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (x.scalar_type() != at::kBFloat16 || K % 32 != 0) return false;
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, (N + DB - 1) / DB, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t cn = std::min<int64_t>(DB, N - b * DB);
      for (int64_t j = 0; j < M; j += DB)  // the weight block stays in L1 across the row blocks
        kDot[cn - 1][std::min<int64_t>(DB, M - j) - 1](wp, xp + j * K, K, bias, b * DB, op + j * N, N);
    }
  });
  return true;
}
#else
bool gemv_dot(const at::Tensor&, const at::Tensor&, const float*, at::Tensor&) { return false; }
#endif

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: x [M, K] and w [N, K] expected");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "gemv_bf16: w must be contiguous bfloat16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "gemv_bf16: x must be bf16 or fp32");
  TORCH_CHECK(w.size(1) % W == 0, "gemv_bf16: K must be a multiple of ", W);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "gemv_bf16: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  // x and the result stay in x's dtype: no conversion ops around the kernel (a decode step
  // runs 4 linear layers per layer, so two extra ops each were ~0.5 ms per token).
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (gemv_dot(xc, w, bp, out)) return out;
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  auto go = [&](const auto* xp, auto* op) {
    const int64_t blocks = N / NB;
    at::parallel_for(0, blocks, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) rows<NB>(wp, xp, M, K, bp, i * NB, op, N);
    });
    for (int64_t n = blocks * NB; n < N; ++n) rows<1>(wp, xp, M, K, bp, n, op, N);
  };
  if (x.scalar_type() == at::kFloat)
    go(xc.data_ptr<float>(), out.data_ptr<float>());
  else
    go(xc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierkv, m) {
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("gemv_bf16", c10::DispatchKey::CPU, &gemv_bf16);
}
