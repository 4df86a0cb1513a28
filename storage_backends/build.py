"""TiersConfig and build_tiers: the one way the cache server and the connector make their tiers.

The server's ServerConfig and the connector's ConnectorConfig each embed one TiersConfig as
`tiers`; in YAML, TIERKV_* variables, flags and vLLM's extra config its knobs keep their flat
names (`cpu_bytes`, not `tiers.cpu_bytes`): flat_fields and nest map between the two. The
remote tier (the cache server's gRPC client) is not built here: storage_backends does not
know the cache server; the connector appends it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
from tierkv.storage_backends.eviction import ANY_NS, POLICIES, parse_quotas
from tierkv.storage_backends.gpu_tier import GpuTier, GpuTierConfig
from tierkv.storage_backends.hint_book import HintBook
from tierkv.storage_backends.indexed_tier import IndexedTier
from tierkv.storage_backends.names import check_namespace
from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig
from tierkv.storage_backends.sizes import parse_size
from tierkv.storage_backends.tier import Tier
from tierkv.storage_backends.workflow import share_book

REDIS_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "unix://")


class ConfigError(ValueError):
    """A configuration value is malformed; the message names the knob."""


@dataclass(slots=True)
class TiersConfig:
    """The tiers, fastest first: gpu, cpu, disk, redis. Sizes take human units ("512MiB",
    "8GiB", "1.5GB") or bytes; a tier whose size is 0 (or whose place is unset) is left out."""

    # gpu tier: bytes of KV payload kept as tensors on the engine's device (CUDA when
    # present, else the CPU device, and its stats say so); 0: no gpu tier.
    gpu_bytes: int | str = 0
    # cpu tier: bytes of the one host buffer it allocates at start (pinned with CUDA) and
    # never exceeds; 0: no cpu tier.
    cpu_bytes: int | str = "1GiB"
    # disk tier: the directory of its segment files (created if missing; its files are kept
    # and re-indexed across restarts); None: no disk tier.
    disk_dir: str | Path | None = None
    # disk tier: the most bytes of segment files it keeps in disk_dir; 0: no disk tier.
    disk_bytes: int | str = "16GiB"
    # redis tier: redis://, rediss:// (TLS), redis+cluster:// or unix:// (a local socket) URL
    # of the shared Redis; None or "": no redis tier.
    redis_url: str | None = None
    # redis tier: use the Redis Cluster client (also chosen by a redis+cluster:// URL).
    redis_cluster: bool = False
    # redis tier: expiry in seconds of every value it writes; 0: none (Redis' own
    # maxmemory policy applies).
    redis_ttl_s: int = 0
    # redis tier: timeout of each Redis command in seconds; a timeout is a miss.
    redis_timeout_s: float = 1.0
    # gpu, cpu and disk tiers: eviction order when room is needed: lru (oldest first) or
    # hinted (by workflow hints, the farthest next use first; unhinted entries by LRU).
    eviction: str = "lru"
    # gpu, cpu and disk tiers: each namespace's byte share of each tier, NS=SIZE[,NS=SIZE...]
    # (SIZE: 256MiB, 4096 or 25% of the tier; NS * for every namespace not named, else 0);
    # entries of namespaces over their share are evicted first. none: no quotas.
    quotas: dict[str, int | str] = field(default_factory=dict)
    # gpu, cpu and disk tiers (one hint book for all of them): keys with workflow hint tags
    # each namespace keeps, and as many soft-pinned keys; its oldest tags go first.
    hint_keys: int = 1 << 16
    # hint book: tagged keys of all namespaces together (and as many pinned); past it the
    # namespace holding the most loses its oldest, so no namespace's hints push out the tags
    # of one holding at most hint_keys_total / (namespaces holding tags).
    hint_keys_total: int = 1 << 18
    # hint book: tagged keys of a namespace that no gpu, cpu or disk tier holds (hinted before
    # their put lands, or moved to Redis or the server), their tags kept pending until the
    # key lands again; the oldest go first.
    hint_pending: int = 1 << 14
    # hint book: seconds a pending tag is kept, from the hint (or from when its key left
    # the last gpu, cpu or disk tier); a key landing later is untagged.
    hint_pending_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "cpu_bytes", "disk_bytes"):
            try:
                setattr(self, name, parse_size(getattr(self, name)))
            except ValueError as e:
                raise ConfigError(f"{name}: {e}") from None
        if self.redis_url and not self.redis_url.startswith(REDIS_SCHEMES):
            raise ConfigError(
                f"redis_url must start with one of {REDIS_SCHEMES}, got {self.redis_url!r}"
            )
        if self.redis_ttl_s < 0 or self.redis_timeout_s <= 0:
            raise ConfigError("redis_ttl_s must be >= 0 and redis_timeout_s > 0")
        if self.eviction not in POLICIES:
            raise ConfigError(f"eviction must be one of {POLICIES}, got {self.eviction!r}")
        self.quotas = parse_quota_knob(self.quotas)
        if min(self.hint_keys, self.hint_keys_total, self.hint_pending) < 1:
            raise ConfigError("hint_keys, hint_keys_total and hint_pending must be >= 1")
        if not self.hint_pending_s > 0:
            raise ConfigError(f"hint_pending_s must be > 0, got {self.hint_pending_s}")


def parse_quota_knob(value: str | Mapping[str, int | str]) -> dict[str, int | str]:
    """'ns1=1GiB,ns2=25%' or a mapping -> {namespace: share}, each checked (ConfigError
    naming `quotas` otherwise); shares stay as given (a percentage needs the tier's size)."""
    if isinstance(value, Mapping):
        pairs = [(str(k), v) for k, v in value.items()]
    else:
        pairs = []
        for item in filter(None, (s.strip() for s in str(value).split(","))):
            ns, eq, share = item.partition("=")
            if not eq:
                raise ConfigError(f"quotas: expected NAMESPACE=SIZE, got {item!r}")
            pairs.append((ns.strip(), share.strip()))
    try:
        for ns, _ in pairs:
            if ns != ANY_NS:
                check_namespace(ns)
        parse_quotas(dict(pairs), 1 << 40)
    except ValueError as e:
        raise ConfigError(f"quotas: {e}") from None
    return dict(pairs)


TIER_KNOBS = frozenset(f.name for f in dataclasses.fields(TiersConfig))


def flat_fields(config: type, skip: Collection[str] = ()) -> list[dataclasses.Field]:
    """The knobs of a config class that embeds a TiersConfig as `tiers`, flat and in order:
    its own fields, with `tiers` replaced by the tier knobs not in skip."""
    out: list[dataclasses.Field] = []
    for f in dataclasses.fields(config):
        if f.name == "tiers":
            out += [t for t in dataclasses.fields(TiersConfig) if t.name not in skip]
        else:
            out.append(f)
    return out


def nest(values: Mapping[str, Any]) -> dict[str, Any]:
    """Flat knobs -> the keyword arguments of such a config: the tier knobs gathered into
    tiers=TiersConfig(...)."""
    own = {k: v for k, v in values.items() if k not in TIER_KNOBS}
    tiers = {k: v for k, v in values.items() if k in TIER_KNOBS}
    return {**own, "tiers": TiersConfig(**tiers)} if tiers else own


def build_tiers(c: TiersConfig) -> list[Tier]:
    """The tiers c asks for, fastest first; an empty list when it asks for none."""
    local: list[IndexedTier] = []
    gpu, cpu, disk = int(c.gpu_bytes), int(c.cpu_bytes), int(c.disk_bytes)
    ev, q = c.eviction, dict(c.quotas)
    if gpu:
        local.append(GpuTier(GpuTierConfig(capacity_bytes=gpu, eviction=ev, quotas=q)))
    if cpu:
        local.append(CpuTier(CpuTierConfig(capacity_bytes=cpu, eviction=ev, quotas=q)))
    if c.disk_dir is not None and disk:
        d = DiskTierConfig(root=c.disk_dir, capacity_bytes=disk, eviction=ev, quotas=q)
        local.append(DiskTier(d))
    if local:  # one hint book for them all, as a TieredStore of them shares it
        local[0].hints = HintBook[bytes](
            max_items=c.hint_keys,
            max_total=c.hint_keys_total,
            max_pending=c.hint_pending,
            pending_ttl_s=c.hint_pending_s,
        )
        share_book(local)
    tiers: list[Tier] = list(local)
    if c.redis_url:
        tiers.append(
            RedisTier(
                RedisTierConfig(
                    url=c.redis_url,
                    cluster=c.redis_cluster,
                    ttl_s=c.redis_ttl_s,
                    timeout_s=c.redis_timeout_s,
                )
            )
        )
    return tiers
