"""Argument checks of paged attention, shared by the torch reference and the Triton path:
bad metadata is a clear error before any read."""

from __future__ import annotations

import torch

from tierkv.kernels.fp8 import is_fp8


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    q_positions: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Shape, dtype and range checks shared by the reference and the Triton path."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be [Nq, Hq, D], caches [num_blocks, block_size, Hkv, D]; got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    nq, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(
            f"head dim {k_cache.shape[3]} vs {d}, or Hq={hq} not a multiple of Hkv={hkv}"
        )
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q dtype {q.dtype} not supported")
    if is_fp8(k_cache) != is_fp8(v_cache) or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share a dtype")
    if is_fp8(k_cache):
        for s in (k_scale, v_scale):
            if s is None or s.shape != (hkv,) or s.dtype != torch.float32:
                raise ValueError(f"fp8 KV needs float32 k_scale and v_scale of shape [{hkv}]")
    elif k_cache.dtype != q.dtype and k_cache.dtype not in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    ):
        raise ValueError(f"cache dtype {k_cache.dtype} not supported")
    b = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != b or cu_seqlens_q.shape != (b + 1,):
        raise ValueError(
            f"block_tables [B, max_blocks], seq_lens [B], cu_seqlens_q [B+1] disagree: "
            f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, {tuple(cu_seqlens_q.shape)}"
        )
    if q_positions.shape != (nq,):
        raise ValueError(f"q_positions must be [{nq}], got {tuple(q_positions.shape)}")
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("cu_seqlens_q", cu_seqlens_q),
        ("q_positions", q_positions),
    ):
        if t.dtype not in (torch.int32, torch.int64) or t.device != q.device:
            raise ValueError(f"{name} must be an int32/int64 tensor on {q.device}")


def check_attention_values(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    q_positions: torch.Tensor,
) -> None:
    """Range checks in one host sync: a bad block id must be an error, never a wild read."""
    cu = cu_seqlens_q.long()
    lens = seq_lens.long()
    need = (lens + k_cache.shape[1] - 1) // k_cache.shape[1]
    used = torch.arange(block_tables.shape[1], device=q.device) < need[:, None]
    zero = torch.zeros((), dtype=torch.bool, device=q.device)
    flags = torch.stack(
        [
            (cu[0] != 0) | (cu[-1] != q.shape[0]) | (cu[1:] < cu[:-1]).any(),
            (lens < 0).any() | (q_positions < 0).any() if q_positions.numel() else (lens < 0).any(),
            need.max() > block_tables.shape[1] if need.numel() else zero,
            (used & ((block_tables < 0) | (block_tables >= k_cache.shape[0]))).any(),
        ]
    ).tolist()
    for bad, msg in zip(
        flags,
        (
            "cu_seqlens_q must rise from 0 to Nq",
            "seq_lens and q_positions must be >= 0",
            "a sequence has more keys than its block table covers",
            "block table entry outside the cache",
        ),
    ):
        if bad:
            raise ValueError(msg)
