"""The shared-memory region of one data plane session, and the allocator of its ranges.

The server makes a region per session and hands its fd over the Unix socket; the client maps
it (protocol in cacheserver.dataplane.protocol). Only the server allocates ranges; the client
releases them with its next request.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

from tierkv.storage_backends.invariants import invariant

ALIGN = 4096  # ranges start on page boundaries


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

    def close(self) -> bool:
        """Unmap and close the fd; False when a view of the mapping is still alive (the mapping,
        and the fd mmap keeps, go when the last one does)."""
        self.close_fd()
        try:
            self.map.close()
        except BufferError:
            return False
        return True
