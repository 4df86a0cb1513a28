"""The engine's C++ CPU kernels, built on first use with torch's extension builder into one
library: decode attention (cpu_attention.cpp) that reads K and V in place from the paged
cache, prefill attention (cpu_prefill.cpp; bf16 products on CPUs with AVX512-BF16 in
cpu_prefill_dot.cpp), RoPE in one pass and the KV write (cpu_ops.cpp; RoPE bit-identical to the
torch expression in rope.py), cascade decode attention that reads a prefix shared by several
sequences once (cpu_cascade.cpp), RMSNorm and SiLU-and-mul (cpu_layer.cpp), few-row linear
layers over bf16 weights (cpu_gemv.cpp), and a decode step's layer in one call of those ops
(cpu_step.cpp).

The torch reference gathers every decode sequence's blocks into scratch before SDPA reads
them, so it moves the KV three times; the decode kernel reads it once. Where the library
cannot be built (no compiler; one warning) or is turned off (TIERKV_CPU_KERNEL=0), the torch
code runs instead, with the same results (RoPE, KV write) or within fp32 rounding (attention).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tierkv.kernels.args import LayerCache
from tierkv.kernels.fp8 import FP8

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_attention.cpp")
HEADER = SOURCE.with_name("cpu_vec.h")  # included by the .cpp files
OPS = SOURCE.with_name(
    "cpu_ops.cpp"
)  # built into the same library: torch.ops.tierkv.rope, .write_kv
LAYER = SOURCE.with_name("cpu_layer.cpp")  # and torch.ops.tierkv.rms_norm, .silu_mul
PREFILL = SOURCE.with_name("cpu_prefill.cpp")  # and torch.ops.tierkv.prefill_attention
PREFILL_DOT = SOURCE.with_name("cpu_prefill_dot.cpp")  # its bf16 products (AVX512-BF16)
PREFILL_H = SOURCE.with_name("cpu_prefill.h")  # the driver both prefill paths share
GEMV = SOURCE.with_name("cpu_gemv.cpp")  # and torch.ops.tierkv.gemv_bf16
DECODE_DOT = SOURCE.with_name("cpu_attention_dot.cpp")  # the decode's bf16 products (AVX512-BF16)
DECODE_H = SOURCE.with_name("cpu_decode.h")
CASCADE = SOURCE.with_name("cpu_cascade.cpp")  # and torch.ops.tierkv.paged_decode_cascade
STEP = SOURCE.with_name(
    "cpu_step.cpp"
)  # torch.ops.tierkv.decode_layer(s) (the others, in one call)
# the library's translation units
BUILT = (SOURCE, DECODE_DOT, CASCADE, OPS, LAYER, PREFILL, PREFILL_DOT, GEMV, STEP)
# Keys per decode task: at least this many, and at most enough for ~4 tasks per thread. Equal
# tasks keep the threads balanced and split a few long contexts (split-K); longer ones merge fewer
# runs: 8 x 700 keys, bf16, 2 threads: 14 GB/s of KV read with 512-key tasks, 18 with one per
# sequence.
CHUNK_KEYS = 512
TASKS_PER_THREAD = 4


def decode_chunk(total_keys: int) -> int:
    """Keys per task of a decode call whose sequences see total_keys keys in all."""
    return max(CHUNK_KEYS, -(-total_keys // (TASKS_PER_THREAD * torch.get_num_threads())))


def enabled() -> bool:
    """TIERKV_CPU_KERNEL=0 turns the C++ kernels off (the torch code runs). The kernel-level
    functions read it at each call; an engine reads it once, when its model is bound
    (kernels/step_ops.py)."""
    return os.environ.get("TIERKV_CPU_KERNEL", "1") != "0"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        line = next(
            x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")
        )
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def _build_dir() -> Path:
    """One build per source, torch version and CPU: -march=native code must not run on
    another CPU (a cached build from a different host could hit an illegal instruction)."""
    flags = " ".join(sorted(cpu_flags()))
    code = b"".join(p.read_bytes() for p in (*BUILT, HEADER, PREFILL_H, DECODE_H))
    # Two ninja builds record their commands differently and rebuild each other's objects.
    ninja = shutil.which("ninja") or ""
    # The checkout too: ninja records absolute source paths, so two checkouts of the same
    # sources sharing a folder would rebuild each other's objects.
    where = str(SOURCE.parent.resolve()).encode()
    tag = hashlib.sha256(
        code + torch.__version__.encode() + flags.encode() + ninja.encode() + where
    )
    root = Path(os.environ.get("TIERKV_BUILD_DIR", Path.home() / ".cache" / "tierkv"))
    path = root / f"cpu-{tag.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


_LOCK = threading.Lock()
STALE_LOCK_S = 600  # a build takes about 20 s; a lock this old was left by a killed one


@functools.cache
def _load() -> bool:
    try:
        from torch.utils.cpp_extension import load as build

        root = _build_dir()
        lock = root / "lock"  # torch's build lock; a build killed midway leaves it forever
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        build(
            name="tierkv_cpu",
            sources=[str(p) for p in BUILT],
            build_directory=str(root),
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a broken toolchain: the reference still works
        log.warning("tierkv: C++ CPU kernels unavailable (%s); using the torch code", e)
        return False
    return True


def load() -> bool:
    """Build (once per machine and source, about 20 s) and load the library; False if that fails.
    One thread builds and loads; the others wait (a second load of the library would fail)."""
    with _LOCK:
        return _load()


@functools.cache
def _fp8_table() -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(FP8).float()


def decode_fits(q: torch.Tensor, cache: LayerCache) -> bool:
    """True when the decode kernel's limits admit this call: CPU tensors, a cache in q's dtype
    or fp8, contiguous caches, a head dim that is a multiple of 16 up to 256, GQA groups up to
    16. Whether the library is on and built is the caller's (decode_usable, or a binding made
    once per model: kernels/step_ops.py)."""
    g = q.shape[1] // cache.k.shape[2]
    return (
        q.device.type == "cpu"
        and (cache.k.dtype == q.dtype or cache.fp8)
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
        and q.shape[2] % 16 == 0
        and q.shape[2] <= 256
        and g <= 16
    )


def decode_usable(q: torch.Tensor, cache: LayerCache) -> bool:
    """True when the kernel serves this call: decode_fits, the library on
    (TIERKV_CPU_KERNEL, read at each call) and built."""
    return decode_fits(q, cache) and enabled() and load()


def rope_usable(x: torch.Tensor) -> bool:
    """True when torch.ops.tierkv.rope serves x [N, H, D]: a CPU float tensor, rows contiguous."""
    return (
        x.device.type == "cpu"
        and enabled()
        and x.dim() == 3
        and x.stride(2) == 1
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and load()
    )


def write_kv_usable(k: torch.Tensor, v: torch.Tensor, cache: LayerCache) -> bool:
    """True when torch.ops.tierkv.write_kv serves this write: CPU tensors, the caches in k's
    dtype (fp8 caches quantize: the reference does that), rows contiguous."""
    return (
        k.device.type == "cpu"
        and enabled()
        and k.dim() == 3
        and v.dim() == 3
        and k.stride(2) == 1
        and v.stride(2) == 1
        and cache.k.dtype == k.dtype == v.dtype == cache.v.dtype
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
        and load()
    )


def _decode_args(
    q: torch.Tensor,
    cache: LayerCache,
    ids: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    chunk: int | None,
) -> tuple[Any, ...]:
    """The decode ops' common arguments: an fp8 cache as bytes with its scales and table."""
    fp8 = cache.fp8
    kc, vc = (cache.k.view(torch.uint8), cache.v.view(torch.uint8)) if fp8 else (cache.k, cache.v)
    return (
        q.contiguous(),
        kc,
        vc,
        ids,
        seen,
        scale,
        cache.k_scale if fp8 else None,
        cache.v_scale if fp8 else None,
        _fp8_table() if fp8 else None,
        decode_chunk(int(seen.sum())) if chunk is None else chunk,
    )


def paged_decode(
    q: torch.Tensor,
    cache: LayerCache,
    ids: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """q [b, Hq, D] (one query per sequence) over keys [0, seen[i]) of blocks ids[i] -> [b, Hq, D].
    chunk: keys per task, decode_chunk(seen.sum()) where None.

    Contract (checked by the caller, kernels/ref_attention.py, before any read): ids [b, nblk]
    int64 holds valid block ids of the cache for every block that seen[i] covers; seen [b] int64
    <= nblk * block_size; decode_usable(q, cache) is True; fp8 caches come with float32 scales
    [Hkv]."""
    return torch.ops.tierkv.paged_decode(*_decode_args(q, cache, ids, seen, scale, chunk))


def paged_decode_cascade(
    q: torch.Tensor,
    cache: LayerCache,
    ids: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    chunk: int | None = None,
) -> torch.Tensor:
    """paged_decode with shared prefixes read once: groups = (members [M], starts [ng + 1],
    shared [ng]), int64 CPU tensors: group g is the sequences members[starts[g]:starts[g+1]],
    which all hold the same block ids for keys [0, shared[g]); those keys are read once per
    sub-group of at most 16 // G sequences, each member's keys [shared[g], seen[i]) on their own,
    and the two parts merged by log-sum-exp. chunk: keys per task, decode_chunk(seen.sum())
    where None.

    Contract: paged_decode's. The op checks the groups (indices, each member seeing the shared
    keys through the leader's block ids) before any read: a RuntimeError otherwise."""
    args = _decode_args(q, cache, ids, seen, scale, chunk)
    return torch.ops.tierkv.paged_decode_cascade(*args, *groups)


def prefill_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when the prefill kernel's limits admit q [Nq, Hq, D] over k, v [T, Hkv, D]: CPU
    tensors of one dtype, fp32 or bf16, rows contiguous, D a multiple of 64 up to 256."""
    return (
        q.device.type == "cpu"
        and q.dim() == k.dim() == v.dim() == 3
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.shape[2] % 64 == 0
        and q.shape[2] <= 256
        and q.stride(2) == k.stride(2) == v.stride(2) == 1
    )


def prefill_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when torch.ops.tierkv.prefill_attention serves this call: prefill_fits, the library
    on and built."""
    return prefill_fits(q, k, v) and enabled() and load()


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of q [Nq, Hq, D] over k, v [T, Hkv, D], query i seeing keys [0, min(pos[i]+1, T))
    -> [Nq, Hq, D], fp32 math; a query with no visible key gets zeros. Contract:
    prefill_usable(q, k, v); the kernel checks shapes and that positions are non-negative."""
    return torch.ops.tierkv.prefill_attention(q, k, v, pos.long().contiguous(), scale)
