"""How the Redis tier reaches Redis: a standalone connection pool or a Redis Cluster client,
from its URL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

if TYPE_CHECKING:
    from tierkv.storage_backends.redis_tier import RedisTierConfig


def connect(c: RedisTierConfig) -> tuple[aioredis.Redis | RedisCluster, bool]:
    """The client of c.url, and whether it is a Redis Cluster client (c.cluster, or a
    redis+cluster:// URL)."""
    url, cluster = c.url, c.cluster
    if url.startswith("redis+cluster://"):
        url, cluster = "redis://" + url[len("redis+cluster://") :], True
    opts: dict[str, Any] = dict(socket_timeout=c.timeout_s, socket_connect_timeout=c.timeout_s)
    if c.max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {c.max_connections}")
    if cluster:
        url, more = startup_nodes(url)
        client = RedisCluster.from_url(
            url, startup_nodes=more or None, max_connections=c.max_connections, **opts
        )
        return client, True
    # No client-side retries: the tier's own backoff decides when to try again.
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=c.max_connections,
        timeout=c.timeout_s,
        retry=Retry(NoBackoff(), 0),
        **opts,
    )
    return aioredis.Redis.from_pool(pool), False  # closes the pool when closed


def startup_nodes(url: str) -> tuple[str, list[ClusterNode]]:
    """A cluster URL with several hosts (`redis://h1:p1,h2:p2/0`) as the URL of its first host
    and the others as startup nodes."""
    scheme, rest = url.split("://", 1)
    netloc, _, path = rest.partition("/")
    auth, _, hosts = netloc.rpartition("@")
    first, *more = hosts.split(",")
    nodes = []
    for h in more:
        host, _, port = h.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad cluster node {h!r} in the Redis URL (host:port expected)")
        nodes.append(ClusterNode(host, int(port)))
    return f"{scheme}://{auth + '@' if auth else ''}{first}/{path}", nodes
