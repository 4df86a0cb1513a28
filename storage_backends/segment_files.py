"""Segment files: reading headers, page-cache reads without a thread hop, aiofiles reads."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import aiofiles

from tierkv.storage_backends.segment import (
    PREFIX_NBYTES,
    KVSegment,
    SegmentError,
    SegmentHeader,
    checksum,
)


def read_header(path: Path) -> tuple[SegmentHeader, bytes] | None:
    """The header and prefix of a segment file whose length matches it, else None (partial or
    garbage)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(PREFIX_NBYTES)
            f.seek(0)
            h = SegmentHeader.decode(f.read(SegmentHeader.peek_nbytes(prefix)))
            return (h, prefix) if os.fstat(f.fileno()).st_size == h.nbytes else None
    except (OSError, SegmentError):
        return None


def read_cached(path: Path, spans: list[tuple[int, memoryview]], nbytes: int, check=None) -> bool:
    """Fill each (offset, buffer) span from the page cache without blocking (RWF_NOWAIT),
    calling check(j) after span j; False when some of it is not cached, so the caller reads
    on a worker thread instead: a cached read costs less than one thread hop."""
    if not hasattr(os, "RWF_NOWAIT"):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise SegmentError("file length does not match its header")
        for j, (off, buf) in enumerate(spans):
            if os.preadv(fd, [buf], off, os.RWF_NOWAIT) != len(buf):
                return False
            if check is not None:
                check(j)
        return True
    except BlockingIOError:
        return False
    except OSError as e:  # tmpfs and some others refuse RWF_NOWAIT: read the usual way
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return False
        raise
    finally:
        os.close(fd)


async def read_aio(path: Path, bufs: list[memoryview], nbytes: int) -> None:
    """Fill bufs, in order, with the whole file, on aiofiles' worker threads."""
    async with aiofiles.open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size != nbytes:
            raise SegmentError("file length does not match its header")
        for buf in bufs:
            got = 0
            while got < len(buf):  # an unbuffered read may return less than asked
                n = await f.readinto(buf[got:])
                if not n:
                    raise SegmentError("file shorter than its header says")
                got += n


def check_same_header(prefix: bytes, head) -> None:
    """The header now on disk must still be the one indexed (the file may have been replaced):
    the same prefix, whose checksum covers the rest of the header, and that checksum holds."""
    if bytes(head[:PREFIX_NBYTES]) != prefix:
        raise SegmentError("file header changed since it was indexed")
    if checksum(head[PREFIX_NBYTES:]) != int.from_bytes(prefix[-8:], "little"):
        raise SegmentError("header checksum mismatch")


def load(path: Path) -> KVSegment | None:
    """The verified segment in a file, or None."""
    try:
        return KVSegment.decode(path.read_bytes())
    except (OSError, SegmentError):
        return None
