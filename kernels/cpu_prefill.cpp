// Prefill attention for CPUs: queries at any positions over one sequence's contiguous K/V,
// causal by position (query i sees keys [0, min(pos[i] + 1, T))), fp32 math whatever the
// input dtype. Registered as torch.ops.tierkv.prefill_attention; kernels/cpu.py builds it.
//
// A flash-attention loop (the driver in cpu_prefill.h). K and V of each KV head are first
// converted to fp32 in the layouts the loops read (K transposed per tile of keys, so one
// vector holds a score of 16 keys), an O(T * D) pass. For each tile of keys, NR rows at a
// time: scores as broadcast-FMA products, online softmax (fp32), then the weighted V. Vectors
// are GCC vector extensions of one register (16 floats on AVX-512, 8 on AVX2); the register
// blocks are sized to each ISA's register file. bf16 inputs on a CPU with AVX512-BF16 take
// cpu_prefill_dot.cpp instead (bf16 products, fp32 sums).
#include <torch/library.h>

#include "cpu_prefill.h"

namespace {

using namespace tierkv_prefill;

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

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
  const int top = online_softmax<R>(p, lim, k0, m, l, alpha);
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

// fp32 math: K as fp32 [tile][D][BK] (one vector: a score of W keys), V as fp32 rows.
template <typename T>
struct Fp32 {
  using Elem = float;
  static int64_t elems(int D) { return int64_t(BK) * D; }
  static int q_elems(int D) { return D; }
  static void pack_k(const T* k, int64_t ks, int64_t n, int D, float* out) {
    const int64_t tiles = (n + BK - 1) / BK;
    for (int64_t t = 0; t < tiles; ++t)
      for (int j = 0; j < BK; ++j) {
        const int64_t key = t * BK + j;
        float* o = out + t * D * BK + j;
        for (int d = 0; d < D; ++d) o[d * BK] = key < n ? f32(k[key * ks + d]) : 0.f;
      }
  }
  static void pack_v(const T* v, int64_t vs, int64_t n, int D, float* out) {
    const int64_t rows = (n + BK - 1) / BK * BK;
    for (int64_t j = 0; j < rows; ++j)
      for (int d = 0; d < D; ++d) out[j * D + d] = j < n ? f32(v[j * vs + d]) : 0.f;
  }
  static void load_q(const T* src, int D, float scale, float* dst) {
    for (int d = 0; d < D; ++d) dst[d] = f32(src[d]) * scale;
  }
  static void tile(int nr, const float* q, const int* lim, const float* kt, const float* vt, int D, int k0,
                   float, float* m, float* l, float* o) {
    kTile[nr](q, lim, kt, vt, D, k0, m, l, o);
  }
};

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
    case at::kFloat: drive<Fp32<float>, float>(q, k, v, pp, scale, out); break;
    case at::kBFloat16:
      if (!prefill_dot(q, k, v, pp, scale, out)) drive<Fp32<at::BFloat16>, at::BFloat16>(q, k, v, pp, scale, out);
      break;
    default: TORCH_CHECK(false, "prefill_attention: q must be float32 or bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierkv, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor pos, float scale) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, &prefill_attention);
}
