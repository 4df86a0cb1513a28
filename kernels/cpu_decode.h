// What the CPU decode attention's two inner loops share, and the fp32 loop itself (fp32 math over
// any cache dtype; cpu_attention_dot.cpp: bf16 products on CPUs with AVX512-BF16). Used by the
// plain decode op (cpu_attention.cpp) and the cascade decode op (cpu_cascade.cpp), with the
// log-sum-exp merge of their runs' partial states.
#pragma once

#include <ATen/ATen.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tierkv_decode {

using namespace tierkv_vec;

struct Partial {  // online-softmax state of one (task, KV head): running max, sum, weighted V
  float* m;   // [G]
  float* l;   // [G]
  vfw* acc;  // [G * D / W], dims in order
};

constexpr int kAhead = 4;  // blocks prefetched ahead

// Empty online-softmax state for hkv heads of G query rows, C vectors each.
inline void reset(Partial* p, int hkv, int G, int C) {
  for (int h = 0; h < hkv; ++h) {
    std::fill(p[h].m, p[h].m + G, -tierkv_vec::kInf);
    std::fill(p[h].l, p[h].l + G, 0.f);
    std::fill(p[h].acc, p[h].acc + G * C, vfw{});
  }
}

// Keys [k0, k1) of a sequence in tiles of at most L tokens, none across a block (bs tokens; the
// sequence's block ids in blocks; rows `row` elements apart): f(at, next, n) with the offset of
// the tile's first row, the same row kAhead blocks later (-1 past k1; blocks sit at random
// places, so the hardware prefetcher cannot guess the next one) and its token count.
template <int L, typename F>
inline void walk_tiles(const int64_t* blocks, int64_t k0, int64_t k1, int bs, int64_t row, F&& f) {
  for (int64_t start = k0; start < k1;) {
    const int64_t ahead = (start / bs + kAhead) * bs;  // a valid block id while < k1
    const int64_t next = ahead < k1 ? (blocks[ahead / bs] * bs + start % bs) * row : -1;
    const int n = int(std::min<int64_t>({L, bs - start % bs, k1 - start}));
    f((blocks[start / bs] * bs + start % bs) * row, next, n);
    start += n;
  }
}

// Vectors of one register: W floats (16 on AVX-512, 8 on AVX2, where GCC splits a 16-float
// vector into halves it spills), and tiles of W tokens.
using V = vfw;
constexpr int L = W;
constexpr int kMaxC = 256 / L;  // head_dim / L
constexpr int kMaxG = 16;  // query heads per KV head

// Storage of the Partials, per calling thread and reused across calls: a fresh multi-MiB
// buffer per layer call would cost more in page faults than the attention itself.
struct Workspace {
  std::vector<float> ml;
  std::vector<V> acc;
  std::vector<Partial> parts;

  Partial* get(size_t n, int G, int C) {
    if (ml.size() < n * 2 * G) ml.resize(n * 2 * G);
    if (acc.size() < n * G * C) acc.resize(n * G * C);
    parts.resize(n);
    for (size_t i = 0; i < n; ++i) parts[i] = {&ml[i * 2 * G], &ml[i * 2 * G + G], &acc[i * G * C]};
    return parts.data();
  }
};

// n <= L tokens of one KV head (rows at k and v, `row` elements apart) into p. q is
// [G, C] vectors, already scaled. k_next/v_next: the same rows kAhead blocks later, prefetched
// one row per token (a burst of a whole block's prefetches at once was dropped, measured).
// CT: C known at compile time (0: take the argument), so the common head dims get fully
// unrolled row loops; FULL: n == L (every tile of a full
// block), so the token loops unroll too.
template <int CT, bool FULL, typename T>
void attend_tile(const V* q, int G, int C_, const T* k, const T* v, const T* k_next, const T* v_next,
                 int64_t row, int n_, const float* lut, Partial& p) {
  const int C = CT ? CT : C_;
  const int n = FULL ? L : n_;
  V x[kMaxG][L], kr[kMaxC], vr[L][kMaxC];
  for (int t = 0; t < n; ++t) {
    for (int o = 0; o < C * L * int(sizeof(T)); o += 64) {  // a row of a later block, into L2
      __builtin_prefetch(reinterpret_cast<const char*>(k_next + t * row) + o, 0, 2);
      __builtin_prefetch(reinterpret_cast<const char*>(v_next + t * row) + o, 0, 2);
    }
    for (int c = 0; c < C; ++c) kr[c] = loadw(k + t * row + c * L, lut);
    for (int g = 0; g < G; ++g) {
      V a = q[g * C] * kr[0];
      for (int c = 1; c < C; ++c) a += q[g * C + c] * kr[c];
      x[g][t] = a;
    }
  }
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < C; ++c) vr[t][c] = loadw(v + t * row + c * L, lut);
  viw lane;
  for (int i = 0; i < L; ++i) lane[i] = i;
  for (int g = 0; g < G; ++g) {
    if (!FULL)
      for (int t = n; t < L; ++t) x[g][t] = V{};
    V s = sum_rows_w(x[g]);
    if (!FULL) s = lane < n ? s : (V{} - kInf);
    const float mx = std::max(p.m[g], reduce_w(s, [](V a, V b) { return a > b ? a : b; }));
    alignas(64) float w[L];
    const V e = vexp(s - mx);
    std::memcpy(w, &e, sizeof e);
    const float corr = std::exp(p.m[g] - mx);  // the first tile: exp(-inf) = 0
    p.l[g] = p.l[g] * corr + reduce_w(e, [](V a, V b) { return a + b; });
    p.m[g] = mx;
    for (int c = 0; c < C; ++c) {
      V a = p.acc[g * C + c] * corr;
      for (int t = 0; t < n; ++t) a += w[t] * vr[t][c];
      p.acc[g * C + c] = a;
    }
  }
}

// Keys [k0, k1) of one sequence, every KV head, into p[0..hkv); q is [hkv * G, C] vectors.
// Each tile prefetches its rows' counterparts kAhead blocks later (walk_tiles).
template <int CT, typename T>
void attend(const V* q, int G, int C, int hkv, const T* kc, const T* vc, const int64_t* blocks,
            int64_t k0, int64_t k1, int bs, const float* lut, Partial* p) {
  reset(p, hkv, G, C);
  const int64_t row = int64_t(hkv) * C * L;  // elements between tokens of a block
  walk_tiles<L>(blocks, k0, k1, bs, row, [&](int64_t base, int64_t next, int n) {
    for (int h = 0; h < hkv; ++h) {
      const int64_t at = base + h * C * L, nat = next < 0 ? at : next + h * C * L;  // no later block: the tile
      if (n == L)
        attend_tile<CT, true>(q + h * G * C, G, C, kc + at, vc + at, kc + nat, vc + nat, row, n, lut, p[h]);
      else
        attend_tile<CT, false>(q + h * G * C, G, C, kc + at, vc + at, kc + nat, vc + nat, row, n, lut, p[h]);
    }
  });
}

// One query row's output from the online-softmax states of its runs of keys, merged by
// log-sum-exp: each(f) calls f(partial, row) for every run, row being the query row's place in
// that partial. Runs with no keys add nothing; no keys at all give zeros. vscale: the V scale
// (fp8 caches) or 1, folded into the final 1 / l.
template <typename O, typename Each>
inline void merge_row(Each&& each, int C, int D, float vscale, O* dst) {
  V o[kMaxC];
  float mx = -kInf, l = 0.f;
  each([&](const Partial& p, int r) { mx = std::max(mx, p.m[r]); });
  std::fill(o, o + C, V{});
  if (mx > -kInf)
    each([&](const Partial& p, int r) {
      if (p.l[r] == 0.f) return;  // a run with no keys
      const float c = std::exp(p.m[r] - mx);
      l += p.l[r] * c;
      for (int cc = 0; cc < C; ++cc) o[cc] += p.acc[r * C + cc] * c;
    });
  const float f = l > 0.f ? vscale / l : 0.f;
  alignas(64) float flat[kMaxC * L];
  for (int cc = 0; cc < C; ++cc) std::memcpy(flat + cc * L, &o[cc], sizeof(V));
  for (int d = 0; d < D; ++d) flat[d] *= f;
  store(flat, dst, D);
}

// Keys [k0, k1) of one sequence, every KV head, into p[0..hkv) (whose state is reset first):
// q [hkv * G, D] bf16, unscaled; bf16 caches [nb, bs, hkv, D]; blocks the sequence's block ids.
// The products in bf16 with fp32 sums, the softmax in fp32, its weights rounded to bf16 for the
// products with V. False (nothing written) where this build has no AVX512-BF16 or G and D are
// not among the compiled ones: the caller then runs the fp32 loop.
bool attend_dot(const at::BFloat16* q, int G, int D, int hkv, const at::BFloat16* kc, const at::BFloat16* vc,
                const int64_t* blocks, int64_t k0, int64_t k1, int bs, float scale, Partial* p);

// True where attend_dot serves G query rows per KV head of head_dim D on this build.
bool dot_fits(int G, int D);

// paged_decode's argument checks (cpu_attention.cpp): shapes, dtypes, contiguity, fp8 extras;
// undefined ks, vs, lt where the cache is not fp8.
void check_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ids,
                  const at::Tensor& seen, const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& lt,
                  int64_t chunk);

}  // namespace tierkv_decode
