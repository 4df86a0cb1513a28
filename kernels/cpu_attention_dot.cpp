// Paged decode attention over a bf16 cache on CPUs with AVX512-BF16 (vdpbf16ps: two bf16
// products per lane and instruction, summed in fp32): the K and V rows are used as they lie in
// the cache, with no widening to fp32. Scores: each K row times the query's pairs of dims, the
// 16 partial sums of a tile's tokens reduced in one transposed pass. Weighted V: two tokens'
// rows interleaved into pairs of tokens per dim, times the weights' pairs (rounded to bf16).
// The tasks, the merge of their runs and the fp32 loop are cpu_attention.cpp's.
#include "cpu_decode.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tierkv_decode {

#if defined(__AVX512BF16__)
namespace {

using namespace tierkv_vec;

constexpr int L = 16;      // tokens per tile

inline __m512 dot(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// Index vectors for vpermt2w: (a[d], b[d]) pairs for d in [0, 16) and in [16, 32).
struct Pairs {
  __m512i lo, hi;
  Pairs() {
    alignas(64) uint16_t l[32], h[32];
    for (int i = 0; i < 16; ++i) l[2 * i] = i, l[2 * i + 1] = 32 + i, h[2 * i] = 16 + i, h[2 * i + 1] = 48 + i;
    lo = _mm512_load_si512(l);
    hi = _mm512_load_si512(h);
  }
};

// n <= L tokens of one KV head (rows `row` elements apart) into p; q [G][C2] vectors of 32 dims.
template <int G, int C2>
void tile(const __m512i* q, const at::BFloat16* k, const at::BFloat16* v, const at::BFloat16* k_next,
          const at::BFloat16* v_next, int64_t row, int n, float scale, const Pairs& pr, Partial& p) {
  vfw x[G][L];
  for (int t = 0; t < n; ++t) {
    for (int o = 0; o < C2 * 64; o += 64) {  // a row of a later block, into L2
      __builtin_prefetch(reinterpret_cast<const char*>(k_next + t * row) + o, 0, 2);
      __builtin_prefetch(reinterpret_cast<const char*>(v_next + t * row) + o, 0, 2);
    }
    __m512i kr[C2];
    for (int c = 0; c < C2; ++c) kr[c] = _mm512_loadu_si512(k + t * row + c * 32);
    for (int g = 0; g < G; ++g) {
      __m512 a = dot(_mm512_setzero_ps(), kr[0], q[g * C2]);
      for (int c = 1; c < C2; ++c) a = dot(a, kr[c], q[g * C2 + c]);
      x[g][t] = (vfw)a;
    }
  }
  viw lane;
  for (int i = 0; i < L; ++i) lane[i] = i;
  alignas(64) uint32_t w[G][L / 2];  // the weights as bf16, pairs of tokens
  float corr[G];
  for (int g = 0; g < G; ++g) {
    for (int t = n; t < L; ++t) x[g][t] = vfw{};
    vfw s = sum_rows_w(x[g]) * scale;
    s = lane < n ? s : (vfw{} - kInf);
    const float mx = std::max(p.m[g], reduce_w(s, [](vfw a, vfw b) { return a > b ? a : b; }));
    const vfw e = vexp(s - mx);
    corr[g] = std::exp(p.m[g] - mx);  // the first tile: exp(-inf) = 0
    p.l[g] = p.l[g] * corr[g] + reduce_w(e, [](vfw a, vfw b) { return a + b; });
    p.m[g] = mx;
    const __m512i eb = (__m512i)_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), (__m512)e);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w[g]), _mm512_castsi512_si256(eb));
  }
  __m512 acc[G][2 * C2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * C2; ++c) acc[g][c] = (__m512)(p.acc[g * 2 * C2 + c] * corr[g]);
  for (int j = 0; 2 * j < n; ++j) {
    const at::BFloat16* a = v + 2 * j * row;
    __m512i lo[C2], hi[C2];
    for (int c = 0; c < C2; ++c) {
      const __m512i ra = _mm512_loadu_si512(a + c * 32);
      const __m512i rb = 2 * j + 1 < n ? _mm512_loadu_si512(a + row + c * 32) : _mm512_setzero_si512();
      lo[c] = _mm512_permutex2var_epi16(ra, pr.lo, rb);
      hi[c] = _mm512_permutex2var_epi16(ra, pr.hi, rb);
    }
    for (int g = 0; g < G; ++g) {
      const __m512i wg = _mm512_set1_epi32(static_cast<int>(w[g][j]));
      for (int c = 0; c < C2; ++c) {
        acc[g][2 * c] = dot(acc[g][2 * c], lo[c], wg);
        acc[g][2 * c + 1] = dot(acc[g][2 * c + 1], hi[c], wg);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * C2; ++c) p.acc[g * 2 * C2 + c] = (vfw)acc[g][c];
}

template <int G, int C2>
void attend(const at::BFloat16* qp, int hkv, const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* blocks,
            int64_t k0, int64_t k1, int bs, float scale, Partial* p) {
  static const Pairs pr;
  constexpr int D = C2 * 32;
  __m512i q[G * C2];
  reset(p, hkv, G, 2 * C2);
  const int64_t row = int64_t(hkv) * D;  // elements between tokens of a block
  walk_tiles<L>(blocks, k0, k1, bs, row, [&](int64_t base, int64_t next, int n) {
    for (int h = 0; h < hkv; ++h) {
      for (int i = 0; i < G * C2; ++i) q[i] = _mm512_loadu_si512(qp + (h * G + i / C2) * D + i % C2 * 32);
      const int64_t at = base + h * D, nat = next < 0 ? at : next + h * D;  // no later block: the tile
      tile<G, C2>(q, kc + at, vc + at, kc + nat, vc + nat, row, n, scale, pr, p[h]);
    }
  });
}

using AttendFn = void (*)(const at::BFloat16*, int, const at::BFloat16*, const at::BFloat16*, const int64_t*,
                          int64_t, int64_t, int, float, Partial*);
template <int C2>
constexpr AttendFn kByG[8] = {attend<1, C2>, attend<2, C2>, attend<3, C2>, attend<4, C2>,
                              attend<5, C2>, attend<6, C2>, attend<7, C2>, attend<8, C2>};

}  // namespace

bool dot_fits(int G, int D) { return G >= 1 && G <= 8 && (D == 64 || D == 128); }

bool attend_dot(const at::BFloat16* q, int G, int D, int hkv, const at::BFloat16* kc, const at::BFloat16* vc,
                const int64_t* blocks, int64_t k0, int64_t k1, int bs, float scale, Partial* p) {
  if (!dot_fits(G, D)) return false;
  (D == 64 ? kByG<2> : kByG<4>)[G - 1](q, hkv, kc, vc, blocks, k0, k1, bs, scale, p);
  return true;
}
#else
bool dot_fits(int, int) { return false; }

bool attend_dot(const at::BFloat16*, int, int, int, const at::BFloat16*, const at::BFloat16*, const int64_t*, int64_t,
                int64_t, int, float, Partial*) {
  return false;
}
#endif

}  // namespace tierkv_decode
