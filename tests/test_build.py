"""One builder for the tiers of the cache server and of the connector: the same knob names,
the same meaning."""

from __future__ import annotations

import pytest

from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.config import ConfigError, ServerConfig
from tierkv.connector.config import ConnectorConfig
from tierkv.storage_backends.build import TiersConfig, build_tiers


async def names(c: TiersConfig) -> list[str]:
    tiers = build_tiers(c)
    for t in tiers:
        await t.close()
    return [t.name for t in tiers]


async def test_each_tier_by_its_knobs(tmp_path) -> None:
    assert await names(TiersConfig()) == ["cpu"]  # no disk_dir: no disk tier
    every = TiersConfig(
        gpu_bytes="1MiB",
        cpu_bytes="1MiB",
        disk_dir=tmp_path,
        disk_bytes="1MiB",
        redis_url="redis://127.0.0.1:1/0",  # not contacted until used
    )
    assert every.cpu_bytes == 1 << 20
    assert await names(every) == ["gpu", "cpu", "disk", "redis"]
    assert await names(TiersConfig(cpu_bytes=0, disk_dir=tmp_path, disk_bytes=0)) == []
    for bad in [dict(cpu_bytes="lots"), dict(redis_url="http://x"), dict(redis_timeout_s=0)]:
        with pytest.raises(ValueError):
            TiersConfig(**bad)


async def test_server_and_connector_mean_the_same(tmp_path) -> None:
    server = ServerConfig(
        cache_dir=str(tmp_path), tiers=TiersConfig(cpu_bytes=2 << 20, disk_bytes=0)
    )
    assert server.tier_config().disk_bytes == 0 and await names(server.tier_config()) == ["cpu"]
    conn = ConnectorConfig(tiers=TiersConfig(cpu_bytes="2MiB", disk_dir=tmp_path, disk_bytes=0))
    assert await names(conn.tier_config()) == ["cpu"]  # disk_bytes 0: no disk tier, for both
    server = ServerConfig(
        cache_dir=str(tmp_path), tiers=TiersConfig(cpu_bytes=0, redis_url="redis://h:1/0")
    )
    assert server.tier_config().disk_dir == tmp_path / "disk"
    assert await names(server.tier_config()) == ["disk", "redis"]
    with pytest.raises(ConfigError, match="redis_url"):
        ServerConfig(tiers=TiersConfig(redis_url="redis:/typo"))


async def test_connector_appends_the_server_tier() -> None:
    tiers = ConnectorConfig(
        tiers=TiersConfig(cpu_bytes="1MiB"), remote="grpc://127.0.0.1:1"
    ).build_tiers()
    assert [t.name for t in tiers] == ["cpu", "remote"] and isinstance(tiers[-1], RemoteTier)
    assert (
        ConnectorConfig(tiers=TiersConfig(cpu_bytes=0), remote="redis://h:1/0")
        .tier_config()
        .redis_url
        == "redis://h:1/0"
    )
    with pytest.raises(ValueError, match="at least one tier"):
        ConnectorConfig(tiers=TiersConfig(cpu_bytes=0)).build_tiers()
