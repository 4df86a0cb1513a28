"""Faults with real processes and filesystems: the cache server SIGKILLed or SIGTERMed under a
stream of puts, a client reconnecting after a long outage, a disk that refuses writes (a
tmpfs mount that fills up, then is remounted read-only), and slow tiers against the
engine's deadlines. (tests/test_server.py and tests/test_remote_tier.py already cover a
single SIGTERM with two streams and a dead server; these add load and the restart checks.)"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.frames import put_frames
from tierkv.cacheserver.launch import ServerProcess
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.store import TieredStore


def segment(seed: int, tokens: int = 64) -> KVSegment:
    kv = torch.randn(4, 2, tokens, 2, 32, generator=torch.Generator().manual_seed(seed)).half()
    return KVSegment.from_tensor(
        kv, key=seed.to_bytes(16, "little"), tokens=range(tokens), fingerprint=b"faults"
    )


def disk_files(server: ServerProcess) -> list[Path]:
    return [p for p in (server.cache_dir / "disk").rglob("*") if p.is_file()]


def putter(
    server: ServerProcess, seeds: range, acked: dict, stop: threading.Event, stall: bool
) -> None:
    """Put segments one after another; with stall, each stream pauses halfway (so a kill
    lands mid-stream). acked[seed] is True (stored) or the status code of a failure."""
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TierKVStub(ch)
        for seed in seeds:
            if stop.is_set():
                return
            s = segment(seed)
            frames = list(put_frames(s.key, s, 16 << 10))

            def gen():
                yield from frames[: len(frames) // 2]
                if stall:
                    time.sleep(0.2)
                yield from frames[len(frames) // 2 :]

            try:
                acked[seed] = stub.Put(gen(), timeout=10).stored
            except grpc.RpcError as e:
                acked[seed] = e.code()
                return


@pytest.mark.parametrize("kill", [True, False], ids=["SIGKILL", "SIGTERM"])
def test_server_killed_during_puts_restarts_clean(kill: bool) -> None:
    server = ServerProcess(args=["--grace-s", "2"]).start()
    acked: dict[int, object] = {}
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=putter,
            args=(server, range(i * 1000, i * 1000 + 400), acked, stop, i % 2),
            daemon=True,
        )
        for i in range(4)
    ]
    try:
        for t in threads:
            t.start()
        time.sleep(2.0)
        rc = server.stop(kill=kill)
        assert rc == (-9 if kill else 0)
        stop.set()
        for t in threads:
            t.join(15)
        on_disk = {bytes.fromhex(p.name[:32]) for p in disk_files(server) if p.suffix == ".tkv"}
        # A kill between write and rename leaves a temp file; one between header and payload
        # leaves a short file. The kill cannot be aimed that precisely, so plant both.
        ns_dir = server.cache_dir / "disk" / "default"
        cut = bytes(segment(9999).encode())[:5000]
        short = ns_dir / f"{segment(9999).key.hex()}.tkv"
        (ns_dir / f"{bytes(16).hex()}.1234abcd.tmp").write_bytes(cut)
        short.write_bytes(cut)
        server.start()
        assert not [p for p in disk_files(server) if p.suffix == ".tmp"]  # partial writes are gone
        assert not short.exists()
        assert len(acked) > 8 and any(v is True for v in acked.values())
        if not kill:  # graceful: in-flight streams finished (stored) or were refused whole
            assert all(
                v is True or v in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
                for v in acked.values()
            ), set(map(str, acked.values()))
        asyncio.run(_served_verify(server, sorted(acked), on_disk))
    finally:
        stop.set()
        server.stop(kill=True)


async def _served_verify(server: ServerProcess, seeds: list[int], on_disk: set[bytes]) -> None:
    tier = RemoteTier(target=server.target, timeout_s=10)
    keys = [s.to_bytes(16, "little") for s in seeds]
    present = await tier.contains(keys)
    # Every segment whose file was in place at the kill is served; no other one is.
    assert {k for k, p in zip(keys, present) if p} == on_disk and on_disk
    for seed, p in zip(seeds, present):
        if p:  # every byte served is the byte that was put
            got = await tier.get(seed.to_bytes(16, "little"))
            assert got is not None and torch.equal(got.payload, segment(seed).payload)
    assert tier.stats().errors == 0
    await tier.close()


async def test_client_reconnects_at_once_after_a_long_outage() -> None:
    """gRPC's default reconnect backoff grows towards 120 s: after a 10 s outage a client
    missed for ~9 s after the server was back. The client caps it at 1 s."""
    server = ServerProcess().start()
    tier = RemoteTier(target=server.target, retries=3, timeout_s=5)
    try:
        s = segment(1)
        assert await tier.put(s.key, s)
        server.stop(kill=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:  # the channel keeps failing to connect meanwhile
            assert await tier.contains([s.key]) == [False]
        await asyncio.to_thread(server.start)
        up = time.monotonic()
        while await tier.lookup([s.key]) is None:
            assert time.monotonic() - up < 2.5, "the client did not reconnect within 2.5 s"
        assert await tier.put(s.key, s)
    finally:
        await tier.close()
        server.stop(kill=True)


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 1 MiB tmpfs: a filesystem that really fills up and can be made read-only (tests run
    as root, where chmod does not stop writes)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_disk_full_then_read_only(small_fs: Path) -> None:
    cpu = CpuTier(CpuTierConfig(capacity_bytes="16MiB"))
    disk = DiskTier(
        DiskTierConfig(root=small_fs, capacity_bytes="64MiB")
    )  # more than the filesystem
    store = TieredStore([cpu, disk])
    segs = [segment(i) for i in range(20)]  # 64 KiB each: 1 MiB holds about 15
    for s in segs:
        assert await store.put(s.key, s)  # the cpu tier takes every one
    await store.drain()
    full = disk.stats()
    assert 5 < full.num_segments < 20 and full.errors == 20 - full.num_segments  # ENOSPC: counted
    assert not list(small_fs.rglob("*.tmp"))  # a failed write leaves nothing behind
    disk.check_integrity()
    for s in segs:  # every put is still served, from cpu
        got = await store.get(s.key)
        assert got is not None and torch.equal(got.payload, s.payload)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    on_disk = [s for s in segs if (await disk.contains([s.key]))[0]]
    for s in on_disk:  # reads still work
        assert torch.equal((await disk.get(s.key)).payload, s.payload)
    await disk.delete(on_disk[0].key)  # EROFS: the index forgets it, the error is counted
    late = segment(99)
    assert await store.put(late.key, late)
    await store.drain()
    assert not (await disk.contains([late.key]))[0] and disk.stats().errors > full.errors
    assert torch.equal((await store.get(late.key)).payload, late.payload)
    disk.check_integrity()
    await store.close()


class SlowTier(CpuTier):
    """A real cpu tier whose contains and put sleep first (tests only, not product)."""

    delay = 3.0

    async def contains(self, keys, ns="default"):
        await asyncio.sleep(self.delay)
        return await super().contains(keys, ns)

    async def put(self, key, segment, ns="default"):
        await asyncio.sleep(self.delay)
        return await super().put(key, segment, ns)


@pytest.mark.cpu_path
def test_slow_lookup_and_save_do_not_hold_the_engine() -> None:
    from tests.test_connector import CHUNK, GREEDY, PROMPT, engine
    from tierkv.connector import ConnectorConfig, TierKVConnector

    cold = engine().generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids
    tier = SlowTier(CpuTierConfig(capacity_bytes="16MiB"))
    conn = TierKVConnector(ConnectorConfig(chunk_size=CHUNK, lookup_timeout_s=0.3), tiers=[tier])
    try:
        llm = engine(conn)
        t0 = time.monotonic()
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
        took = time.monotonic() - t0
        assert out.token_ids == cold and out.metrics.external_tokens == 0
        assert took < 2.5, f"the engine waited {took:.1f} s on a tier that takes 3 s"
        tier.delay = 0.0  # the saves still queued need not take 3 s each
    finally:
        conn.close()


@pytest.mark.cpu_path
def test_hung_cache_server_does_not_hold_the_engine() -> None:
    """A real server process, SIGSTOPped: it accepts connections and answers nothing."""
    import signal

    from tests.test_connector import CHUNK, GREEDY, PROMPT, engine
    from tierkv.connector import ConnectorConfig, TierKVConnector

    cold = engine().generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids
    server = ServerProcess().start()
    cfg = ConnectorConfig(
        chunk_size=CHUNK,
        tiers=TiersConfig(cpu_bytes=0),
        remote=f"grpc://{server.target}",
        lookup_timeout_s=0.5,
        load_timeout_s=0.5,
    )
    writer = TierKVConnector(cfg)
    try:
        engine(writer).generate([PROMPT], GREEDY, use_tqdm=False)
        writer.flush()
        server.proc.send_signal(signal.SIGSTOP)
        reader = TierKVConnector(cfg)
        t0 = time.monotonic()
        out = engine(reader).generate([PROMPT], GREEDY, use_tqdm=False)[0]
        took = time.monotonic() - t0
        assert out.token_ids == cold and out.metrics.external_tokens == 0
        assert took < 3.0, f"the engine waited {took:.1f} s on a hung server"
        server.proc.send_signal(signal.SIGCONT)
        again = engine(reader).generate([PROMPT], GREEDY, use_tqdm=False)[0]
        assert again.token_ids == cold and again.metrics.external_tokens == len(PROMPT) - 1
        reader.close()
    finally:
        server.proc.send_signal(signal.SIGCONT)
        writer.close()
        server.stop(kill=True)
