// Small per-layer ops for CPUs, each one pass where torch takes a dozen small ops:
// - torch.ops.tierkv.rope: x [N, H, D] -> (x1*cos - x2*sin, x2*cos + x1*sin) in x's dtype, fp32
//   math, bit-identical to the torch expression in rope.py (and so to transformers in fp32):
//   each product and sum is rounded on its own, as torch's elementwise kernels do, so
//   contraction into FMAs is turned off for this file's code.
// - torch.ops.tierkv.write_kv: new K and V rows into the paged caches by slot (-1 skips).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace {

template <typename T>
void rotate_rows(const T* x, int64_t sn, int64_t sh, const float* cos, const float* sin, T* out,
                 int64_t n0, int64_t n1, int64_t h, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t n = n0; n < n1; ++n) {
    const float* c = cos + n * half;
    const float* s = sin + n * half;
    for (int64_t j = 0; j < h; ++j) {
      const T* xr = x + n * sn + j * sh;  // x may be a view (q, k split out of one projection)
      T* o = out + (n * h + j) * d;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(xr[i]), x2 = static_cast<float>(xr[i + half]);
        const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
        o[i] = static_cast<T>(a - b);
        o[i + half] = static_cast<T>(e + f);
      }
    }
  }
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1,
              "rope: x must be [N, H, D], D even, rows contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) * 2 == x.size(2) && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "rope: cos and sin must be contiguous float32 [N, D/2]");
  at::Tensor out = at::empty(x.sizes(), x.options());  // contiguous, whatever x's strides
  const int64_t n = x.size(0), h = x.size(1), d = x.size(2);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t sn = x.stride(0), sh = x.stride(1);
  auto go = [&](auto* xp, auto* op) {
    at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
      rotate_rows(xp, sn, sh, c, s, op, lo, hi, h, d);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: go(x.data_ptr<float>(), out.data_ptr<float>()); break;
    case at::kBFloat16: go(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: go(x.data_ptr<at::Half>(), out.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "rope: x must be float32, bfloat16 or float16");
  }
  return out;
}

// k, v [N, Hkv, D] (rows contiguous, any other strides) into caches [num_blocks, block_size,
// Hkv, D] of the same dtype at slots [N] (negative: skip). Every slot is checked before the
// first write, so a bad one changes nothing.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k.size(1) == k_cache.size(2) &&
                  k.size(2) == k_cache.size(3) && k.stride(2) == 1 && v.stride(2) == 1,
              "write_kv: k, v [N, Hkv, D] with contiguous rows; caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "write_kv: k, v and contiguous caches of one dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "write_kv: slots must be int64 [N]");
  const int64_t n = k.size(0), h = k.size(1), row = h * k.size(2), total = k_cache.size(0) * k_cache.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sl[i] < total, "write_kv: slot ", sl[i], " past the end of the cache");
  const int64_t bytes = k.size(2) * k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size();
  at::parallel_for(0, n, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      if (sl[i] < 0) continue;
      for (int64_t j = 0; j < h; ++j) {
        const int64_t dst = (sl[i] * row + j * k.size(2)) * es;
        std::memcpy(kc + dst, kp + (i * k.stride(0) + j * k.stride(1)) * es, bytes);
        std::memcpy(vc + dst, vp + (i * v.stride(0) + j * v.stride(1)) * es, bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierkv, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rope", c10::DispatchKey::CPU, &rope);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
}
