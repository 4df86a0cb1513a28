"""A TCP GET's payloads received layer by layer and checked as they arrive
(cacheserver.dataplane.checked_recv), through a real socket pair fed the server's reply bytes:
a payload with a flipped byte is never handed out (its key is a SegmentError miss, and the
session's framing holds), a correct one is the exact bytes, for layers hashed whole and one by
one; replies altered anywhere never yield another payload's bytes; and pipelined GETs each
read their own reply."""

from __future__ import annotations

import asyncio
import socket

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.cacheserver.dataplane.checked_recv import LAYERWISE
from tierkv.cacheserver.dataplane.client_session import Got, Session, Want
from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.protocol import HEAD, OK, REPLY
from tierkv.storage_backends.segment import KVSegment, SegmentError

LAYER_TOKENS = LAYERWISE // 512  # tokens of a LAYERWISE-byte layer ([2, T, 2, 64] float16)


def segment(k: int, layers: int, tokens: int) -> KVSegment:
    g = torch.Generator().manual_seed(k)
    kv = torch.randn(layers, 2, tokens, 2, 64, generator=g).to(torch.float16)
    key = k.to_bytes(16, "little")
    return KVSegment.from_tensor(kv, key=key, tokens=list(range(tokens)), fingerprint=b"c")


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def reply(segs: list[KVSegment | None]) -> tuple[bytearray, list[int]]:
    """A TCP GET's reply as the server sends it (None: a miss), and where each payload starts."""
    out, starts = bytearray(HEAD.pack(OK, len(segs), 0)), []
    for s in segs:
        if s is None:
            out += REPLY.pack(0, 0, 0)
            starts.append(-1)
            continue
        head, payload = s.full_header().encode(), raw(s.payload)
        out += REPLY.pack(0, len(payload), len(head)) + head
        starts.append(len(out))
        out += payload
    return out, starts


async def get_all(wires: list[bytes], batches: list[list[Want]]) -> list[list[Got] | Exception]:
    """Each batch as one GET on one session, all in flight at once, the server's side writing
    wires back to back; each GET's answers or what it raised."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    s = Session(Conn(ours), None, 1 << 30)
    loop = asyncio.get_running_loop()

    async def serve() -> None:
        await loop.sock_sendall(theirs, b"".join(wires))
        theirs.shutdown(socket.SHUT_WR)

    try:
        got = await asyncio.gather(*(s.get(b) for b in batches), serve(), return_exceptions=True)
    finally:
        ours.close()
        theirs.close()
    return got[:-1]


def want(s: KVSegment | None, k: int, into: bool) -> Want:
    key = k.to_bytes(16, "little") if s is None else s.key
    out = torch.empty(s.payload.numel() + 7, dtype=torch.float16) if s and into else None
    return Want(key, out)


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(1, 5), st.sampled_from([8, 100, LAYER_TOKENS, LAYER_TOKENS + 37])),
        min_size=1,
        max_size=3,
    ),
    miss=st.booleans(),
    flip=st.none() | st.tuples(st.integers(0, 2), st.integers(0, 10**7), st.integers(1, 255)),
    into=st.booleans(),
)
def test_a_flipped_payload_byte_is_a_miss_and_the_rest_exact(shapes, miss, flip, into) -> None:
    segs: list[KVSegment | None] = [segment(i, n, t) for i, (n, t) in enumerate(shapes)]
    if miss:
        segs.insert(len(segs) // 2, None)
    wire, starts = reply(segs)
    bad = -1
    if flip is not None:
        bad = [i for i, at in enumerate(starts) if at >= 0][flip[0] % len(shapes)]
        flipped = segs[bad]
        assert flipped is not None
        wire[starts[bad] + flip[1] % len(raw(flipped.payload))] ^= flip[2]
    wants = [want(s, 99, into) for s in segs]
    again = [segment(7, 2, LAYER_TOKENS)]  # a second GET behind: the framing held

    first, second = asyncio.run(
        get_all([bytes(wire), bytes(reply(again)[0])], [wants, [want(again[0], 0, False)]])
    )
    assert isinstance(first, list) and isinstance(second, list)
    for i, (s, g) in enumerate(zip(segs, first)):
        if s is None:
            assert g is None
        elif i == bad:
            assert isinstance(g, SegmentError) and "checksum" in str(g)
        else:
            assert isinstance(g, tuple) and g[0].verified
            assert raw(g[0].payload) == raw(s.payload)
            if into:  # received straight into the caller's out
                assert g[0].payload.data_ptr() == wants[i].out.data_ptr()
    assert isinstance(second[0], tuple) and raw(second[0][0].payload) == raw(again[0].payload)


@settings(max_examples=60, deadline=None)
@given(
    at=st.integers(0, 10**7),
    x=st.integers(1, 255),
    cut=st.integers(0, 3),
    tokens=st.sampled_from([16, LAYER_TOKENS]),
)
def test_replies_altered_anywhere_never_yield_wrong_bytes(at, x, cut, tokens) -> None:
    """A byte flipped anywhere (head, reply records, headers, payloads), perhaps truncated:
    each GET raises, or answers each key with its exact bytes, a miss or an error."""
    segs = [segment(20 + i, 3, tokens) for i in range(2)]
    wires = [reply([segs[0]])[0], reply([None, segs[1]])[0]]
    joined = bytearray(b"".join(wires))
    joined[at % len(joined)] ^= x
    joined = joined[: len(joined) - cut * 1000]
    batches = [[want(segs[0], 0, False)], [want(None, 55, False), want(segs[1], 0, True)]]
    got = asyncio.run(get_all([bytes(joined)], batches))
    expected = [[segs[0]], [None, segs[1]]]
    for answers, exp in zip(got, expected):
        if isinstance(answers, Exception):
            continue
        for g, s in zip(answers, exp):
            if isinstance(g, tuple):
                assert s is not None and raw(g[0].payload) == raw(s.payload)
