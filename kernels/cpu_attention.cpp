// Paged decode attention for CPUs: one query per sequence, keys read in place from the
// paged cache (no gather), fp32 math, online softmax in tiles of W tokens
// (16 on AVX-512, 8 on AVX2). Registered as
// torch.ops.tierkv.paged_decode; kernels/cpu_attention.py builds and loads it.
//
// Work is split over (sequence, run of keys): a task walks its blocks once, each K and V row
// serving every query head of its KV head's group, so the cache is read once per step, as
// a dense SDPA over pre-gathered KV would. Math is in GCC vector extensions of one register
// (16 floats on AVX-512, 8 on AVX2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_decode.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using namespace tierkv_vec;
using namespace tierkv_decode;

template <typename T, typename O>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ids,
         const at::Tensor& seen, double scale, const at::Tensor& ksc, const at::Tensor& vsc,
         const at::Tensor& lut, int64_t chunk, at::Tensor& out) {
  const int b = q.size(0), hq = q.size(1), D = q.size(2);
  const int bs = kc.size(1), hkv = kc.size(2);
  const int G = hq / hkv;
  const int64_t nblk = ids.size(1);
  const O* qp = q.data_ptr<O>();
  O* op = out.data_ptr<O>();
  const T* kp = reinterpret_cast<const T*>(kc.data_ptr());
  const T* vp = reinterpret_cast<const T*>(vc.data_ptr());
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* sp = seen.data_ptr<int64_t>();
  const float* ks = ksc.defined() ? ksc.data_ptr<float>() : nullptr;
  const float* vs = vsc.defined() ? vsc.data_ptr<float>() : nullptr;
  const float* lp = lut.defined() ? lut.data_ptr<float>() : nullptr;
  const int C = D / L;
  // Tasks: each sequence's keys in runs of `chunk`, so that tasks cost about the same and the
  // threads' equal shares of them stay balanced whatever the lengths (split-K for free when
  // a few long sequences would leave threads idle). first[i]: sequence i's first task.
  std::vector<int64_t> first(b + 1, 0);
  for (int i = 0; i < b; ++i) first[i + 1] = first[i] + std::max<int64_t>(1, (sp[i] + chunk - 1) / chunk);
  // Every task writes its own state before reading it.
  thread_local Workspace ws;
  Partial* parts = ws.get(size_t(first[b]) * hkv, G, C);
  at::parallel_for(0, first[b], 1, [&](int64_t lo, int64_t hi) {
    std::unique_ptr<V[]> qv(new V[size_t(hq) * C]);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t i = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      const int64_t len = sp[i];
      const int64_t k0 = std::min(len, (task - first[i]) * chunk), k1 = std::min(len, k0 + chunk);
      Partial* p = &parts[task * hkv];
      const int64_t* blocks = ip + i * nblk;
      if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<O, at::BFloat16>) {
        const auto* kb = reinterpret_cast<const at::BFloat16*>(kp);
        const auto* vb = reinterpret_cast<const at::BFloat16*>(vp);
        if (tierkv_decode::attend_dot(qp + i * hq * D, G, D, hkv, kb, vb, blocks, k0, k1, bs, float(scale), p))
          continue;
      }
      for (int hd = 0; hd < hq; ++hd) {
        const float f = float(scale) * (ks ? ks[hd / G] : 1.f);  // the K scale folds into q
        for (int c = 0; c < C; ++c) qv[hd * C + c] = loadw(qp + (i * hq + hd) * D + c * L, nullptr) * f;
      }
      switch (C) {  // head dims 64 and 128 unrolled
        case 64 / L: attend<64 / L, T>(qv.get(), G, C, hkv, kp, vp, blocks, k0, k1, bs, lp, p); break;
        case 128 / L: attend<128 / L, T>(qv.get(), G, C, hkv, kp, vp, blocks, k0, k1, bs, lp, p); break;
        default: attend<0, T>(qv.get(), G, C, hkv, kp, vp, blocks, k0, k1, bs, lp, p);
      }
    }
  });
  // Merge the runs of each (sequence, head) by log-sum-exp; no keys -> zeros.
  at::parallel_for(0, int64_t(b) * hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t i = bh / hkv, h = bh % hkv;
      const Partial* ps = &parts[first[i] * hkv + h];  // run j at ps[j * hkv]
      const int64_t splits = first[i + 1] - first[i];
      for (int g = 0; g < G; ++g) {
        auto each = [&](auto&& f) {
          for (int64_t j = 0; j < splits; ++j) f(ps[j * hkv], g);
        };
        merge_row(each, C, D, vs ? vs[h] : 1.f, op + (i * hq + h * G + g) * D);
      }
    }
  });
}

template <typename O>
void by_cache(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ids,
              const at::Tensor& seen, double scale, const at::Tensor& ks, const at::Tensor& vs,
              const at::Tensor& lut, int64_t chunk, at::Tensor& out) {
  if (lut.defined())
    run<uint8_t, O>(q, kc, vc, ids, seen, scale, ks, vs, lut, chunk, out);
  else
    run<O, O>(q, kc, vc, ids, seen, scale, ks, vs, lut, chunk, out);
}

}  // namespace

namespace tierkv_decode {

void check_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ids,
                  const at::Tensor& seen, const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& lt,
                  int64_t chunk) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(3) == q.size(2) &&
                  q.size(1) % kc.size(2) == 0,
              "paged_decode: q [b, Hq, D], caches [num_blocks, block_size, Hkv, D] with Hq a multiple of Hkv");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= L * kMaxC && q.size(1) / kc.size(2) <= kMaxG,
              "paged_decode: head_dim a multiple of 16 up to 256, GQA group <= 16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == q.size(0) && seen.dim() == 1 && seen.size(0) == q.size(0) &&
                  ids.scalar_type() == at::kLong && seen.scalar_type() == at::kLong,
              "paged_decode: ids [b, nblk] and seen [b] must be int64");
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous() && ids.is_contiguous() &&
                  seen.is_contiguous() && chunk >= 1,
              "paged_decode: contiguous tensors and chunk >= 1");
  const bool fp8 = lt.defined();
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() && kc.scalar_type() == (fp8 ? at::kByte : q.scalar_type()),
              "paged_decode: caches in q's dtype, or uint8 (fp8 bytes) with a lut");
  TORCH_CHECK(!fp8 || (lt.numel() == 256 && lt.scalar_type() == at::kFloat && ks.defined() && vs.defined() &&
                       ks.numel() == kc.size(2) && vs.numel() == kc.size(2) && ks.scalar_type() == at::kFloat &&
                       vs.scalar_type() == at::kFloat && ks.is_contiguous() && vs.is_contiguous()),
              "paged_decode: fp8 caches need a float lut [256] and float k/v scales [Hkv]");
}

}  // namespace tierkv_decode

namespace {

// q [b, Hq, D]; k/v cache [nb, bs, Hkv, D] in q's dtype, or uint8 (fp8 bytes) with lut [256]
// and per-head scales; ids [b, nblk] int64 valid block ids; seen [b] int64 keys visible to
// each query (a prefix of its blocks). The caller (cpu_attention.py) checks all of this.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ids,
                        const at::Tensor& seen, double scale, const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale, const c10::optional<at::Tensor>& lut,
                        int64_t chunk) {
  at::Tensor ks = k_scale.value_or(at::Tensor()), vs = v_scale.value_or(at::Tensor());
  at::Tensor lt = lut.value_or(at::Tensor());
  check_decode(q, kc, vc, ids, seen, ks, vs, lt, chunk);
  at::Tensor out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: by_cache<float>(q, kc, vc, ids, seen, scale, ks, vs, lt, chunk, out); break;
    case at::kBFloat16: by_cache<at::BFloat16>(q, kc, vc, ids, seen, scale, ks, vs, lt, chunk, out); break;
    case at::kHalf: by_cache<at::Half>(q, kc, vc, ids, seen, scale, ks, vs, lt, chunk, out); break;
    default: TORCH_CHECK(false, "paged_decode: q must be float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tierkv, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor ids, Tensor seen, float scale, "
        "Tensor? k_scale, Tensor? v_scale, Tensor? lut, int chunk) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
}
