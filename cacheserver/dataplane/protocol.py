"""The data plane's wire protocol, spoken by both sides: messages, replies, frames.

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

A client may send its next request before it read the reply to the last one (pipelining):
the server reads a session's requests one at a time and answers each, whole, before it reads
the next, so replies come back in request order.

PUT (either socket) names one key and the encoded segment's length in its body; the encoded
bytes follow on the socket. The server takes memory as they arrive, under its in-flight
budget (past it: BUSY, and the session closes), checks the whole segment as a gRPC Put is
checked, and answers OK with count 1 when it stored it.

GET_PART (TCP port, protocol version 2) names one key, then PART: (part, parts), 0 <= part <
parts <= MAX_PARTS. It asks for the key's layers [part_layers(L, part, parts)) of its L layers
(the client need not know L: each of `parts` requests on its own connection takes a share, a
striped load). It is answered as a GET of one key over TCP (OK; REPLY with the range's first
byte in the payload as its offset and the range's bytes as its size; the whole header; the
range's bytes), a miss as REPLY (0, 0, 0); an empty range (L < parts) has size 0 and its
header. A part or parts out of bounds is refused (BAD_REQUEST; the session closes, nothing
changes). HELLO's OK body is the region's bytes (u64, 0 over TCP) and the protocol version
(u32); a body without the version is version 1 (no GET_PART).

Safety contract:
- a region belongs to one session, made fresh (zero-filled by the kernel) for it: it only ever
  holds bytes of that session's namespace, taken from the caller's token;
- the server never reuses a range before the client released it, and frees the whole region
  when the socket closes, however the client died;
- every message is checked (op, counts, lengths, offsets) before it is acted on; a malformed
  one closes the session.
"""

from __future__ import annotations

import struct

import torch

# Requests: op, count, body bytes. Replies: status, count, body bytes.
HEAD = struct.Struct("<IIQ")
# A GET reply, per key: region offset, payload bytes (0: miss), header bytes.
REPLY = struct.Struct("<QQI")
HELLO, GET, RELEASE, PUT, STREAM, GET_PART = 1, 2, 3, 4, 5, 6
VERSION = 2  # the protocol version a server announces in HELLO's reply
WELCOME = struct.Struct("<QI")  # HELLO's OK body: region bytes, protocol version
PART = struct.Struct("<II")  # GET_PART's body after the key: part, parts
MAX_PARTS = 64
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


def part_layers(layers: int, part: int, parts: int) -> tuple[int, int]:
    """The layers [first, end) that part `part` of `parts` covers of a segment of `layers`."""
    return layers * part // parts, layers * (part + 1) // parts


def pack(code: int, count: int, body: bytes = b"") -> bytes:
    return HEAD.pack(code, count, len(body)) + body


def buffer(n: int) -> memoryview:
    """n bytes to receive or send from (virtual memory only: pages become resident as they
    are written; not zeroed, written before read)."""
    return torch.empty(n, dtype=torch.uint8).numpy().data
