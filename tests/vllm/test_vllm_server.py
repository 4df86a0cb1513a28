"""tierkv.vllm end to end against a real tierkv-server (auth on, disk tier only, so a test can
reach each stored segment): process A saves, a fresh process B loads with the tokens of its
own cold run; partial hits; a flipped byte, a segment of another model and a killed server
are recomputed; namespaces (bearer tokens) never cross. fp32, a tiny random Llama, chunks of
64 tokens."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.conftest import prompt
from tests.vllm.harness import Engine
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.segment import KVSegment

TOKENS = "tok-a-123456=team-a,tok-a2-123456=team-a,tok-b-123456=team-b"
P1, P2 = prompt(300, 1), prompt(200, 2)
Q = P1[:150] + prompt(100, 3)  # shares two full chunks with P1, then differs mid-chunk
R = P2[:100]  # one full chunk of P2, then stops inside its second
CHUNK = 64


def extra(server: ServerProcess, token: str) -> dict:
    return {
        "remote": f"grpc://{server.target}",
        "token": token,
        "chunk_size": CHUNK,
        "cpu_bytes": 0,
        "load_timeout_s": 20.0,
    }


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(args=["--cpu-bytes", "0", "--tokens", TOKENS]).start()
    yield s
    s.stop(kill=True)


@pytest.fixture(scope="module")
def cold_a(server: ServerProcess, tiny: Path) -> list[list[int]]:
    """Process A's answers to P1 and P2 (its cache empty, the server empty); A then exits,
    its saves drained to the server."""
    a = Engine(tiny, extra(server, "tok-a-123456")).start()
    try:
        out = a.generate([P1, P2])
        a.wait_saved(2 * (5 + 4))  # 2 KV head parts of P1's 4 + 1 chunks, P2's 3 + 1
    finally:
        a.close()
    return out


@pytest.fixture(scope="module")
def b(server: ServerProcess, tiny: Path, cold_a) -> Iterator[Engine]:
    e = Engine(tiny, extra(server, "tok-a2-123456")).start()
    yield e
    e.close()


def delta(e: Engine, before: dict[str, float]) -> dict[str, float]:
    now = e.metrics()
    return {k: now[k] - before.get(k, 0.0) for k in now}


def segment_files(server: ServerProcess, ns: str = "team-a") -> dict[Path, KVSegment]:
    d = server.cache_dir / "disk" / ns
    return {f: KVSegment.decode(f.read_bytes(), verify=False) for f in sorted(d.glob("*.tkv"))}


def file_of(server: ServerProcess, tokens: list[int], timeout: float = 60) -> Path:
    """The server's file of the segment with these tokens (saves land in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for f, seg in segment_files(server).items():
            if seg.tokens.tolist() == tokens:
                return f
        time.sleep(0.1)
    raise AssertionError("no stored segment holds these tokens")


def stored(server: ServerProcess, s: list[int], timeout: float = 60) -> None:
    """Wait until the server holds every chunk of s (the last one partial), each as one part
    per KV head."""
    deadline = time.monotonic() + timeout
    for a in range(0, len(s), CHUNK):
        while (
            sum(g.tokens.tolist() == s[a : a + CHUNK] for g in segment_files(server).values()) < 2
        ):
            assert time.monotonic() < deadline, "the server does not hold every part"
            time.sleep(0.1)


async def replace(server: ServerProcess, seg: KVSegment) -> None:
    tier = RemoteTier(target=server.target, token="tok-a-123456")
    try:
        assert await tier.delete(seg.key)
        assert await tier.put(seg.key, seg)
    finally:
        await tier.close()


def test_second_process_loads_what_the_first_saved(b: Engine, cold_a) -> None:
    m = b.metrics()
    loaded = b.generate([P1, P2])
    d = delta(b, m)
    assert loaded == cold_a
    assert d["loaded_tokens"] == (len(P1) - 1) + (len(P2) - 1)  # all but each last token
    assert d["load_misses"] == d["load_rejected"] == d["recomputed_tokens"] == 0
    b.reset()
    assert b.generate([P1, P2], cold=True) == loaded  # B's own cold run


def test_partial_hits_and_hits_that_stop_mid_prompt(b: Engine) -> None:
    b.reset()
    m = b.metrics()
    loaded = b.generate([Q, R])
    assert delta(b, m)["loaded_tokens"] == 2 * CHUNK + CHUNK
    b.reset()
    assert b.generate([Q, R], cold=True) == loaded


def test_flipped_byte_is_recomputed(b: Engine, server: ServerProcess) -> None:
    s = prompt(200, 4)
    m = b.metrics()
    cold = b.generate([s], cold=True)  # B computes s and saves its 4 chunks
    stored(server, s)
    f = file_of(server, s[CHUNK : 2 * CHUNK])
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x40  # inside the payload's last layer
    f.write_bytes(bytes(data))
    b.reset()
    m = b.metrics()
    assert b.generate([s]) == cold
    d = delta(b, m)
    assert d["loaded_tokens"] == CHUNK and d["recomputed_tokens"] == len(s) - 1 - CHUNK
    assert d["load_misses"] + d["load_rejected"] >= 1  # the server refused it: a miss


def test_segment_of_another_model_is_refused(b: Engine, server: ServerProcess) -> None:
    s = prompt(200, 5)
    m = b.metrics()
    cold = b.generate([s], cold=True)
    stored(server, s)
    f = file_of(server, s[:CHUNK])
    seg = KVSegment.decode(f.read_bytes())
    other = KVSegment.from_tensor(
        seg.payload,
        key=seg.key,
        parent=seg.header.parent,
        tokens=seg.tokens,
        fingerprint=bytes(16),
        base_position=seg.header.base_position,
    )  # valid bytes, checksums and key: only the fingerprint says it is another model's
    asyncio.run(replace(server, other))  # through the API: the server checks its own files
    b.reset()
    m = b.metrics()
    assert b.generate([s]) == cold
    d = delta(b, m)
    assert d["load_rejected"] == 1 and d["loaded_tokens"] == 0, d
    assert d["recomputed_tokens"] == len(s) - 1


def test_server_killed_during_loads(b: Engine, server: ServerProcess, cold_a) -> None:
    b.reset()
    want = cold_a + b.generate([Q, R], cold=True)
    b.reset()
    killer = threading.Timer(0.2, lambda: server.stop(kill=True))
    killer.start()
    try:
        assert b.generate([P1, P2, Q, R]) == want  # nothing failed, nothing wrong
        b.reset()
        assert b.generate([P1, P2, Q, R]) == want  # and with the server gone for good
    finally:
        killer.join()
        server.start()


def test_namespaces_through_tokens_never_cross(b: Engine, server, tiny, cold_a) -> None:
    b.close()  # one engine at a time
    c = Engine(tiny, extra(server, "tok-b-123456")).start()
    try:
        assert c.generate([P1, P2]) == cold_a
        m = c.metrics()
        assert m["loaded_tokens"] == 0 and m["load_rejected"] == 0
    finally:
        c.close()
