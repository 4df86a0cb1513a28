"""KV cache events in vLLM's wire format, without vLLM: msgspec Structs laid out as
`vllm.distributed.kv_events` lays out its own, and a ZMQ publisher that speaks its
`ZmqEventPublisher`'s protocol.

Wire: each batch is a PUB multipart `[topic, seq (8 bytes, big-endian), payload]`, the payload a
msgpack `[ts, [event, ...]]` (the batch is array-like; each event a map tagged by its class name
under "type", defaults omitted). The replay socket is a ROUTER: a request `[identity, b"",
start seq (8 bytes)]` gets every kept batch from that seq on as `[identity, b"", topic, seq,
payload]`, then `[identity, b"", b"", -1 (8 bytes, signed), b""]`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

log = logging.getLogger("tierkv.engine.serve")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# Block hashes are unsigned 64-bit ints, as vLLM writes its own by default
# (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


LOOPBACK = ("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:")


def bind_or_connect(sock: zmq.Socket, endpoint: str) -> None:
    """As vLLM: wildcard, ipc and inproc endpoints are bound, the rest connected to; and a
    loopback tcp endpoint is bound too (vLLM would connect), so a replica can publish to this
    host's subscribers only."""
    local = endpoint.startswith(LOOPBACK)
    if local or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


@dataclass(slots=True, eq=False)
class Publisher:
    """Events added from any thread go out from one thread, in batches of what arrived since
    the last one (every `interval_s` at most). Past `limit` waiting events new ones are
    dropped and counted, never waited for."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    limit: int = 100_000
    interval_s: float = 0.05
    dropped: int = 0
    seq: int = 0
    pending: deque = field(default_factory=deque)
    kept: deque = field(init=False)  # (seq, payload) for replay
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread = field(init=False)
    ctx: zmq.Context = field(init=False)
    pub: zmq.Socket = field(init=False)
    replay: zmq.Socket | None = None

    def __post_init__(self) -> None:
        self.kept = deque(maxlen=self.buffer_steps)
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        bind_or_connect(self.pub, self.endpoint)
        if self.replay_endpoint is not None:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind(self.replay_endpoint)
        self.thread = threading.Thread(target=self._run, name="tierkv-kv-events", daemon=True)
        self.thread.start()

    def add(self, events: list[KVCacheEvent]) -> None:
        with self.lock:
            room = max(0, self.limit - len(self.pending))
            self.pending.extend(events[:room])
            self.dropped += max(0, len(events) - room)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        topic = self.topic.encode()
        poller = zmq.Poller()
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        while True:
            stop = self.stopping.is_set()
            if self.replay is not None:
                if dict(poller.poll(int(self.interval_s * 1000))):
                    self._serve_replay(topic)
            else:
                self.stopping.wait(self.interval_s)
            with self.lock:
                events, self.pending = list(self.pending), deque()
            if events:
                payload = enc.encode(KVEventBatch(time.time(), events))
                self.pub.send_multipart((topic, self.seq.to_bytes(8, "big"), payload))
                self.kept.append((self.seq, payload))
                self.seq += 1
            if stop:
                return

    def _serve_replay(self, topic: bytes) -> None:
        assert self.replay is not None
        frame = self.replay.recv_multipart()
        if len(frame) != 3:
            log.warning("kv events: a replay request of %d frames ignored", len(frame))
            return
        client, _, start = frame
        first = int.from_bytes(start, "big")
        for seq, payload in list(self.kept):
            if seq >= first:
                self.replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))
