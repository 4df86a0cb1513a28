// What the CPU decode attention's two inner loops share (cpu_attention.cpp: fp32 math over any
// cache dtype; cpu_attention_dot.cpp: bf16 products on CPUs with AVX512-BF16).
#pragma once

#include <ATen/ATen.h>

#include "cpu_vec.h"

#include <cstdint>

namespace tierkv_decode {

using tierkv_vec::vfw;

struct Partial {  // online-softmax state of one (task, KV head): running max, sum, weighted V
  float* m;   // [G]
  float* l;   // [G]
  vfw* acc;  // [G * D / W], dims in order
};

// Keys [k0, k1) of one sequence, every KV head, into p[0..hkv) (whose state is reset first):
// q [hkv * G, D] bf16, unscaled; bf16 caches [nb, bs, hkv, D]; blocks the sequence's block ids.
// The products in bf16 with fp32 sums, the softmax in fp32, its weights rounded to bf16 for the
// products with V. False (nothing written) where this build has no AVX512-BF16 or G and D are
// not among the compiled ones: the caller then runs the fp32 loop.
bool attend_dot(const at::BFloat16* q, int G, int D, int hkv, const at::BFloat16* kc, const at::BFloat16* vc,
                const int64_t* blocks, int64_t k0, int64_t k1, int bs, float scale, Partial* p);

}  // namespace tierkv_decode
