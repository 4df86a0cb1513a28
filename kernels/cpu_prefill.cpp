// Prefill attention for CPUs: queries at any positions over one sequence's contiguous K/V,
// causal by position (query i sees keys [0, min(pos[i] + 1, T))), fp32 math whatever the
// input dtype. Registered as torch.ops.tierkv.prefill_attention; kernels/cpu.py builds it.
//
// A flash-attention loop. K and V of each KV head are first converted to fp32 in the layouts
// the loops read (K transposed per tile of keys, so one vector holds a score of 16 keys), an
// O(T * D) pass. A task is (KV head, block of QB positions): its rows are the group's query
// heads at those positions. For each tile of keys, in L1 while every row block of the task
// uses it, NR rows at a time: scores as broadcast-FMA products, online softmax (fp32), then
// the weighted V. Vectors are GCC vector extensions of one register (16 floats on AVX-512,
// 8 on AVX2); the register blocks are sized to each ISA's register file.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace tierkv_vec;

#if defined(__AVX512F__)
constexpr int C = 4;  // vectors per register block row: 32 registers hold 4 x 4 accumulators
#else
constexpr int C = 2;  // AVX2: 2 vectors per register block row (NR x 2 accumulators)
#endif
constexpr int BK = 2 * C * W > 64 ? C * W : 2 * C * W;  // keys per tile: 32 or 64 (K and V tiles in L1)
#if defined(__AVX512F__)
constexpr int NR = 4;  // query rows per register block: 4 x 4 accumulators of AVX-512's 32 registers
#else
constexpr int NR = 6;  // AVX2: 6 x 2 accumulators, 2 key vectors and a broadcast in 16 (1.1-1.15x over 4)
#endif
constexpr int QB = 16;     // query positions per task
constexpr int kMaxD = 256;

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

// One KV head's K [T, D] (rows ks elements apart) as fp32 [tile][D][BK]; zero past T.
template <typename T>
void pack_k(const T* k, int64_t ks, int64_t n, int D, float* out) {
  const int64_t tiles = (n + BK - 1) / BK;
  for (int64_t t = 0; t < tiles; ++t)
    for (int j = 0; j < BK; ++j) {
      const int64_t key = t * BK + j;
      float* o = out + t * D * BK + j;
      for (int d = 0; d < D; ++d) o[d * BK] = key < n ? f32(k[key * ks + d]) : 0.f;
    }
}

// V [T, D] as fp32 rows; zero past T up to the last tile's end.
template <typename T>
void pack_v(const T* v, int64_t vs, int64_t n, int64_t rows, int D, float* out) {
  for (int64_t j = 0; j < rows; ++j)
    for (int d = 0; d < D; ++d) out[j * D + d] = j < n ? f32(v[j * vs + d]) : 0.f;
}

// One tile of keys [k0, k0 + BK) for R rows: q [R][D] (scaled), lim [R] keys visible, state
// m, l [R] and o [R][D] (unnormalized).
template <int R>
void tile(const float* q, const int* lim, const float* kt, const float* vt, int D, int k0, float* m,
          float* l, float* o) {
  alignas(64) float p[R][BK];  // scores, then softmax weights
  for (int j0 = 0; j0 < BK; j0 += C * W) {  // C vectors of keys at a time
    vfw s[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c] = vfw{};
    for (int d = 0; d < D; ++d) {
      vfw b[C];
      for (int c = 0; c < C; ++c) b[c] = loadw(kt + d * BK + j0 + c * W, nullptr);
      for (int r = 0; r < R; ++r) {
        const vfw a = q[r * D + d] - vfw{};  // a broadcast (x + 0 would keep an add: -0 + 0 is +0)
        for (int c = 0; c < C; ++c) s[r][c] += a * b[c];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) std::memcpy(&p[r][j0 + c * W], &s[r][c], sizeof(vfw));
  }
  float alpha[R];
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
  for (int d0 = 0; d0 < D; d0 += C * W) {  // C vectors of output columns at a time
    vfw acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = loadw(o + r * D + d0 + c * W, nullptr) * alpha[r];
    for (int j = 0; j < top; ++j) {
      vfw b[C];
      for (int c = 0; c < C; ++c) b[c] = loadw(vt + j * D + d0 + c * W, nullptr);
      for (int r = 0; r < R; ++r) {
        const vfw a = p[r][j] - vfw{};
        for (int c = 0; c < C; ++c) acc[r][c] += a * b[c];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) std::memcpy(o + r * D + d0 + c * W, &acc[r][c], sizeof(vfw));
  }
}

using TileFn = void (*)(const float*, const int*, const float*, const float*, int, int, float*, float*, float*);
constexpr TileFn kTile[7] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};  // by rows <= NR

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* pos, double scale,
         at::Tensor& out) {
  const int64_t nq = q.size(0), hq = q.size(1), hkv = k.size(1), n = k.size(0);
  const int D = static_cast<int>(q.size(2)), g = static_cast<int>(hq / hkv);
  const int64_t tiles = (n + BK - 1) / BK, kn = tiles * BK * D;
  std::vector<float> kp(hkv * kn), vp(hkv * kn);
  const T* qd = q.data_ptr<T>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, 2 * hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t hd = i / 2;
      if (i % 2 == 0) pack_k(kd + hd * k.stride(1), k.stride(0), n, D, kp.data() + hd * kn);
      else pack_v(vd + hd * v.stride(1), v.stride(0), n, tiles * BK, D, vp.data() + hd * kn);
    }
  });
  const int64_t blocks = (nq + QB - 1) / QB, tasks = hkv * blocks;
  // Later positions see more keys: the costliest tasks first, handed out dynamically.
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t hd = task % hkv, p0 = (tasks - 1 - task) / hkv * QB;
    const int rows = static_cast<int>(std::min<int64_t>(QB, nq - p0)) * g;  // (position, group head)
    std::vector<float> qf(rows * D), o(rows * D, 0.f), m(rows, -1e30f), l(rows, 0.f);
    std::vector<int> lim(rows);
    int top = 0;
    for (int r = 0; r < rows; ++r) {
      const int64_t p = p0 + r / g, head = hd * g + r % g;
      const T* src = qd + p * q.stride(0) + head * q.stride(1);
      for (int d = 0; d < D; ++d) qf[r * D + d] = f32(src[d]) * static_cast<float>(scale);
      lim[r] = static_cast<int>(std::min<int64_t>(pos[p] + 1, n));
      top = std::max(top, lim[r]);
    }
    const float* kh = kp.data() + hd * kn;
    const float* vh = vp.data() + hd * kn;
    for (int k0 = 0; k0 < top; k0 += BK)
      for (int r0 = 0; r0 < rows; r0 += NR) {
        const int nr = std::min(NR, rows - r0);
        if (*std::max_element(&lim[r0], &lim[r0] + nr) <= k0) continue;  // sees none of this tile
        kTile[nr](&qf[r0 * D], &lim[r0], kh + static_cast<int64_t>(k0) * D, vh + static_cast<int64_t>(k0) * D, D,
                  k0, &m[r0], &l[r0], &o[r0 * D]);
      }
    for (int r = 0; r < rows; ++r) {
      const int64_t p = p0 + r / g, head = hd * g + r % g;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // no visible key: zeros
      T* dst = od + (p * hq + head) * D;
      for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(o[r * D + d] * inv);
    }
  }
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& pos, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(2) == q.size(2),
              "prefill_attention: q [Nq, Hq, D], k and v [T, Hkv, D] expected");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "prefill_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) % (C * W) == 0 && q.size(2) <= kMaxD,
              "prefill_attention: head_dim must be a multiple of ", C * W, ", at most ", kMaxD);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "prefill_attention: q, k and v must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_attention: rows must be contiguous");
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == q.size(0) && pos.scalar_type() == at::kLong && pos.is_contiguous(),
              "prefill_attention: pos must be int64 [Nq]");
  TORCH_CHECK(k.size(0) < (int64_t(1) << 30), "prefill_attention: too many keys");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i) TORCH_CHECK(pp[i] >= 0, "prefill_attention: negative position");
  auto out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0 || k.size(0) == 0) return out.zero_();
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k, v, pp, scale, out); break;
    case at::kBFloat16: run<at::BFloat16>(q, k, v, pp, scale, out); break;
    default: TORCH_CHECK(false, "prefill_attention: q must be float32 or bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierkv, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor pos, float scale) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, &prefill_attention);
}
