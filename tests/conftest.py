from __future__ import annotations

import os

import pytest

from tierkv.cacheserver.launch import RedisProcess

# tests/vllm needs vLLM, which lives in .venv-vllm: `make test-vllm` runs it there.
collect_ignore = [] if os.environ.get("TIERKV_VLLM_TESTS") == "1" else ["vllm"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "triton_path: also run on the Triton kernels under TRITON_INTERPRET=1 (make test-triton)",
    )
    config.addinivalue_line(
        "markers",
        "cpu_path: needs the engine's CPU kernels (it asserts which ran, or times a fault "
        "against steps of milliseconds); runs with TRITON_INTERPRET unset",
    )


@pytest.fixture(autouse=True)
def _kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cpu_path test runs on the CPU kernels even in the Triton-path run: the dispatch
    reads TRITON_INTERPRET at each call."""
    if request.node.get_closest_marker("cpu_path"):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def redis_proc():
    """A fresh redis-server on a free port, stopped after the test."""
    r = RedisProcess().start()
    yield r
    r.stop(kill=True)


@pytest.fixture(scope="module")
def redis_cluster():
    """A 3-master Redis Cluster on free ports, shared by the tests of one module."""
    from tierkv.cacheserver.launch_cluster import RedisCluster

    c = RedisCluster(masters=3).start()
    yield c
    c.stop()
