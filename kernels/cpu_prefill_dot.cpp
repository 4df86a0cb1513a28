// Prefill attention over bf16 q, K and V on CPUs with AVX512-BF16: the products in bf16 with
// fp32 sums (vdpbf16ps: two products per lane and instruction, twice the rate of fp32 FMAs),
// the softmax in fp32, its weights rounded to bf16 for the products with V (as GPU flash
// attention does). The tiles, tasks and softmax are cpu_prefill.cpp's (cpu_prefill.h).
#include "cpu_prefill.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace tierkv_prefill {

#if defined(__AVX512BF16__)
namespace {

static_assert(W == 16 && BK == 64 && C == 4, "the AVX-512 tile sizes");

inline uint32_t pair(const at::BFloat16* x) {  // x[0] in the low half, x[1] in the high
  uint32_t u;
  std::memcpy(&u, x, sizeof u);
  return u;
}

inline __m512 dot(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// One tile of keys [k0, k0 + BK) for R rows: q [R][D/2] pairs of dims, kt [D/2][BK] pairs of
// dims per key, vt [BK/2][D] pairs of keys per dim; state m, l [R] and o [R][D] (unnormalized).
template <int R>
void tile(const uint32_t* q, const int* lim, const uint32_t* kt, const uint32_t* vt, int D, int k0, float scale,
          float* m, float* l, float* o) {
  const int H = D / 2;
  alignas(64) float p[R][BK];  // scores, then softmax weights
  __m512 s[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) s[r][c] = _mm512_setzero_ps();
  for (int dp = 0; dp < H; ++dp) {
    __m512i b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_si512(kt + dp * BK + c * W);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(q[r * H + dp]));
      for (int c = 0; c < C; ++c) s[r][c] = dot(s[r][c], a, b[c]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);  // scaled here: q stays the exact bf16 input
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_store_ps(&p[r][c * W], _mm512_mul_ps(s[r][c], sc));
  float alpha[R];
  const int top = online_softmax<R>(p, lim, k0, m, l, alpha);
  alignas(64) uint32_t w[R][BK / 2];  // the weights as bf16, pairs of keys
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < BK / 32; ++c)
      _mm512_store_si512(&w[r][c * W], (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(&p[r][c * 32 + W]),
                                                                     _mm512_load_ps(&p[r][c * 32])));
  const int pairs = (top + 1) / 2;  // a masked key's weight is exactly 0
  for (int d0 = 0; d0 < D; d0 += C * W) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + c * W), _mm512_set1_ps(alpha[r]));
    for (int jp = 0; jp < pairs; ++jp) {
      __m512i b[C];
      for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_si512(vt + jp * D + d0 + c * W);
      for (int r = 0; r < R; ++r) {
        const __m512i a = _mm512_set1_epi32(static_cast<int>(w[r][jp]));
        for (int c = 0; c < C; ++c) acc[r][c] = dot(acc[r][c], a, b[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * D + d0 + c * W, acc[r][c]);
  }
}

using TileFn = void (*)(const uint32_t*, const int*, const uint32_t*, const uint32_t*, int, int, float, float*,
                        float*, float*);
constexpr TileFn kTile[NR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>};

struct Bf16Dot {
  using Elem = uint32_t;  // two bf16
  static int64_t elems(int D) { return int64_t(BK) * D / 2; }
  static int q_elems(int D) { return D / 2; }
  static void pack_k(const at::BFloat16* k, int64_t ks, int64_t n, int D, uint32_t* out) {
    const int64_t tiles = (n + BK - 1) / BK;
    for (int64_t t = 0; t < tiles; ++t)
      for (int j = 0; j < BK; ++j) {
        const int64_t key = t * BK + j;
        uint32_t* o = out + t * elems(D) + j;
        for (int dp = 0; dp < D / 2; ++dp) o[dp * BK] = key < n ? pair(k + key * ks + 2 * dp) : 0u;
      }
  }
  static void pack_v(const at::BFloat16* v, int64_t vs, int64_t n, int D, uint32_t* out) {
    const int64_t pairs = (n + BK - 1) / BK * BK / 2;
    for (int64_t jp = 0; jp < pairs; ++jp)
      for (int d = 0; d < D; ++d) {
        const int64_t j = 2 * jp;
        const uint32_t lo = j < n ? v[j * vs + d].x : 0u, hi = j + 1 < n ? v[(j + 1) * vs + d].x : 0u;
        out[jp * D + d] = lo | hi << 16;
      }
  }
  static void load_q(const at::BFloat16* src, int D, float, uint32_t* dst) {
    for (int dp = 0; dp < D / 2; ++dp) dst[dp] = pair(src + 2 * dp);
  }
  static void tile(int nr, const uint32_t* q, const int* lim, const uint32_t* kt, const uint32_t* vt, int D,
                   int k0, float scale, float* m, float* l, float* o) {
    kTile[nr](q, lim, kt, vt, D, k0, scale, m, l, o);
  }
};

}  // namespace

bool prefill_dot(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* pos, double scale,
                 at::Tensor& out) {
  drive<Bf16Dot, at::BFloat16>(q, k, v, pos, scale, out);
  return true;
}
#else
bool prefill_dot(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int64_t*, double, at::Tensor&) {
  return false;
}
#endif

}  // namespace tierkv_prefill
