// The model's per-layer elementwise ops for CPUs, one vectorized pass each (torch runs 4-7
// ops over the whole batch); kernels/layer_ops.py dispatches to them:
// - torch.ops.tierkv.rms_norm: HF's RMSNorm order (fp32 statistics, cast, then the weight);
//   within fp32 rounding of torch (the sum of squares is added in another order).
// - torch.ops.tierkv.silu_mul: [N, 2I] -> silu(first half) * second half, rounded as torch
//   rounds its two ops; exp is cpu_vec.h's (about 1 ulp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <cmath>
#include <cstring>

namespace {

// Vectors of one register (16 floats on AVX-512, 8 on AVX2).
constexpr int L = tierkv_vec::W;
using tierkv_vec::loadw;
using V = tierkv_vec::vfw;
using VI = tierkv_vec::viw;
using VU = tierkv_vec::vuw;

// L floats rounded to T and back (bf16: to nearest even, NaN kept), and stored as T.
inline V round_to(V v, const float*) { return v; }
inline V round_to(V v, const at::BFloat16*) {
  const VI b = (VI)v;
  const VI r = (b + 0x7FFF + ((b >> 16) & 1)) & int32_t(0xFFFF0000);
  return v != v ? v : (V)r;
}
inline void storew(V v, float* p) { std::memcpy(p, &v, sizeof v); }
inline void storew(V v, at::BFloat16* p) {
  const VU h = __builtin_convertvector((VI)round_to(v, p) >> 16, VU);
  std::memcpy(p, &h, sizeof h);
}
template <typename T>
float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }

template <typename T>
void norm_rows(const T* x, int64_t sx, const T* w, T* out, int64_t n0, int64_t n1, int64_t d, float eps) {
  const int64_t dv = d / L * L;
  for (int64_t n = n0; n < n1; ++n) {
    const T* xr = x + n * sx;
    V acc = V{};
    for (int64_t i = 0; i < dv; i += L) {
      const V f = loadw(xr + i, nullptr);
      acc += f * f;
    }
    float sum = tierkv_vec::reduce_w(acc, [](V a, V b) { return a + b; });
    for (int64_t i = dv; i < d; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float r = 1.f / std::sqrt(sum / float(d) + eps);
    T* o = out + n * d;
    for (int64_t i = 0; i < dv; i += L)
      storew(loadw(w + i, nullptr) * round_to(loadw(xr + i, nullptr) * r, xr), o + i);
    for (int64_t i = dv; i < d; ++i) o[i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(static_cast<float>(xr[i]) * r));
  }
}

// x [N, D] (rows contiguous), weight [D] of x's dtype -> weight * (x * rsqrt(mean(x^2) + eps)).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
                  w.scalar_type() == x.scalar_type(),
              "rms_norm: x [N, D] with contiguous rows, weight [D] of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(0), d = x.size(1), sx = x.stride(0);
  auto go = [&](auto* xp, auto* wp, auto* op) {
    at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) { norm_rows(xp, sx, wp, op, lo, hi, d, float(eps)); });
  };
  switch (x.scalar_type()) {
    case at::kFloat: go(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>()); break;
    case at::kBFloat16: go(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>()); break;
    default: TORCH_CHECK(false, "rms_norm: x must be float32 or bfloat16");
  }
  return out;
}

template <typename T>
void silu_mul_rows(const T* x, int64_t sx, T* out, int64_t n0, int64_t n1, int64_t h) {
  const int64_t hv = h / L * L;
  for (int64_t n = n0; n < n1; ++n) {
    const T* g = x + n * sx;
    const T* u = g + h;
    T* o = out + n * h;
    for (int64_t i = 0; i < hv; i += L) {
      const V gv = loadw(g + i, nullptr);
      storew(round_to(gv / (tierkv_vec::vexp(-gv) + 1.f), g) * loadw(u + i, nullptr), o + i);
    }
    for (int64_t i = hv; i < h; ++i) {
      const float gi = static_cast<float>(g[i]);
      o[i] = static_cast<T>(rnd<T>(gi / (1.f + std::exp(-gi))) * static_cast<float>(u[i]));
    }
  }
}

// x [N, 2H] (rows contiguous: a fused gate/up projection) -> silu(x[:, :H]) * x[:, H:].
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1, "silu_mul: x [N, 2H] with contiguous rows");
  const int64_t n = x.size(0), h = x.size(1) / 2, sx = x.stride(0);
  at::Tensor out = at::empty({n, h}, x.options());
  auto go = [&](auto* xp, auto* op) {
    at::parallel_for(0, n, 8, [&](int64_t lo, int64_t hi) { silu_mul_rows(xp, sx, op, lo, hi, h); });
  };
  switch (x.scalar_type()) {
    case at::kFloat: go(x.data_ptr<float>(), out.data_ptr<float>()); break;
    case at::kBFloat16: go(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>()); break;
    default: TORCH_CHECK(false, "silu_mul: x must be float32 or bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierkv, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("silu_mul(Tensor x) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
}
