// torch.ops.tierkv.decode_layer: one decoder layer of a decode step in one call; decode_layers:
// every layer of it in one call, for a step with no per-layer connector work.
//
// It runs LlamaForCausalLM.forward's loop body (engine/model.py) op for op, on the same kernels
// (called through the dispatcher, so each is the op the Python loop calls) and in the same order,
// so its result is bit-identical to that loop's. What it saves is Python: the loop body makes
// ~15 op calls and ~30 Python calls per layer, about 1.5 ms of a SmolLM2 decode step.
//
// Contract (the caller, engine/decode_step.py, holds it; the ops check their own arguments):
// h [N, hidden] one row per decoding sequence; cos/sin the step's RoPE tables; k_cache/v_cache
// the layer's cache (not fp8) and slots [N] int64 the rows' slots; ids/seen/chunk the C++ decode
// kernel's arguments for the N sequences; w/gemv/bias/limit the four linear layers (qkv, o,
// gate_up, down) as kernels/step_ops.py binds them: gemv[i] (when given) serves up to limit[i]
// rows, else F.linear over w[i] (computed in w[i]'s dtype and rounded back when it is wider).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

using T = at::Tensor;
using Opt = c10::optional<at::Tensor>;

template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The library's ops, looked up once (after every fragment of the library registered).
struct Ops {
  c10::TypedOperatorHandle<T(const T&, const T&, double)> norm = op<T(const T&, const T&, double)>("tierkv::rms_norm");
  c10::TypedOperatorHandle<T(const T&)> silu = op<T(const T&)>("tierkv::silu_mul");
  c10::TypedOperatorHandle<T(const T&, const T&, const T&)> rope = op<T(const T&, const T&, const T&)>("tierkv::rope");
  c10::TypedOperatorHandle<void(const T&, const T&, T&, T&, const T&)> write =
      op<void(const T&, const T&, T&, T&, const T&)>("tierkv::write_kv");
  c10::TypedOperatorHandle<T(const T&, const T&, const Opt&)> gemv =
      op<T(const T&, const T&, const Opt&)>("tierkv::gemv_bf16");
  c10::TypedOperatorHandle<T(const T&, const T&, const T&, const T&, const T&, double, const Opt&, const Opt&,
                             const Opt&, int64_t)>
      decode = op<T(const T&, const T&, const T&, const T&, const T&, double, const Opt&, const Opt&, const Opt&,
                    int64_t)>("tierkv::paged_decode");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

// StepOps.linear's choice: the few-row kernel up to its row limit, else torch's GEMM.
T linear(const Ops& o, const T& x, const T& w, const Opt& g, const Opt& b, int64_t limit) {
  if (g.has_value() && g->defined() && x.size(0) <= limit) return o.gemv.call(x, *g, b);
  if (w.scalar_type() != x.scalar_type()) return at::linear(x.to(w.scalar_type()), w, b).to(x.scalar_type());
  return at::linear(x, w, b);
}

// One layer; its four linear layers are w/gemv/bias/limit[at .. at + 4).
T layer(const T& h0, const T& cos, const T& sin, T& k_cache, T& v_cache, const T& slots, const T& ids,
        const T& seen, double scale, int64_t chunk, const T& norm1, const T& norm2, double eps, int64_t hq,
        int64_t hkv, at::TensorList w, const c10::List<Opt>& gemv, const c10::List<Opt>& bias,
        at::IntArrayRef limit, size_t at) {
  TORCH_CHECK(h0.dim() == 2 && hq > 0 && hkv > 0, "decode_layer: h [N, hidden], hq and hkv > 0");
  const Ops& o = ops();
  const int64_t n = h0.size(0);
  auto lin = [&](const T& x, size_t i) {
    return linear(o, x, w[at + i], gemv.get(at + i), bias.get(at + i), limit[at + i]);
  };
  const T qkv = lin(o.norm.call(h0, norm1, eps), 0);
  const int64_t d = qkv.size(1) / (hq + 2 * hkv);
  const auto parts = qkv.split_with_sizes({hq * d, hkv * d, hkv * d}, -1);
  const T q = o.rope.call(parts[0].view({n, hq, d}), cos, sin);
  const T k = o.rope.call(parts[1].view({n, hkv, d}), cos, sin);
  o.write.call(k, parts[2].reshape({n, hkv, d}), k_cache, v_cache, slots);
  const T att = o.decode.call(q.contiguous(), k_cache, v_cache, ids, seen, scale, c10::nullopt, c10::nullopt,
                              c10::nullopt, chunk);
  const T h = h0 + lin(att.reshape({n, -1}), 1);
  return h + lin(o.silu.call(lin(o.norm.call(h, norm2, eps), 2)), 3);
}

T decode_layer(const T& h0, const T& cos, const T& sin, T& k_cache, T& v_cache, const T& slots, const T& ids,
               const T& seen, double scale, int64_t chunk, const T& norm1, const T& norm2, double eps, int64_t hq,
               int64_t hkv, at::TensorList w, const c10::List<Opt>& gemv, const c10::List<Opt>& bias,
               at::IntArrayRef limit) {
  TORCH_CHECK(w.size() == 4 && gemv.size() == 4 && bias.size() == 4 && limit.size() == 4,
              "decode_layer: four linear layers (qkv, o, gate_up, down)");
  return layer(h0, cos, sin, k_cache, v_cache, slots, ids, seen, scale, chunk, norm1, norm2, eps, hq, hkv, w,
               gemv, bias, limit, 0);
}

// decode_layer over every layer: k_caches/v_caches/norm1/norm2 one entry per layer, w/gemv/bias/
// limit four per layer (qkv, o, gate_up, down), in layer order.
T decode_layers(const T& h0, const T& cos, const T& sin, at::TensorList k_caches, at::TensorList v_caches,
                const T& slots, const T& ids, const T& seen, double scale, int64_t chunk, at::TensorList norm1,
                at::TensorList norm2, double eps, int64_t hq, int64_t hkv, at::TensorList w,
                const c10::List<Opt>& gemv, const c10::List<Opt>& bias, at::IntArrayRef limit) {
  const size_t n = k_caches.size();
  TORCH_CHECK(v_caches.size() == n && norm1.size() == n && norm2.size() == n,
              "decode_layers: one cache pair and two norms per layer");
  TORCH_CHECK(w.size() == 4 * n && gemv.size() == 4 * n && bias.size() == 4 * n && limit.size() == 4 * n,
              "decode_layers: four linear layers per layer");
  T h = h0;
  for (size_t i = 0; i < n; ++i) {
    T k = k_caches[i], v = v_caches[i];
    h = layer(h, cos, sin, k, v, slots, ids, seen, scale, chunk, norm1[i], norm2[i], eps, hq, hkv, w, gemv, bias,
              limit, 4 * i);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierkv, m) {
  m.def(
      "decode_layer(Tensor h, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "Tensor ids, Tensor seen, float scale, int chunk, Tensor norm1, Tensor norm2, float eps, int hq, int hkv, "
      "Tensor[] w, Tensor?[] gemv, Tensor?[] bias, int[] limit) -> Tensor");
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
  m.def(
      "decode_layers(Tensor h, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "Tensor slots, Tensor ids, Tensor seen, float scale, int chunk, Tensor[] norm1, Tensor[] norm2, float eps, "
      "int hq, int hkv, Tensor[] w, Tensor?[] gemv, Tensor?[] bias, int[] limit) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, &decode_layers);
}
