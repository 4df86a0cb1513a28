"""Gets over the TCP data port are sent from the cpu tier's own pages (no copy), held while
they are sent: against a real tierkv-server process with a small cpu tier, deletes,
overwrites and evicting puts racing gets and STREAMs never put another key's or another
namespace's bytes on the wire (hypothesis), and a client killed mid-read frees what its send
held."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.launch import ServerProcess
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.segment import KVSegment

TOKENS = {"a": "alpha-token-1", "b": "beta-token-22"}
MiB = 1 << 20


def segment(k: int, ns: str, version: int, tokens: int = 512) -> KVSegment:
    """Key k's content in namespace ns, version `version`: every (k, ns, version) differs."""
    g = torch.Generator().manual_seed(k * 1000 + version * 10 + (ns == "b"))
    kv = torch.randn(4, 2, tokens, 2, 64, generator=g).to(torch.bfloat16)  # 2 MiB at 512
    return KVSegment.from_tensor(kv, key=key(k), tokens=list(range(tokens)), fingerprint=b"f")


def key(k: int) -> bytes:
    return bytes([k + 1]) * 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # a cpu tier of five 2 MiB segments and no disk: puts evict what gets are sending
    args = ["--cpu-bytes", "10MiB", "--disk-bytes", "0"]
    tokens = ",".join(f"{t}={ns}" for ns, t in TOKENS.items())
    s = ServerProcess(args=[*args, "--tokens", tokens]).start()
    yield s
    s.stop(kill=True)


STORED: dict[tuple[str, int], set[bytes]] = {}  # every payload each key ever had, all examples
VERSIONS: list[int] = []

OPS = st.lists(
    st.tuples(
        st.sampled_from(["get", "stream", "put", "del"]), st.sampled_from("ab"), st.integers(0, 7)
    ),
    min_size=4,
    max_size=24,
)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_racing_deletes_and_evictions_never_mix_bytes(server: ServerProcess, ops) -> None:
    async def run() -> None:
        data = {
            ns: DataTier(target=server.target, token=t, shared_memory=False)
            for ns, t in TOKENS.items()
        }
        ctl = {ns: RemoteTier(target=server.target, token=t) for ns, t in TOKENS.items()}
        stored = STORED  # the server outlives an example: what earlier examples stored stays
        version = len(VERSIONS)

        async def op(kind: str, ns: str, k: int) -> None:
            nonlocal version
            if kind == "put":
                version += 1
                VERSIONS.append(version)
                s = segment(k, ns, version)
                stored.setdefault((ns, k), set()).add(bytes(s.payload.view(torch.uint8).numpy()))
                await data[ns].put(s.key, s)
            elif kind == "del":
                await ctl[ns].delete(key(k))
            elif kind == "stream":
                sink = Collect()
                await data[ns].stream([key(k)], "default", sink)  # the token names the ns
                if sink.whole():  # layer by layer, each checked by the client
                    assert bytes(sink.buf) in stored.get((ns, k), set()), "bytes never stored"
            else:
                got = await data[ns].get(key(k))
                if got is not None:  # checked by the client: its own key, whole
                    assert got.verified and got.key == key(k)
                    raw = bytes(got.payload.view(torch.uint8).numpy())
                    assert raw in stored.get((ns, k), set()), "bytes never stored under this key"

        try:
            for i in range(0, len(ops), 4):  # four at a time, racing on the server
                await asyncio.gather(*(op(*o) for o in ops[i : i + 4]))
            for ns, t in data.items():
                if any(o[0] != "del" and o[1] == ns for o in ops):
                    assert t._session is not None and t._session.region is None  # TCP port
        finally:
            for t in [*data.values(), *ctl.values()]:
                await t.close()

    asyncio.run(run())


class Collect:
    """A LayerSink keeping one key's layers (or why it was dropped)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.layers = 0
        self.num_layers = -1
        self.dropped = ""

    def open(self, i: int, header) -> bool:
        self.buf = bytearray(header.payload_raw_nbytes)
        self.num_layers, self.n = header.num_layers, header.layer_raw_nbytes
        return True

    def into(self, i: int, layer: int) -> memoryview:
        self.layers = layer + 1
        return memoryview(self.buf)[layer * self.n : (layer + 1) * self.n]

    def drop(self, i: int, why: str) -> None:
        self.dropped = why

    async def ready(self, layer: int) -> None:
        pass

    def whole(self) -> bool:
        return not self.dropped and self.layers == self.num_layers > 0


READER = """
import socket, sys
from tierkv.cacheserver.dataplane.protocol import GET, HEAD, HELLO, pack
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 10)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
sock.sendall(pack(HELLO, 0, sys.argv[2].encode()))
sock.recv(HEAD.size + 8)
sock.sendall(pack(GET, 1, bytes.fromhex(sys.argv[3])))
print("asked", flush=True)
sys.stdin.read()  # never reads the reply: the server's send stalls on a full socket
"""


def test_a_client_killed_mid_read_frees_the_pages_it_held(server: ServerProcess) -> None:
    async def port() -> int:
        t = RemoteTier(target=server.target, token=TOKENS["a"])
        try:
            return int((await t.stub.DataPlane(pb.DataPlaneRequest(), **t._opts())).tcp_port)
        finally:
            await t.close()

    async def put(k: int, version: int, tokens: int) -> bool:
        t = DataTier(target=server.target, token=TOKENS["a"], shared_memory=False)
        try:
            return await t.put(key(k), segment(k, "a", version, tokens))
        finally:
            await t.close()

    async def delete(k: int, ns: str = "a") -> bool:
        t = RemoteTier(target=server.target, token=TOKENS[ns])
        try:
            return await t.delete(key(k))
        finally:
            await t.close()

    for k in range(8):  # an empty tier
        for ns in TOKENS:
            asyncio.run(delete(k, ns))
    assert asyncio.run(put(0, 100, 4096))  # 8 MiB of the tier's 10
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(asyncio.run(port())), TOKENS["a"], key(0).hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "asked"
        time.sleep(0.5)  # the send is under way, stalled
        assert asyncio.run(delete(0))
        # the deleted segment's pages are still being sent from: no room for another 8 MiB
        assert not asyncio.run(put(1, 101, 4096))
        reader.send_signal(signal.SIGKILL)
        reader.wait(10)
        deadline = time.monotonic() + 10
        while not asyncio.run(put(1, 102, 4096)):  # the killed read's pages come back
            assert time.monotonic() < deadline, "the killed client's pages were never freed"
            time.sleep(0.2)
    finally:
        reader.kill()
        reader.wait(10)
