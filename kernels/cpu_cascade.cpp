// Cascade decode attention for CPUs: decode sequences that share their first blocks (the prefix
// cache gives them the same block ids) attend over those shared keys once per step, all their
// query heads stacked as the rows of one pass, and over their own suffixes one by one; the
// online-softmax states of the two parts (running max m, sum l, weighted V acc) are merged by
// log-sum-exp, which is exact: the result is the plain decode's up to fp32 summation order.
// Registered as torch.ops.tierkv.paged_decode_cascade; kernels/cpu.py builds and loads it.
//
// A K/V row of a shared block serves G query heads of each sequence of a sub-group: up to
// kMaxG / G sequences in the fp32 loop, kDotRows / G where a bf16 cache takes the bf16 products
// of cpu_attention_dot.cpp (as the plain decode does: G <= 8, head_dim 64 or 128, AVX512-BF16);
// a group of more sequences is cut into sub-groups, each reading the shared blocks once. Suffix
// keys take the plain decode's path. Tasks (runs of keys) are taken by the threads in turn.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_decode.h"
#include "cpu_vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using namespace tierkv_vec;
using namespace tierkv_decode;

constexpr int kDotRows = 8;  // most query rows of the bf16 products (cpu_attention_dot.cpp)
constexpr int64_t kMinSharedRun = 64;  // keys: shorter shared runs cost more in merging than they save

struct Task {  // keys [k0, k1) of block table `lead`, for one sequence (sub < 0) or a sub-group
  int64_t k0, k1, lead, sub;
};

template <typename T>
void attend_any(const V* q, int G, int C, int hkv, const T* kc, const T* vc, const int64_t* blocks, int64_t k0,
                int64_t k1, int bs, const float* lut, Partial* p) {
  switch (C) {  // head dims 64 and 128 unrolled
    case 64 / L: attend<64 / L, T>(q, G, C, hkv, kc, vc, blocks, k0, k1, bs, lut, p); break;
    case 128 / L: attend<128 / L, T>(q, G, C, hkv, kc, vc, blocks, k0, k1, bs, lut, p); break;
    default: attend<0, T>(q, G, C, hkv, kc, vc, blocks, k0, k1, bs, lut, p);
  }
}

// members [M]: each group's sequences in a run, starts [ng + 1] the runs, shared [ng] the keys
// [0, shared[g]) every member of group g reads through the same block ids.
template <typename T, typename O>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ids,
         const at::Tensor& seen, double scale, const at::Tensor& ksc, const at::Tensor& vsc, const at::Tensor& lut,
         int64_t chunk, const at::Tensor& members, const at::Tensor& starts, const at::Tensor& shared,
         at::Tensor& out) {
  const int b = q.size(0), hq = q.size(1), D = q.size(2);
  const int bs = kc.size(1), hkv = kc.size(2);
  const int G = hq / hkv, C = D / L;
  // bf16 products where the plain decode has them (a stacked group of at most kDotRows rows),
  // else the fp32 loop's kMaxG rows: sequences per sub-group.
  constexpr bool bf16 = std::is_same_v<T, at::BFloat16> && std::is_same_v<O, at::BFloat16>;
  const bool dot = bf16 && G <= kDotRows && dot_fits(G, D);
  const int per = std::max(1, (dot ? kDotRows : kMaxG) / G);
  const int64_t nblk = ids.size(1), ng = shared.size(0);
  const O* qp = q.data_ptr<O>();
  O* op = out.data_ptr<O>();
  const T* kp = reinterpret_cast<const T*>(kc.data_ptr());
  const T* vp = reinterpret_cast<const T*>(vc.data_ptr());
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* sp = seen.data_ptr<int64_t>();
  const int64_t* mp = members.data_ptr<int64_t>();
  const int64_t* gp = starts.data_ptr<int64_t>();
  const int64_t* pp = shared.data_ptr<int64_t>();
  const float* ks = ksc.defined() ? ksc.data_ptr<float>() : nullptr;
  const float* vs = vsc.defined() ? vsc.data_ptr<float>() : nullptr;
  const float* lp = lut.defined() ? lut.data_ptr<float>() : nullptr;
  // Sub-groups (first member, count, shared keys), each sequence's sub-group and row in it.
  std::vector<int64_t> sub_of(b, -1), row_of(b, 0), sub_at, sub_n, sub_p, skip(b, 0);
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t a = gp[g]; a < gp[g + 1]; a += per) {
      sub_at.push_back(a), sub_n.push_back(std::min<int64_t>(per, gp[g + 1] - a)), sub_p.push_back(pp[g]);
      for (int64_t j = a; j < a + sub_n.back(); ++j) {
        sub_of[mp[j]] = int64_t(sub_at.size()) - 1, row_of[mp[j]] = j - a, skip[mp[j]] = pp[g];
      }
    }
  // Tasks: each sub-group's shared keys, then each sequence's own, in runs of `chunk` keys,
  // shared runs shorter by the sub-group's size: a task then costs about what one sequence's
  // run does (its rows times its keys).
  std::vector<Task> tasks;
  std::vector<int64_t> sub_first(sub_at.size() + 1), seq_first(b + 1);
  for (size_t s = 0; s < sub_at.size(); ++s) {
    sub_first[s] = tasks.size();
    const int64_t run = std::max<int64_t>(kMinSharedRun, chunk / sub_n[s]);
    for (int64_t k0 = 0; k0 < sub_p[s]; k0 += run)
      tasks.push_back({k0, std::min(sub_p[s], k0 + run), mp[sub_at[s]], int64_t(s)});
  }
  sub_first[sub_at.size()] = tasks.size();
  for (int i = 0; i < b; ++i) {
    seq_first[i] = tasks.size();
    int64_t k0 = skip[i];
    do tasks.push_back({k0, std::min(sp[i], k0 + chunk), i, -1});  // one at least, maybe empty
    while ((k0 += chunk) < sp[i]);
  }
  seq_first[b] = tasks.size();
  const int rows = std::max(G, per * G);
  thread_local Workspace ws;
  Partial* parts = ws.get(tasks.size() * hkv, rows, C);
  // Threads take tasks in turn (the shared ones, the largest, first): the tasks differ in cost,
  // and a static split could give one thread every shared run.
  std::atomic<int64_t> next{0};
  const int64_t ntask = int64_t(tasks.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::unique_ptr<V[]> qv(new V[size_t(hkv) * rows * C]);
    std::unique_ptr<at::BFloat16[]> qb(new at::BFloat16[dot ? size_t(hkv) * rows * D : 0]);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < ntask;) {
      const Task& tk = tasks[t];
      Partial* p = &parts[t * hkv];
      const int64_t* blocks = ip + tk.lead * nblk;
      const int n = tk.sub < 0 ? 1 : int(sub_n[tk.sub]);
      // Rows of KV head h: (member r, query head g of h's group) at h * n * G + r * G + g.
      if constexpr (bf16) {
        if (tk.sub < 0 || dot) {  // one sequence: its rows as they are; a sub-group: stacked
          const at::BFloat16* qs = qp + tk.lead * hq * D;
          if (tk.sub >= 0) {
            for (int r = 0; r < n; ++r)
              for (int hd = 0; hd < hq; ++hd)
                std::memcpy(qb.get() + ((hd / G) * n * G + r * G + hd % G) * D,
                            qp + (mp[sub_at[tk.sub] + r] * hq + hd) * D, D * sizeof(at::BFloat16));
            qs = qb.get();
          }
          if (attend_dot(qs, n * G, D, hkv, reinterpret_cast<const at::BFloat16*>(kp),
                         reinterpret_cast<const at::BFloat16*>(vp), blocks, tk.k0, tk.k1, bs, float(scale), p))
            continue;
        }
      }
      for (int r = 0; r < n; ++r) {
        const int64_t i = tk.sub < 0 ? tk.lead : mp[sub_at[tk.sub] + r];
        for (int hd = 0; hd < hq; ++hd) {
          const int h = hd / G;
          const float f = float(scale) * (ks ? ks[h] : 1.f);  // the K scale folds into q
          V* dst = qv.get() + (int64_t(h) * n * G + r * G + hd % G) * C;
          for (int c = 0; c < C; ++c) dst[c] = loadw(qp + (i * hq + hd) * D + c * L, nullptr) * f;
        }
      }
      attend_any<T>(qv.get(), n * G, C, hkv, kp, vp, blocks, tk.k0, tk.k1, bs, lp, p);
    }
  });
  // Merge each (sequence, head, query row) over its own runs and its sub-group's runs.
  at::parallel_for(0, int64_t(b) * hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t i = bh / hkv, h = bh % hkv, s = sub_of[i];
      const int64_t t0 = s < 0 ? 0 : sub_first[s], t1 = s < 0 ? 0 : sub_first[s + 1];
      for (int g = 0; g < G; ++g) {
        // Run j's row: g among the sequence's own, its stacked row among the sub-group's.
        auto each = [&](auto&& f) {
          for (int64_t t = seq_first[i]; t < seq_first[i + 1]; ++t) f(parts[t * hkv + h], g);
          for (int64_t t = t0; t < t1; ++t) f(parts[t * hkv + h], int(row_of[i]) * G + g);
        };
        merge_row(each, C, D, vs ? vs[h] : 1.f, op + (i * hq + h * G + g) * D);
      }
    }
  });
}

// paged_decode's arguments (cpu_attention.cpp) and the groups: members [M] int64 sequence indices,
// each group's in a run, no sequence twice; starts [ng + 1] int64 rising from 0 to M; shared [ng]
// int64, keys [0, shared[g]) that every member of group g reads through the same block ids. Checked
// here (indices, that each member sees the shared keys and holds the same block ids for them):
// a wrong group would otherwise read another sequence's keys without a word.
at::Tensor paged_decode_cascade(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                const at::Tensor& ids, const at::Tensor& seen, double scale,
                                const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                                const c10::optional<at::Tensor>& lut, int64_t chunk, const at::Tensor& members,
                                const at::Tensor& starts, const at::Tensor& shared) {
  at::Tensor ks = k_scale.value_or(at::Tensor()), vs = v_scale.value_or(at::Tensor());
  at::Tensor lt = lut.value_or(at::Tensor());
  check_decode(q, kc, vc, ids, seen, ks, vs, lt, chunk);
  TORCH_CHECK(members.dim() == 1 && starts.dim() == 1 && shared.dim() == 1 && starts.size(0) == shared.size(0) + 1 &&
                  members.scalar_type() == at::kLong && starts.scalar_type() == at::kLong &&
                  shared.scalar_type() == at::kLong && members.is_contiguous() && starts.is_contiguous() &&
                  shared.is_contiguous(),
              "paged_decode_cascade: members [M], starts [groups + 1], shared [groups], int64");
  const int64_t b = q.size(0), M = members.size(0), ng = shared.size(0), nblk = ids.size(1);
  const int64_t bs = kc.size(1);
  const int64_t* mp = members.data_ptr<int64_t>();
  const int64_t* gp = starts.data_ptr<int64_t>();
  const int64_t* pp = shared.data_ptr<int64_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* sp = seen.data_ptr<int64_t>();
  TORCH_CHECK(gp[0] == 0 && gp[ng] == M, "paged_decode_cascade: starts must run from 0 to M");
  std::vector<char> used(b, 0);
  for (int64_t g = 0; g < ng; ++g) {
    TORCH_CHECK(gp[g] < gp[g + 1] && pp[g] >= 0, "paged_decode_cascade: an empty group or negative shared keys");
    const int64_t lead = mp[gp[g]], nsh = (pp[g] + bs - 1) / bs;
    for (int64_t j = gp[g]; j < gp[g + 1]; ++j) {
      const int64_t i = mp[j];
      TORCH_CHECK(i >= 0 && i < b && !used[i], "paged_decode_cascade: a member out of range or in two groups");
      used[i] = 1;
      TORCH_CHECK(pp[g] <= sp[i] && nsh <= nblk && std::equal(ip + i * nblk, ip + i * nblk + nsh, ip + lead * nblk),
                  "paged_decode_cascade: a member that does not see the shared keys through the same blocks");
    }
  }
  at::Tensor out = at::empty_like(q);
  auto go = [&](auto* o) {
    using O = std::remove_pointer_t<decltype(o)>;
    if (lt.defined())
      run<uint8_t, O>(q, kc, vc, ids, seen, scale, ks, vs, lt, chunk, members, starts, shared, out);
    else
      run<O, O>(q, kc, vc, ids, seen, scale, ks, vs, lt, chunk, members, starts, shared, out);
  };
  switch (q.scalar_type()) {
    case at::kFloat: go(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: go(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: go(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_decode_cascade: q must be float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierkv, m) {
  m.def("paged_decode_cascade(Tensor q, Tensor k_cache, Tensor v_cache, Tensor ids, Tensor seen, float scale, "
        "Tensor? k_scale, Tensor? v_scale, Tensor? lut, int chunk, Tensor members, Tensor starts, "
        "Tensor shared) -> Tensor");
  m.impl("paged_decode_cascade", c10::DispatchKey::CPU, &paged_decode_cascade);
}
