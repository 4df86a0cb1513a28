"""Workflow hints through vLLM's own envelope (`kv_hints` on LLMEngine.add_request) into a real
tierkv-server: a tierkv.workflow action tags the request's chunk parts in the caller's
namespace (pending until their saves land), never another's; a malformed one, or another
component's action, tags nothing; answers are the same with or without hints (fp32, a tiny
random Llama, chunks of 64 tokens)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.conftest import prompt
from tests.vllm.harness import Engine
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.launch import ServerProcess

TOKENS = "tok-a-123456=team-a,tok-b-123456=team-b"
HINT = {"workflow": "w", "agent": "coder", "next_use": {"coder": 0, "reviewer": 2}}


def action(payload: object, version: str = "1", kind: str = "tierkv.workflow") -> dict:
    return {"action_id": "a", "action_type": kind, "action_version": version, "payload": payload}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(args=["--cpu-bytes", "64MiB", "--tokens", TOKENS]).start()
    yield s
    s.stop(kill=True)


def hints(server: ServerProcess, token: str) -> tuple[int, int]:
    """(tagged, pending) keys of token's namespace, from the server's Stats."""

    async def go():
        t = RemoteTier(target=server.target, token=token)
        try:
            s = await t.server_stats()
            assert s is not None
            return s.hints.tagged, s.hints.pending
        finally:
            await t.close()

    return asyncio.run(go())


def test_kv_hints_envelope_tags_chunk_parts(server: ServerProcess, tiny: Path) -> None:
    extra = {"remote": f"grpc://{server.target}", "token": "tok-a-123456", "chunk_size": 64}
    e = Engine(tiny, {**extra, "cpu_bytes": 0, "load_timeout_s": 20.0}).start()
    try:
        p1, p2, p3 = prompt(300, 11), prompt(200, 12), prompt(200, 13)
        bad = [action({**HINT, "agent": "no spaces!"}), action(HINT, version="2")]
        other = [action({"anything": 1}, kind="someone.else")]
        plain = e.generate([p2, p3], cold=True)
        # Malformed tierkv actions and other components' actions: ignored, same answers
        assert e.generate([p2], kv_hints=bad[:1]) == plain[:1]
        assert e.generate([p3], kv_hints=bad[1:] + other) == plain[1:]
        assert hints(server, "tok-a-123456") == (0, 0)
        got = e.generate([p1], kv_hints=[action(HINT)] + other)
        assert got == e.generate([p1], cold=True)
        # 300 tokens: 4 full chunks of 64 and a partial one, 2 KV head parts each. The tags
        # go in the background: wait for them, then for the saves that make them held.
        deadline = time.monotonic() + 60
        while hints(server, "tok-a-123456")[0] < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hints(server, "tok-a-123456")[0] == 10
        while hints(server, "tok-a-123456")[1] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hints(server, "tok-a-123456") == (10, 0)
        assert hints(server, "tok-b-123456") == (0, 0)
    finally:
        e.close()
