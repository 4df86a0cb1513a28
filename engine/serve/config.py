"""ServeConfig: every knob of the HTTP server (the engine's own are the CLI's engine options)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ServeConfig:
    # Address to bind; loopback by default: exposing a model server is a deliberate choice.
    host: str = "127.0.0.1"
    port: int = 8000  # HTTP port; 0 picks a free one (printed at start)
    # When set, every /v1 request needs `Authorization: Bearer <api_key>` (else 401);
    # /health and /metrics stay open for probes and scrapers.
    api_key: str | None = None
    model_name: str = "tierkv"  # the id /v1/models lists; requests may name it or omit it
    # Requests admitted at once (queued or running in the engine). Beyond it a request gets 429
    # at once: a bounded queue answers overload instead of letting latency grow unbounded.
    max_pending: int = 256
    max_n: int = 16  # most samples (n) one request may ask for
    max_logprobs: int = 20  # most top logprobs per token (the OpenAI API allows 20)
    default_max_tokens: int = 16  # completions' max_tokens when omitted (the OpenAI default)
    # chat's max_tokens when omitted: chat runs to the context limit, capped here so a
    # forgotten max_tokens cannot hold a slot for long
    default_chat_max_tokens: int = 512
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    # How long the engine thread sleeps when idle before rechecking (a new request wakes it).
    idle_wait_s: float = 0.05
    # A prefill (kv_transfer_params.do_remote_decode) waits at most this long for its KV to reach
    # the shared tier before it answers; what is not there by then the decode side recomputes.
    pd_flush_timeout_s: float = 10.0
    # KV cache events in vLLM's wire format (ZMQ PUB of msgpack batches), as vLLM's
    # KVEventsConfig: the PUB endpoint; None = off; tcp://*:5557 binds, tcp://host:5557 connects
    kv_events_endpoint: str | None = None
    # a ROUTER endpoint that replays kept batches to a subscriber that missed some; None = off
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""  # the topic frame of every event batch
    kv_events_buffer_steps: int = 10_000  # event batches kept for replay

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_pending < 1 or self.max_n < 1:
            raise ValueError("max_pending and max_n must be >= 1")
        if self.pd_flush_timeout_s <= 0 or self.kv_events_buffer_steps < 1:
            raise ValueError("pd_flush_timeout_s and kv_events_buffer_steps must be > 0")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when set")
