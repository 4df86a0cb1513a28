// Vectors of one register for the CPU kernels (GCC vector extensions: W = 16 floats on
// AVX-512, 8 on AVX2; GCC splits a wider vector into halves that it spills): loads that widen
// cache rows to fp32, exp, and the shuffle reductions. Included by the cpu_*.cpp kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace tierkv_vec {

constexpr float kInf = std::numeric_limits<float>::infinity();

template <typename T>
inline void store(const float* s, T* d, int n) {
  for (int i = 0; i < n; ++i) d[i] = static_cast<T>(s[i]);
}

// The widest vector of floats the target does in one register.
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vfw __attribute__((vector_size(W * 4)));
typedef int32_t viw __attribute__((vector_size(W * 4)));
typedef uint16_t vuw __attribute__((vector_size(W * 2)));

// W elements of a cache row or of q as fp32 (unaligned loads).
inline vfw loadw(const float* p, const float*) {
  vfw v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vfw loadw(const at::BFloat16* p, const float*) {
  vuw u;
  std::memcpy(&u, p, sizeof u);
  return (vfw)(__builtin_convertvector(u, viw) << 16);
}
inline vfw loadw(const at::Half* p, const float*) {
  vfw v;
  for (int i = 0; i < W; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline vfw loadw(const uint8_t* p, const float* lut) {
  vfw v;
  for (int i = 0; i < W; ++i) v[i] = lut[p[i]];
  return v;
}

// All W lanes of v combined by op (a vector max or +), in log2(W) shuffle steps.
template <typename Op>
inline float reduce_w(vfw v, Op op) {
#if defined(__AVX512F__)
  const viw r[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                    {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                    {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
  for (int i = 0; i < 4; ++i) v = op(v, __builtin_shuffle(v, r[i]));
#else
  const viw r[3] = {{4, 5, 6, 7, 0, 1, 2, 3}, {2, 3, 0, 1, 6, 7, 4, 5}, {1, 0, 3, 2, 5, 4, 7, 6}};
  for (int i = 0; i < 3; ++i) v = op(v, __builtin_shuffle(v, r[i]));
#endif
  return v[0];
}

// x[t] holds W partial products of token t's score; lane t of the result is their sum.
// log2(W) shuffle-add stages, each halving the vectors and the lanes per token.
__attribute__((always_inline)) inline vfw sum_rows_w(vfw* x) {
#if defined(__AVX512F__)
  constexpr int S = 4;
  const viw m[S][2] = {
      {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
      {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}, {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
      {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}, {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
      {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}, {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}}};
#else
  constexpr int S = 3;
  const viw m[S][2] = {{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}},
                       {{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}},
                       {{0, 2, 4, 6, 8, 10, 12, 14}, {1, 3, 5, 7, 9, 11, 13, 15}}};
#endif
  for (int stage = 0, n = W; stage < S; ++stage, n /= 2)
    for (int j = 0; j < n / 2; ++j)
      x[j] = __builtin_shuffle(x[2 * j], x[2 * j + 1], m[stage][0]) + __builtin_shuffle(x[2 * j], x[2 * j + 1], m[stage][1]);
  return x[0];
}

// exp of a vector: Cephes' expf polynomial (about 1 ulp); exactly 0 below -87 (masked lanes).
inline vfw vexp(vfw x) {
  const vfw lo = vfw{} - 87.f, hi = vfw{} + 88.f;
  vfw xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vfw n = (xc * 1.44269504089f + 12582912.f) - 12582912.f;  // round to nearest
  const vfw r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  vfw p = vfw{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const viw e = (__builtin_convertvector(n, viw) + 127) << 23;
  return x < lo ? vfw{} : p * (vfw)e;
}

}  // namespace tierkv_vec
