"""A payload received from a data plane socket and checked layer by layer.

xxh3 hashes a layer some twenty times faster than a socket delivers it. Hashing each layer as
soon as it arrived, while the sender goes on filling the socket's receive buffer with the next
one, takes every checksum but the last layer's off the transfer's critical path; hashing the
whole payload after its last byte adds all of them to it. A layer received on its own costs a
wake-up more when its bytes are not all there yet, so small layers are received whole and
hashed after. (A worker thread hashing layer l while this one waits for layer l+1 measured
slower: python-xxhash holds the GIL, and the hand-off costs more than it overlaps.)

Safety contract: `recv_checked` receives the whole payload or raises (the connection's framing
holds either way), and reports every layer whose checksum differs from the header's; the caller
hands out nothing of a payload with such a layer.
"""

from __future__ import annotations

from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.storage_backends.header import SegmentHeader, checksum

# Smallest layer received and hashed on its own (TCP loopback gets of 1, 4 and 32 MiB: below
# it the extra wake-ups cost more than the overlap saves).
LAYERWISE = 256 * 1024


async def recv_checked(conn: Conn, h: SegmentHeader, buf: memoryview) -> list[int]:
    """Receive h's raw payload into buf; the layers whose checksum differs from h's (empty:
    every layer checked out)."""
    n, layers = h.layer_raw_nbytes, h.num_layers
    at = [buf[i * n : (i + 1) * n] for i in range(layers)]
    if n < LAYERWISE:
        await conn.recv_into(buf[: layers * n])
        return [i for i in range(layers) if checksum(at[i]) != h.checksums[i]]
    bad = []
    for i in range(layers):
        await conn.recv_into(at[i])
        if checksum(at[i]) != h.checksums[i]:
            bad.append(i)
    return bad
