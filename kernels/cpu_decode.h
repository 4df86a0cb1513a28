// What the CPU decode attention's two inner loops share (cpu_attention.cpp: fp32 math over any
// cache dtype; cpu_attention_dot.cpp: bf16 products on CPUs with AVX512-BF16).
#pragma once

#include <ATen/ATen.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>

namespace tierkv_decode {

using tierkv_vec::vfw;

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

// Keys [k0, k1) of one sequence, every KV head, into p[0..hkv) (whose state is reset first):
// q [hkv * G, D] bf16, unscaled; bf16 caches [nb, bs, hkv, D]; blocks the sequence's block ids.
// The products in bf16 with fp32 sums, the softmax in fp32, its weights rounded to bf16 for the
// products with V. False (nothing written) where this build has no AVX512-BF16 or G and D are
// not among the compiled ones: the caller then runs the fp32 loop.
bool attend_dot(const at::BFloat16* q, int G, int D, int hkv, const at::BFloat16* kc, const at::BFloat16* vc,
                const int64_t* blocks, int64_t k0, int64_t k1, int bs, float scale, Partial* p);

}  // namespace tierkv_decode
