"""The server takes memory for a Put as its bytes arrive, never from the size a client
declares, and one server-wide budget bounds what Puts in flight hold."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time

import grpc
import psutil
import pytest
import torch

from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.launch import ServerProcess
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.tensor_header import tensor_header

MiB = 1 << 20
BUDGET = 16 * MiB
RESET = -2  # a data plane PUT refused while its bytes were still in flight
# The 64 MiB the clients send (gRPC reads each frame before the handler can refuse it) and
# allocator noise; the 64 declared segments are 16 GiB.
BOUND = 64 * MiB + 40 * MiB


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(args=["--max-inflight-bytes", str(BUDGET), "--cpu-bytes", "64MiB"]).start()
    yield s
    s.stop(kill=True)


async def held_puts(target: str, rss, streams: int = 64) -> tuple[int, list]:
    """`streams` Puts that each declare 256 MiB and send 1 MiB, then hang: the server's RSS
    growth while they are open, and each call's status once they are cancelled."""
    limit = 4 * MiB
    opts = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    ch = grpc.aio.insecure_channel(target, options=opts)
    put = ch.stream_unary(
        "/tierkv.v1.TierKV/Put",
        request_serializer=lambda b: b,
        response_deserializer=pb.PutResponse.FromString,
    )
    hang = asyncio.Event()

    async def frames(i: int):
        head = pb.PutHeader(key=i.to_bytes(16, "little"), total_bytes=256 * MiB, num_frames=256)
        yield pb.PutFrame(seq=0, header=head).SerializeToString()
        yield pb.PutFrame(seq=1, data=os.urandom(MiB)).SerializeToString()
        await hang.wait()

    calls = [put(frames(i)) for i in range(streams)]
    before = rss()
    await asyncio.sleep(3.0)  # every stream's first MiB has arrived
    grown = rss() - before
    codes = []
    for c in calls:
        c.cancel()
    for c in calls:
        try:
            await c
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as e:
            codes.append(e.code())
        except asyncio.CancelledError:
            codes.append(grpc.StatusCode.CANCELLED)
    await ch.close()
    return grown, codes


def test_declared_sizes_reserve_nothing(server) -> None:
    proc = psutil.Process(server.proc.pid)
    grown, codes = asyncio.run(held_puts(server.target, lambda: proc.memory_info().rss))
    assert grown <= BOUND, f"RSS grew by {grown / MiB:.0f} MiB"
    # Past the budget a Put is refused as it arrives: 16 streams fit, the rest are refused.
    refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert 64 - BUDGET // MiB <= refused < 64, codes
    # Every byte went back to the budget: a put of 12 MiB (of the 16) still goes through.
    seg = KVSegment.from_tensor(
        torch.randn(48, 2, 256, 4, 64).to(torch.bfloat16),
        key=b"k" * 16,
        parent=bytes(16),
        tokens=list(range(256)),
        fingerprint=b"f" * 16,
    )

    async def roundtrip() -> bool:
        tier = RemoteTier(target=server.target)
        try:
            return bool(await tier.put(seg.key, seg)) and await tier.get(seg.key) is not None
        finally:
            await tier.close()

    assert asyncio.run(roundtrip())


def big_header(key: bytes) -> tuple[int, bytes]:
    """(its segment's length, the encoded header) of a 128 MiB segment: a PUT gets past the
    header check with it (its layers' checksums are never reached)."""
    kv = torch.empty(32, 2, 1024, 8, 128, dtype=torch.bfloat16, device="meta")
    h = tensor_header(kv, key, bytes(16), torch.arange(1024), b"f" * 16, 0, "none", None)
    h.checksums = [0] * h.num_layers
    return h.nbytes, h.encode()


def data_plane_puts(target: str, rss, sessions: int = 60) -> tuple[int, list[int]]:
    """`sessions` data plane PUTs (TCP) that each declare 128 MiB with a valid header and send
    1 MiB more, then hang:
    the RSS growth while they are open, and each one's status: BUSY, RESET (refused with our
    bytes unread, so the kernel reset the connection) or -1 (still receiving)."""
    from tierkv.cacheserver.dataplane.protocol import BUSY, HEAD, HELLO, PUT, WELCOME, pack

    async def port() -> int:
        t = RemoteTier(target=target)
        try:
            return int((await t.stub.DataPlane(pb.DataPlaneRequest(), **t._opts())).tcp_port)
        finally:
            await t.close()

    tcp = asyncio.run(port())
    socks = []
    before = rss()
    for i in range(sessions):
        sock = socket.create_connection(("127.0.0.1", tcp), 10)
        sock.sendall(pack(HELLO, 0))
        assert (
            HEAD.unpack(sock.recv(HEAD.size + WELCOME.size, socket.MSG_WAITALL)[: HEAD.size])[0]
            == 0
        )
        key = i.to_bytes(16, "little")
        total, header = big_header(key)
        head = pack(PUT, 1, key + total.to_bytes(8, "little")) + header
        try:
            sock.sendall(head + os.urandom(MiB))
        except OSError:  # refused while we were still sending
            pass
        socks.append(sock)
    time.sleep(2.0)  # every session's MiB has arrived
    grown = rss() - before
    codes = []
    for sock in socks:
        sock.setblocking(False)
        try:
            codes.append(HEAD.unpack(sock.recv(HEAD.size))[0])
        except BlockingIOError:
            codes.append(-1)  # still receiving: its MiB holds budget
        except (ConnectionResetError, struct.error):
            codes.append(RESET)
        sock.close()
    assert set(codes) <= {BUSY, RESET, -1}
    return grown, codes


def test_data_plane_puts_reserve_nothing_either(server) -> None:
    proc = psutil.Process(server.proc.pid)
    from tierkv.cacheserver.dataplane.protocol import BUSY

    grown, codes = data_plane_puts(server.target, lambda: proc.memory_info().rss)
    assert grown <= BUDGET + 40 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"
    refused = codes.count(BUSY) + codes.count(RESET)
    assert codes.count(-1) <= BUDGET // MiB and refused >= 60 - BUDGET // MiB, codes
    seg = KVSegment.from_tensor(
        torch.randn(48, 2, 256, 4, 64).to(torch.bfloat16),
        key=b"d" * 16,
        tokens=list(range(256)),
        fingerprint=b"f" * 16,
    )

    async def roundtrip() -> bool:  # every byte went back to the budget
        from tierkv.cacheserver.dataplane.client import DataTier

        tier = DataTier(target=server.target, shared_memory=False)
        try:
            ok = bool(await tier.put(seg.key, seg))
            got = await tier.get(seg.key)
            return ok and got is not None and tier._session is not None
        finally:
            await tier.close()

    time.sleep(0.5)  # the closed sessions' bytes go back
    assert asyncio.run(roundtrip())
