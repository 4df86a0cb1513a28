"""fp8 KV under a checkpoint's own scales: a tiny random Llama whose checkpoint holds a static
K and V scale per layer (compressed-tensors kv_cache_scheme; vLLM resolves kv_cache_dtype
'auto' to fp8 from it). The engine's saves carry those scales in every part's header; after
its prefix cache is reset it loads the prompt back from a real tierkv-server with the tokens of
its cold run."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.vllm.conftest import needs_fp8_kv, prompt
from tests.vllm.harness import Engine, kv_scaled_llama
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.segment import KVSegment

pytestmark = needs_fp8_kv

SCALES = [(0.05, 0.02), (0.1, 0.04)]  # per layer: K, V
P = prompt(200, 21)
CHUNK = 64


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(args=["--cpu-bytes", "0"]).start()
    yield s
    s.stop(kill=True)


@pytest.fixture(scope="module")
def engine(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model = kv_scaled_llama(tmp_path_factory.mktemp("kv-scaled"), SCALES)
    extra = {"remote": f"grpc://{server.target}", "chunk_size": CHUNK, "cpu_bytes": 0}
    e = Engine(model, extra).start()  # kv_cache_dtype left 'auto'
    yield e
    e.close()


def test_checkpoint_scales_are_stored_and_loaded_under(engine: Engine, server) -> None:
    cold = engine.generate([P])
    engine.wait_saved(2 * 4)  # 2 KV head parts of 3 full chunks and a partial one
    parts = [KVSegment.decode(f.read_bytes()) for f in server.cache_dir.rglob("*.tkv")]
    assert len(parts) == 8
    want = np.asarray(SCALES, np.float32)[:, :, None]  # [L, 2, 1 head]
    for s in parts:
        assert (s.header.dtype, s.header.quant) == ("float8_e4m3fn", "fp8_e4m3")
        assert np.array_equal(s.header.scales, want)
    engine.reset()
    m = engine.metrics()
    assert engine.generate([P]) == cold
    now = engine.metrics()
    assert now["loaded_tokens"] - m["loaded_tokens"] == len(P) - 1
    assert now["load_rejected"] == m["load_rejected"]
