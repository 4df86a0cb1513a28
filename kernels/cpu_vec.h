// Vectors of 16 floats for the CPU kernels (GCC vector extensions: one AVX-512 register,
// two AVX2 ones on older CPUs): loads that widen cache rows to fp32, exp, and the shuffle
// reductions. Included by cpu_attention.cpp and cpu_layer.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace tierkv_vec {

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));

constexpr int L = 16;          // lanes: floats per vector, tokens per tile
constexpr float kInf = std::numeric_limits<float>::infinity();

inline vf16 splat(float x) { return vf16{} + x; }

// 16 elements of a cache row or of q as fp32 (unaligned loads).
inline vf16 load16(const float* p, const float*) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf16 load16(const at::BFloat16* p, const float*) {  // bf16 is the top half of an fp32
  vu16 u;
  std::memcpy(&u, p, sizeof u);
  return (vf16)(__builtin_convertvector(u, vi16) << 16);
}
inline vf16 load16(const at::Half* p, const float*) {
  vf16 v;
  for (int i = 0; i < L; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
// fp8 e4m3 as raw bytes: a 256-entry table made by torch itself, so the decoding is exact.
inline vf16 load16(const uint8_t* p, const float* lut) {
  vf16 v;
  for (int i = 0; i < L; ++i) v[i] = lut[p[i]];
  return v;
}

template <typename T>
inline void store(const float* s, T* d, int n) {
  for (int i = 0; i < n; ++i) d[i] = static_cast<T>(s[i]);
}

// The widest vector of floats the target does in one register: prefill attention's
// register blocks use it (GCC splits a vf16 on AVX2 into halves that it often spills).
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
template <typename V, typename VI>
inline V vexp_n(V x) {
  const V lo = V{} - 87.f, hi = V{} + 88.f;
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const V n = (xc * 1.44269504089f + 12582912.f) - 12582912.f;  // round to nearest
  const V r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  return x < lo ? V{} : p * (V)e;
}
inline vf16 vexp(vf16 x) { return vexp_n<vf16, vi16>(x); }

// x[t] holds 16 partial products of token t's score; lane t of the result is their sum.
// Four shuffle-add stages, each halving the vectors and the lanes per token.
__attribute__((always_inline)) inline vf16 sum_rows(vf16* x) {
  const vi16 a1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi16 b1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi16 a2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi16 b2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi16 a3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi16 b3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vi16 a4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi16 b4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const vi16* masks[4][2] = {{&a1, &b1}, {&a2, &b2}, {&a3, &b3}, {&a4, &b4}};
  for (int stage = 0, n = L; stage < 4; ++stage, n /= 2)
    for (int j = 0; j < n / 2; ++j)
      x[j] = __builtin_shuffle(x[2 * j], x[2 * j + 1], *masks[stage][0]) +
             __builtin_shuffle(x[2 * j], x[2 * j + 1], *masks[stage][1]);
  return x[0];
}

// All 16 lanes of v combined by op (max or +) in four shuffle steps.
template <typename Op>
inline float reduce(vf16 v, Op op) {
  const vi16 r8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const vi16 r4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const vi16 r2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const vi16 r1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  v = op(v, __builtin_shuffle(v, r8));
  v = op(v, __builtin_shuffle(v, r4));
  v = op(v, __builtin_shuffle(v, r2));
  v = op(v, __builtin_shuffle(v, r1));
  return v[0];
}

}  // namespace tierkv_vec
