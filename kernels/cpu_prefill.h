// The part of the CPU prefill attention that its two inner loops share (cpu_prefill.cpp: fp32
// math; cpu_prefill_dot.cpp: bf16 products on CPUs with AVX512-BF16): tile sizes, the online
// softmax of one tile's scores, and the driver that packs K and V and hands out the tasks.
//
// A Path supplies: Elem (the packed element type), elems(D) (Elems of K or V per tile of BK
// keys), q_elems(D) (Elems of one query row), pack_k / pack_v (one KV head into its tiles,
// zero past T), load_q (one query row; fp32 pre-scales it) and tile(nr, ...) (one tile of
// keys for nr <= NR rows).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tierkv_prefill {

using namespace tierkv_vec;

#if defined(__AVX512F__)
constexpr int C = 4;  // vectors per register block row: 32 registers hold 4 x 4 accumulators
constexpr int NR = 4;  // query rows per register block
#else
constexpr int C = 2;  // AVX2: 2 vectors per register block row (NR x 2 accumulators)
constexpr int NR = 6;  // 6 x 2 accumulators, 2 key vectors and a broadcast in 16 (1.1-1.15x over 4)
#endif
constexpr int BK = 2 * C * W > 64 ? C * W : 2 * C * W;  // keys per tile: 32 or 64 (K and V tiles in L1)
constexpr int QB = 16;  // query positions per task
constexpr int kMaxD = 256;

// Scores p [R][BK] of keys [k0, k0 + BK) -> softmax weights in place (masked keys exactly 0),
// the running max m and sum l of each row updated and alpha [R] the factor that rescales its
// output so far. Returns how many keys of the tile any row sees.
template <int R>
inline int online_softmax(float (*p)[BK], const int* lim, int k0, float* m, float* l, float* alpha) {
  viw lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  const vfw ninf = vfw{} - kInf;
  int top = 0;
  for (int r = 0; r < R; ++r) {
    vfw mx = ninf, sv[BK / W];
    for (int c = 0; c < BK / W; ++c) {
      sv[c] = loadw(&p[r][c * W], nullptr);
      const int valid = lim[r] - k0 - c * W;  // keys of this vector the row sees
      if (valid < W) sv[c] = lane < valid ? sv[c] : ninf;
      mx = mx > sv[c] ? mx : sv[c];
    }
    const float mn = std::max(m[r], reduce_w(mx, [](vfw a, vfw b) { return a > b ? a : b; }));
    alpha[r] = mn == m[r] ? 1.f : std::exp(m[r] - mn);  // 0 at the first visible tile (m = -1e30)
    vfw sum{};
    for (int c = 0; c < BK / W; ++c) {
      const vfw e = vexp(sv[c] - mn);  // masked lanes: exactly 0
      sum += e;
      std::memcpy(&p[r][c * W], &e, sizeof e);
    }
    l[r] = l[r] * alpha[r] + reduce_w(sum, [](vfw a, vfw b) { return a + b; });
    m[r] = mn;
    top = std::max(top, std::min(BK, lim[r] - k0));
  }
  return top;
}

// q [Nq, Hq, D], k/v [T, Hkv, D] (rows contiguous), pos [Nq] -> out. A task is (KV head, block
// of QB positions): its rows are the group's query heads at those positions; each tile of keys
// serves every register block of the task's rows while it is in L1.
template <typename Path, typename T>
void drive(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* pos, double scale,
           at::Tensor& out) {
  using E = typename Path::Elem;
  const int64_t nq = q.size(0), hq = q.size(1), hkv = k.size(1), n = k.size(0);
  const int D = static_cast<int>(q.size(2)), g = static_cast<int>(hq / hkv);
  const int64_t tiles = (n + BK - 1) / BK, te = Path::elems(D), kn = tiles * te;
  std::vector<E> kp(hkv * kn), vp(hkv * kn);
  const T* qd = q.data_ptr<T>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, 2 * hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t hd = i / 2;
      if (i % 2 == 0) Path::pack_k(kd + hd * k.stride(1), k.stride(0), n, D, kp.data() + hd * kn);
      else Path::pack_v(vd + hd * v.stride(1), v.stride(0), n, D, vp.data() + hd * kn);
    }
  });
  const int64_t blocks = (nq + QB - 1) / QB, tasks = hkv * blocks;
  const int qe = Path::q_elems(D);
  // Later positions see more keys: the costliest tasks first, handed out dynamically.
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t hd = task % hkv, p0 = (tasks - 1 - task) / hkv * QB;
    const int rows = static_cast<int>(std::min<int64_t>(QB, nq - p0)) * g;  // (position, group head)
    std::vector<E> qf(rows * qe);
    std::vector<float> o(rows * D, 0.f), m(rows, -1e30f), l(rows, 0.f);
    std::vector<int> lim(rows);
    int top = 0;
    for (int r = 0; r < rows; ++r) {
      const int64_t p = p0 + r / g, head = hd * g + r % g;
      Path::load_q(qd + p * q.stride(0) + head * q.stride(1), D, static_cast<float>(scale), &qf[r * qe]);
      lim[r] = static_cast<int>(std::min<int64_t>(pos[p] + 1, n));
      top = std::max(top, lim[r]);
    }
    const E* kh = kp.data() + hd * kn;
    const E* vh = vp.data() + hd * kn;
    for (int k0 = 0; k0 < top; k0 += BK)
      for (int r0 = 0; r0 < rows; r0 += NR) {
        const int nr = std::min(NR, rows - r0);
        if (*std::max_element(&lim[r0], &lim[r0] + nr) <= k0) continue;  // sees none of this tile
        const int64_t at = k0 / BK * te;
        Path::tile(nr, &qf[r0 * qe], &lim[r0], kh + at, vh + at, D, k0, static_cast<float>(scale), &m[r0],
                   &l[r0], &o[r0 * D]);
      }
    for (int r = 0; r < rows; ++r) {
      const int64_t p = p0 + r / g, head = hd * g + r % g;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // no visible key: zeros
      T* dst = od + (p * hq + head) * D;
      for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(o[r * D + d] * inv);
    }
  }
}

// The bf16 path of cpu_prefill_dot.cpp (AVX512-BF16 only): false where this build has none.
bool prefill_dot(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* pos,
                 double scale, at::Tensor& out);

}  // namespace tierkv_prefill
