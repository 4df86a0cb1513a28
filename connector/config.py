"""ConnectorConfig: every knob of the connector, and the tiered store it builds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, dataclass, field, replace
from typing import Any

from tierkv.storage_backends.build import (
    REDIS_SCHEMES,
    TiersConfig,
    build_tiers,
    flat_fields,
    nest,
)
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_namespace
from tierkv.storage_backends.sizes import parse_size
from tierkv.storage_backends.store import StoreConfig, TieredStore
from tierkv.storage_backends.tier import Tier

SERVER_SCHEMES = ("grpc://", "grpcs://")
REMOTE_SCHEMES = SERVER_SCHEMES + REDIS_SCHEMES


@dataclass(slots=True)
class ConnectorConfig:
    chunk_size: int = 256  # tokens per stored chunk; a multiple of the engine's block size
    # The local tiers (gpu, cpu, disk), and the knobs of the Redis tier when remote names Redis
    # (its URL is remote's, never tiers.redis_url); each knob is documented in TiersConfig.
    tiers: TiersConfig = field(default_factory=TiersConfig)
    # The shared tier: grpc://host:port (grpcs:// with TLS) for tierkv-server, redis://,
    # rediss:// or redis+cluster:// for Redis directly (TiersConfig.redis_url); None = local
    # tiers only.
    remote: str | None = None
    namespace: str = DEFAULT_NAMESPACE  # tenant; part of every key (the server maps tokens to it)
    token: str | None = None  # bearer token for tierkv-server
    tls_ca: str | None = None  # CA certificate (PEM path) for grpcs://
    kv_dtype: str = "auto"  # KV dtype in storage: auto (the engine cache's) | fp8 (e4m3, scales)
    # segment codec: none | lz4 | shuffle+lz4 (measure first: fp16 KV barely shrinks)
    codec: str = "none"
    # Also store a prompt's last, partial chunk: an exact repeat then loads all but its last
    # token instead of recomputing up to chunk_size tokens, at one extra segment per prompt.
    save_partial_chunks: bool = True
    save: bool = True  # store new prompt chunks after prefill (False: read-only client)
    lookup_timeout_s: float = 2.0  # the scheduler-side Lookup; a timeout is a miss
    load_timeout_s: float = 10.0  # a step's loads; past it the tokens are recomputed
    max_pending_saves: int = 256  # staged chunks waiting for their put; beyond it saves are dropped
    # Load staging kept between steps for reuse (pinned with CUDA); a step needing more
    # allocates the rest, and only up to this much is kept. 0 = allocate every load's anew.
    staging_bytes: int | str = "256MiB"
    metrics_port: int = 0  # serve Prometheus metrics on 127.0.0.1:PORT; 0 = off
    # Loads from a tierkv-server move over its data plane (gRPC still carries lookups and
    # saves): shared memory with a server on this host (grpc://127.0.0.1:PORT, localhost,
    # ::1), its TCP data port with one elsewhere. False: every load over gRPC streams.
    data_plane: bool = True
    shared_memory: bool = True  # with data_plane, a server on this host over shared memory
    # With data_plane over the TCP port: connections per session. More than 1 splits a STREAM
    # of several keys over them and a get of a large key into layer shares, received in
    # worker threads (cacheserver.dataplane.stripes). 1: one connection.
    data_plane_stripes: int = 1
    # The bounded segment store (connector/segment_book.py): the segments stored for
    # any-position reuse (CacheBlend parts) hold at most this many bytes of KV, apart from the
    # prefix KV; storing one past it evicts the least recently used segments. 0: unbounded.
    segment_bytes: int | str = "256MiB"
    # A part met in prompts (generate, the server) is stored on its Nth sighting; the earlier
    # ones compute it in the prompt's prefill and store nothing, so novel documents never fill
    # the cache. 1: stored on first sight. LLM.ingest called directly stores at once.
    segment_admit_after: int = 2
    segment_watch: int = 65536  # most parts whose sightings are remembered (oldest forgotten)

    def __post_init__(self) -> None:
        self.staging_bytes = parse_size(self.staging_bytes)
        self.segment_bytes = parse_size(self.segment_bytes)
        if self.segment_bytes < 0 or self.segment_admit_after < 1 or self.segment_watch < 1:
            raise ValueError(
                "segment_bytes must be >= 0, segment_admit_after and segment_watch >= 1"
            )
        check_namespace(self.namespace)
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.kv_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'fp8', got {self.kv_dtype!r}")
        if self.remote is not None and not self.remote.startswith(REMOTE_SCHEMES):
            raise ValueError(f"remote must start with one of {REMOTE_SCHEMES}, got {self.remote!r}")
        if not 1 <= self.data_plane_stripes <= 64:
            raise ValueError(f"data_plane_stripes must be 1..64, got {self.data_plane_stripes}")
        if self.max_pending_saves < 1:
            raise ValueError("max_pending_saves must be >= 1")
        if self.tiers.redis_url:
            raise ValueError("the connector's Redis is named by remote (redis://...)")

    @staticmethod
    def knobs() -> list[Field]:
        """The connector's knobs, flat (`cpu_bytes`, not `tiers.cpu_bytes`): the keys of a
        dict of knobs such as vLLM's kv_connector_extra_config."""
        return flat_fields(ConnectorConfig, ("redis_url",))

    @staticmethod
    def of(knobs: Mapping[str, Any]) -> ConnectorConfig:
        """The config of a dict of flat knobs (see knobs())."""
        return ConnectorConfig(**nest(knobs))

    def tier_config(self) -> TiersConfig:
        """The tiers storage_backends builds: the local ones, and Redis when remote names it."""
        redis = self.remote if self.remote and self.remote.startswith(REDIS_SCHEMES) else None
        return replace(self.tiers, redis_url=redis)

    def build_tiers(self) -> list[Tier]:
        """The local tiers (fastest first), then the shared one."""
        tiers = build_tiers(self.tier_config())
        if self.remote is not None and self.remote.startswith(SERVER_SCHEMES):
            tiers.append(
                server_tier(
                    self.remote,
                    self.token,
                    self.tls_ca,
                    self.data_plane,
                    self.shared_memory,
                    self.data_plane_stripes,
                )
            )
        if not tiers:
            raise ValueError(
                "the connector needs at least one tier (cpu_bytes, gpu_bytes, disk_dir or remote)"
            )
        return tiers

    def build_store(self) -> TieredStore:
        return TieredStore(self.build_tiers(), StoreConfig())


def server_tier(
    url: str,
    token: str | None = None,
    tls_ca: str | None = None,
    data_plane: bool = True,
    shared_memory: bool = True,
    stripes: int = 1,
) -> Tier:
    """The tierkv-server at url (grpc://host:port, or grpcs:// with tls_ca), as a tier. Its
    loads and saves take the server's data plane unless data_plane is False: shared memory
    with a server on this host (127.0.0.1, localhost, ::1) unless shared_memory is False, its
    TCP data port otherwise (over TLS with grpcs://), over `stripes` connections per session."""
    from tierkv.cacheserver.client import RemoteTier
    from tierkv.cacheserver.dataplane.client import DataTier

    tls = url.startswith("grpcs://")
    if tls and tls_ca is None:
        raise ValueError("grpcs:// needs tls_ca (the server's CA certificate)")
    target = url.split("://", 1)[1]
    ca = tls_ca if tls else None
    if not data_plane:
        return RemoteTier(target=target, token=token, tls_ca=ca)
    host = target.rsplit(":", 1)[0].strip("[]")
    local = host in ("127.0.0.1", "localhost", "::1")
    return DataTier(
        target=target,
        token=token,
        tls_ca=ca,
        shared_memory=shared_memory and local,
        stripes=stripes,
    )
