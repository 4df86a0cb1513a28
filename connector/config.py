"""ConnectorConfig: every knob of the connector, and the tiered store it builds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierkv.storage_backends.base import DEFAULT_NAMESPACE, Tier, check_namespace, parse_size
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
from tierkv.storage_backends.gpu_tier import GpuTier, GpuTierConfig
from tierkv.storage_backends.store import StoreConfig, TieredStore

REMOTE_SCHEMES = ("grpc://", "grpcs://", "redis://", "rediss://", "redis+cluster://")


@dataclass(slots=True)
class ConnectorConfig:
    chunk_size: int = 256  # tokens per stored chunk; a multiple of the engine's block size
    gpu_bytes: int | str = 0  # device tier capacity; 0 = no gpu tier
    cpu_bytes: int | str = "1GiB"  # local cpu tier capacity (one preallocated buffer); 0 = none
    disk_dir: str | Path | None = None  # local disk tier directory; None = no disk tier
    disk_bytes: int | str = "16GiB"  # local disk tier capacity
    # The shared tier: grpc://host:port (grpcs:// with TLS) for tierkv-server, redis://,
    # rediss:// or redis+cluster:// for Redis directly; None = local tiers only.
    remote: str | None = None
    namespace: str = DEFAULT_NAMESPACE  # tenant; part of every key (the server maps tokens to it)
    token: str | None = None  # bearer token for tierkv-server
    tls_ca: str | None = None  # CA certificate (PEM path) for grpcs://
    kv_dtype: str = (
        "auto"  # KV dtype in storage: auto (the engine cache's) | fp8 (e4m3 with scales)
    )
    codec: str = (
        "none"  # segment codec: none | lz4 | shuffle+lz4 (measure first: fp16 KV barely shrinks)
    )
    save_partial_chunks: bool = False  # also store a prompt's last, partial chunk
    save: bool = True  # store new prompt chunks after prefill (False: read-only client)
    lookup_timeout_s: float = 2.0  # the scheduler-side Lookup; a timeout is a miss
    load_timeout_s: float = 10.0  # a step's loads; past it the tokens are recomputed
    max_pending_saves: int = 256  # staged chunks waiting for their put; beyond it saves are dropped
    metrics_port: int = 0  # serve Prometheus metrics on 127.0.0.1:PORT; 0 = off

    def __post_init__(self) -> None:
        self.gpu_bytes, self.cpu_bytes = parse_size(self.gpu_bytes), parse_size(self.cpu_bytes)
        self.disk_bytes = parse_size(self.disk_bytes)
        check_namespace(self.namespace)
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.kv_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'fp8', got {self.kv_dtype!r}")
        if self.remote is not None and not self.remote.startswith(REMOTE_SCHEMES):
            raise ValueError(f"remote must start with one of {REMOTE_SCHEMES}, got {self.remote!r}")
        if self.max_pending_saves < 1:
            raise ValueError("max_pending_saves must be >= 1")

    def build_tiers(self) -> list[Tier]:
        """The local tiers (fastest first), then the remote one."""
        tiers: list[Tier] = []
        if self.gpu_bytes:
            tiers.append(GpuTier(GpuTierConfig(capacity_bytes=self.gpu_bytes)))
        if self.cpu_bytes:
            tiers.append(CpuTier(CpuTierConfig(capacity_bytes=self.cpu_bytes)))
        if self.disk_dir is not None:
            tiers.append(
                DiskTier(DiskTierConfig(root=self.disk_dir, capacity_bytes=self.disk_bytes))
            )
        if self.remote is not None:
            tiers.append(remote_tier(self.remote, self.token, self.tls_ca))
        if not tiers:
            raise ValueError(
                "the connector needs at least one tier (cpu_bytes, disk_dir or remote)"
            )
        return tiers

    def build_store(self) -> TieredStore:
        return TieredStore(self.build_tiers(), StoreConfig())


def remote_tier(url: str, token: str | None = None, tls_ca: str | None = None) -> Tier:
    """The shared tier named by url: tierkv-server over gRPC, or Redis (standalone or cluster)."""
    if url.startswith(("grpc://", "grpcs://")):
        from tierkv.cacheserver.client import RemoteTier

        tls = url.startswith("grpcs://")
        if tls and tls_ca is None:
            raise ValueError("grpcs:// needs tls_ca (the server's CA certificate)")
        return RemoteTier(
            target=url.split("://", 1)[1], token=token, tls_ca=tls_ca if tls else None
        )
    from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig

    return RedisTier(RedisTierConfig(url=url))
