"""Paged attention vs scaled_dot_product_attention on pre-gathered (dense) KV.

CPU: the engine's CPU path (decodes through the C++ kernel of kernels/cpu_attention.cpp,
prefills through that of kernels/cpu_prefill.cpp) against dense SDPA, with the all-torch reference
beside it, decode and prefill, so we know the engine's CPU attention is not the bottleneck.
CUDA: the Triton kernels against SDPA on gathered KV, with achieved bandwidth (decode) and
TFLOP/s (prefill) as a fraction of the device's peak. Shapes are the bench model's attention
(8 query heads, 2 KV heads, head dim 64, bf16, block size 16, block ids shuffled).

    python -m bench.kernels [--quick] [--threads N]
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.common import goal, median_time, parser, print_table, write_results
from tierkv.kernels import AttentionMeta, LayerCache, paged_attention, paged_attention_ref

HQ, HKV, D, BS = 8, 2, 64, 16
DTYPE = torch.bfloat16
# Dense peaks (bf16 TFLOP/s without sparsity, HBM TB/s) by device-name substring.
PEAKS = {
    "H200": (989.0, 4.8),
    "H100": (989.0, 3.35),
    "A100": (312.0, 2.0),
    "L40S": (362.0, 0.864),
    "L4": (121.0, 0.3),
    "A10": (125.0, 0.6),
    "4090": (165.0, 1.0),
}


def setup(batch: int, ctx: int, n_q: int, device: str, seed: int = 0):
    """A paged cache holding `batch` sequences of `ctx` keys in shuffled blocks, the same KV
    gathered dense as [B, Hkv, T, D], and n_q queries per sequence at the last positions."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk = -(-ctx // BS)
    nb = batch * nblk
    k = torch.randn(nb, BS, HKV, D, generator=g).to(device, DTYPE)
    v = torch.randn(nb, BS, HKV, D, generator=g).to(device, DTYPE)
    bt = torch.randperm(nb, generator=g).view(batch, nblk).to(device, torch.int32)
    slots = (bt.long()[:, :, None] * BS + torch.arange(BS, device=device)).flatten(1)[:, :ctx]
    dense_k = k.view(-1, HKV, D)[slots].transpose(1, 2).contiguous()
    dense_v = v.view(-1, HKV, D)[slots].transpose(1, 2).contiguous()
    q = torch.randn(batch * n_q, HQ, D, generator=g).to(device, DTYPE)
    pos = torch.arange(ctx - n_q, ctx, device=device).repeat(batch).int()
    meta = AttentionMeta(
        block_tables=bt,
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(0, batch * n_q + 1, n_q, dtype=torch.int32, device=device),
        q_positions=pos,
        max_seqlen_q=n_q,
        max_seqlen_k=ctx,
    )
    return q, LayerCache(k, v), meta, dense_k, dense_v


def dense_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, n_q: int
) -> torch.Tensor:
    """The baseline: SDPA on contiguous [B, Hkv, T, D]. Decode folds the GQA group into the
    query length (on a CPU several times faster than enable_gqa); prefill is causal."""
    if n_q == 1:
        out = F.scaled_dot_product_attention(q.view(batch, HKV, HQ // HKV, D), k, v, scale=D**-0.5)
        return out.reshape(batch, HQ, D)
    qt = q.view(batch, n_q, HQ, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=D**-0.5, enable_gqa=True)
    return out.transpose(1, 2).reshape(batch * n_q, HQ, D)


def timed(fn, device: str, repeat: int) -> float:
    def run():
        fn()
        if device == "cuda":
            torch.cuda.synchronize()

    return median_time(run, repeat=repeat, warmup=2)


def measure(kind: str, batch: int, ctx: int, device: str, repeat: int) -> dict:
    n_q = 1 if kind == "decode" else ctx
    q, cache, meta, dk, dv = setup(batch, ctx, n_q, device)

    def paged() -> torch.Tensor:
        return paged_attention(q, cache, meta, D**-0.5)

    def base() -> torch.Tensor:
        return dense_sdpa(q, dk, dv, batch, n_q)

    def ref() -> torch.Tensor:
        return paged_attention_ref(q, cache, meta, D**-0.5, cpu_kernel=False)

    err = (paged().float() - base().float()).abs().max().item()
    fns = (paged, base) if device == "cuda" else (paged, base, ref)
    # Alternate them in rounds so that load from other processes hits all alike.
    rounds = [[timed(f, device, repeat) for f in fns] for _ in range(3)]
    t_paged, t_base, *t_ref = (statistics.median(r[i] for r in rounds) for i in range(len(fns)))
    kv_bytes = 2 * batch * ctx * HKV * D * cache.k.element_size()
    flops = 4 * batch * HQ * D * (ctx * (ctx + 1) / 2 if n_q > 1 else ctx)
    # For scale: the usual GQA call, SDPA(enable_gqa=True), which the fold above outruns on a CPU.
    gqa = lambda: F.scaled_dot_product_attention(
        q.view(batch, n_q, HQ, D).transpose(1, 2),
        dk,
        dv,
        is_causal=n_q > 1,
        scale=D**-0.5,
        enable_gqa=True,
    )
    t_gqa = timed(gqa, device, repeat)
    row = {
        "kind": kind,
        "batch": batch,
        "ctx": ctx,
        "paged_ms": t_paged * 1e3,
        "sdpa_ms": t_base * 1e3,
        "sdpa_gqa_ms": t_gqa * 1e3,
        "torch_ref_ms": t_ref[0] * 1e3 if t_ref else float("nan"),
        "ratio": t_paged / t_base,
        "paged_GBps": kv_bytes / t_paged / 1e9,
        "paged_TFLOPs": flops / t_paged / 1e12,
        "max_err": err,
    }
    return row


def peaks(args) -> tuple[float, float]:
    name = torch.cuda.get_device_name(0)
    tflops, tbps = next((p for key, p in PEAKS.items() if key in name), (0.0, 0.0))
    return args.peak_tflops or tflops, args.peak_tbps or tbps


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the device's bf16 peak")
    p.add_argument(
        "--peak-tbps", type=float, default=0.0, help="override the device's memory bandwidth"
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        batches, ctxs, pre = (
            ([1, 32], [4096, 32768], [8192])
            if args.quick
            else ([1, 8, 32], [1024, 2048, 4096, 8192, 16384, 32768], [1024, 4096, 8192, 16384])
        )
    else:
        batches, ctxs, pre = (
            ([1, 32], [1024, 2048], [1024])
            if args.quick
            else ([1, 8, 32], [1024, 2048, 4096, 8192], [1024, 2048, 4096])
        )
    repeat = 3 if args.quick else 5
    cases = [("decode", b, c) for b in batches for c in ctxs] + [("prefill", 1, c) for c in pre]
    rows = [
        measure(kind, b, c, device, repeat)
        for kind, b, c in tqdm(cases, desc="kernels", unit="case")
    ]
    goals = [goal("max |paged - dense SDPA| (bf16)", max(r["max_err"] for r in rows), "<=", 2e-2)]
    if cuda:
        tflops, tbps = peaks(args)
        for r in rows:
            r["bw_frac"] = r["paged_GBps"] / (tbps * 1e3) if tbps else float("nan")
            r["tflops_frac"] = r["paged_TFLOPs"] / tflops if tflops else float("nan")
        dec = max(
            (r for r in rows if r["kind"] == "decode" and r["ctx"] == max(ctxs)),
            key=lambda r: r["bw_frac"],
        )
        pf = [r for r in rows if r["kind"] == "prefill" and r["ctx"] == 8192]
        goals.append(
            goal(
                f"decode {max(ctxs) // 1024}K, batch {dec['batch']}: fraction of memory bandwidth",
                dec["bw_frac"],
                ">=",
                0.7,
            )
        )
        if pf:
            goals.append(goal("prefill 8K: fraction of bf16 peak", pf[0]["tflops_frac"], ">=", 0.5))
    else:
        hit = [r for r in rows if r["kind"] == "decode" and r["batch"] == 32 and r["ctx"] == 2048]
        goals.append(
            goal(
                "CPU decode batch 32, 2K: paged (C++ kernel) / dense SDPA",
                hit[0]["ratio"],
                "<=",
                1.5,
                "x",
            )
        )
    print_table(rows)

    def plot(ax):
        for b in batches:
            pts = [r for r in rows if r["kind"] == "decode" and r["batch"] == b]
            ax.plot(
                [r["ctx"] for r in pts],
                [r["ratio"] for r in pts],
                marker="o",
                label=f"decode, batch {b}",
            )
        pts = [r for r in rows if r["kind"] == "prefill"]
        ax.plot(
            [r["ctx"] for r in pts], [r["ratio"] for r in pts], marker="s", label="prefill, batch 1"
        )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"paged ({'Triton' if cuda else 'CPU path'}) time / dense SDPA time")
        ax.legend()

    write_results(
        "kernels",
        {
            "device": device,
            "quick": args.quick,
            "threads": torch.get_num_threads(),
            "hq": HQ,
            "hkv": HKV,
            "head_dim": D,
            "block_size": BS,
            "dtype": str(DTYPE),
        },
        rows,
        goals,
        plot,
    )


if __name__ == "__main__":
    main()
