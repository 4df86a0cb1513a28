"""The same-host data plane's shared pieces: the session region, its allocator, the framing.

A client beside the server opens a Unix socket, sends HELLO with its bearer token and gets
back a memfd (SCM_RIGHTS): its session's region, mapped by both processes. A GET names keys;
the server copies each segment's encoded bytes (header + payload, the one encoding) from its
tiers into free ranges of the region and answers (offset, length) per key; the client reads
them there and later RELEASEs the ranges (piggybacked on its next request). gRPC stays the
control plane (lookups, puts, stats); only payload bytes of loads move this way.

A client on another host uses the same protocol over the server's TCP data port: HELLO is
answered without a region, and a GET is answered by OK with an empty body, then per key in
order its REPLY (offset 0), encoded header and payload bytes (nothing to RELEASE).

STREAM (either socket) names keys and is answered layer-major: OK, then frames (FRAME) of
layer 0 of every key, then of layer 1, and so on; a key's first frame carries its encoded
header. A layer lies in the session's region (one range per key, layer l at the range's
offset + l x layer bytes; the client RELEASEs the range) or, where the region has no room and
over TCP, follows its frame inline. A key missing or failing midway gets a frame with 0 layer
bytes and the reason; every key ends with its last layer or such a frame.

PUT (either socket) names one key and the encoded segment's length in its body; the encoded
bytes follow on the socket. The server takes memory as they arrive, under its in-flight
budget (past it: BUSY, and the session closes), checks the whole segment as a gRPC Put is
checked, and answers OK with count 1 when it stored it.

Safety contract:
- a region belongs to one session, made fresh (zero-filled by the kernel) for it: it only ever
  holds bytes of that session's namespace, taken from the caller's token;
- the server never reuses a range before the client released it, and frees the whole region
  when the socket closes, however the client died;
- every message is checked (op, counts, lengths, offsets) before it is acted on; a malformed
  one closes the session.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import struct
from dataclasses import dataclass, field

from tierkv.storage_backends.invariants import invariant

ALIGN = 4096  # ranges start on page boundaries
# Requests: op, count, body bytes. Replies: status, count, body bytes.
HEAD = struct.Struct("<IIQ")
REPLY = struct.Struct(
    "<QQI"
)  # GET reply, per key: region offset, payload bytes (0: miss), header bytes
HELLO, GET, RELEASE, PUT, STREAM = 1, 2, 3, 4, 5
OK, UNAUTHENTICATED, BAD_REQUEST, BUSY = 0, 1, 2, 3
# A GET reply's offset for a key the region had no room for (its size is 0): load it another
# way. A miss is offset 0, size 0.
FULL = (1 << 64) - 1
# A STREAM reply's frames: key index, layer, header bytes, layer bytes (0: the key is dropped,
# and hlen bytes of reason follow), region offset of the layer (INLINE: its bytes follow).
FRAME = struct.Struct("<IIIQQ")
INLINE = FULL
MAX_KEYS = 4096  # keys in one GET
MAX_BODY = 64 * 1024  # request bodies: a token or at most MAX_KEYS keys/offsets


@dataclass(slots=True)
class RangeAllocator:
    """First-fit ranges of ALIGN-rounded sizes in [0, size): free ranges kept sorted and merged."""

    size: int
    free: list[tuple[int, int]] = field(default_factory=list)  # (offset, length), by offset
    used: dict[int, int] = field(default_factory=dict)  # offset -> length

    def __post_init__(self) -> None:
        if self.size < ALIGN or self.size % ALIGN:
            raise ValueError(f"region size must be a positive multiple of {ALIGN}, got {self.size}")
        self.free = [(0, self.size)]

    def alloc(self, n: int) -> int | None:
        """The offset of a range of at least n bytes, or None (nothing taken) when none fits."""
        if n <= 0:
            raise ValueError(f"cannot allocate {n} bytes")
        n = -(-n // ALIGN) * ALIGN
        for i, (off, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = (off + n, length - n)
                self.used[off] = n
                return off
        return None

    def release(self, off: int) -> None:
        """Give back the range at off; ValueError when off is not an allocated range."""
        n = self.used.pop(off, None)
        if n is None:
            raise ValueError(f"offset {off} is not an allocated range")
        i = next((j for j, (o, _) in enumerate(self.free) if o > off), len(self.free))
        self.free.insert(i, (off, n))
        if i + 1 < len(self.free) and off + n == self.free[i + 1][0]:  # merge with the next
            self.free[i] = (off, n + self.free.pop(i + 1)[1])
        if i and self.free[i - 1][0] + self.free[i - 1][1] == off:  # and the previous
            prev = self.free[i - 1]
            self.free[i - 1] = (prev[0], prev[1] + self.free.pop(i)[1])

    def check_integrity(self) -> None:
        """Free and used ranges tile [0, size) exactly, free ones sorted and merged."""
        spans = sorted(list(self.free) + list(self.used.items()))
        pos = 0
        for off, n in spans:
            invariant(off == pos and n > 0 and off % ALIGN == 0, f"range ({off}, {n}) at {pos}")
            pos += n
        invariant(pos == self.size, f"ranges cover {pos} of {self.size} bytes")
        for (a, n), (b, _) in zip(self.free, self.free[1:]):
            invariant(a + n < b, f"free ranges at {a} and {b} are unsorted or unmerged")


@dataclass(slots=True, eq=False)
class Region:
    """A memfd of `size` bytes and this process's shared mapping of it."""

    fd: int
    size: int
    map: mmap.mmap

    @staticmethod
    def create(size: int, name: str = "tierkv-session") -> Region:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return Region(fd, size, mmap.mmap(fd, size))
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def attach(fd: int) -> Region:
        """Map a region received from the server (takes ownership of fd; the mapping keeps
        the memory, so the fd is closed at once)."""
        try:
            size = os.fstat(fd).st_size
            return Region(-1, size, mmap.mmap(fd, size))
        finally:
            os.close(fd)

    def close_fd(self) -> None:
        """Close the fd once it was handed over; the mapping stays."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmap (once no view of the mapping is alive) and close the fd."""
        try:
            self.map.close()
        except BufferError:  # a view still exists: the mapping goes when it does
            pass
        self.close_fd()


def pack(code: int, count: int, body: bytes = b"") -> bytes:
    return HEAD.pack(code, count, len(body)) + body


async def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """n bytes from a non-blocking socket; EOFError when it closes first."""
    try:  # most messages are already there: no future, no loop round
        first = sock.recv(n)
    except (BlockingIOError, InterruptedError):
        first = b""
    else:
        if not first and n:
            raise EOFError("connection closed")
    if len(first) == n:
        return first
    buf = bytearray(n)
    buf[: len(first)] = first
    await recv_into(sock, memoryview(buf)[len(first) :])
    return bytes(buf)


async def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill view from a non-blocking socket (the kernel's copy only); EOFError when it closes
    first."""
    loop, got, n = asyncio.get_running_loop(), 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
