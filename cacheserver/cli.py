"""`tierkv-server` (also `python -m cacheserver`): serve, or print a running server's stats.

tierkv-server --port 50051 --cache-dir /var/cache/tierkv --cpu-bytes 8GiB
tierkv-server --redis-url redis://10.0.0.7:6379/0 --tokens "$TOKEN=team-a"
tierkv-server stats --target 127.0.0.1:50051 [--token T] [--tls-ca ca.pem]
tierkv-server health --target 127.0.0.1:50051      # exit 0 when SERVING
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

import grpc

from tierkv.cacheserver import config as cfg
from tierkv.cacheserver.server import Server
from tierkv.storage_backends.build import build_tiers
from tierkv.storage_backends.sizes import format_size
from tierkv.storage_backends.store import TieredStore

log = logging.getLogger("tierkv.server")


def build_store(c: cfg.ServerConfig) -> TieredStore:
    """cpu and disk under cache_dir (each unless its size is 0), then Redis when a URL is set."""
    tiers = build_tiers(c.tier_config())
    if not tiers:
        raise cfg.ConfigError("no tiers: set cpu_bytes, disk_bytes or redis_url")
    return TieredStore(tiers)


async def serve(c: cfg.ServerConfig, store: TieredStore) -> None:
    server = await Server.start(c, store)
    tiers = ", ".join(t.name for t in server.store.tiers)
    print(
        f"tierkv-server listening on {c.host}:{server.port} (tiers: {tiers}; "
        f"auth {'on' if c.auth else 'off'}; tls {'on' if c.tls_cert else 'off'})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        server.refresh_metrics()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    log.info("shutting down: draining in-flight calls for up to %.0fs", c.grace_s)
    await server.stop()
    print("tierkv-server stopped", flush=True)


async def _stats(args: argparse.Namespace) -> int:
    from tierkv.cacheserver.client import RemoteTier

    tier = RemoteTier(
        target=args.target, token=args.token, tls_ca=args.tls_ca, retries=0, timeout_s=args.timeout
    )
    r = await tier.server_stats()
    await tier.close()
    if r is None:
        print(f"no answer from {args.target}", file=sys.stderr)
        return 1
    rows = [["tier", "segments", "used", "capacity", "hits", "hit rate", "evictions", "errors"]]
    gets = max(r.gets, 1)
    for t in r.tiers:
        rows.append(
            [
                t.name,
                str(t.count),
                format_size(t.used_bytes),
                format_size(t.capacity_bytes) if t.capacity_bytes else "-",
                str(t.hits),
                f"{t.hits / gets:.1%}",
                str(t.evictions),
                str(t.errors),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(
        f"namespace {r.namespace}: {r.lookups} lookups, {r.puts} puts, {r.gets} gets "
        f"({r.gets - sum(t.hits for t in r.tiers)} misses), in {format_size(r.bytes_in)}, "
        f"out {format_size(r.bytes_out)}"
    )
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    return 0


async def _health(args: argparse.Namespace) -> int:
    """Exit 0 when the server answers SERVING (container health checks)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tierkv.cacheserver.channel import channel

    async with channel(args.target, args.tls_ca) as ch:
        try:
            r = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=args.timeout
            )
        except grpc.aio.AioRpcError as e:
            print(f"{args.target}: {e.code().name}", file=sys.stderr)
            return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


def client_parser(name: str, what: str) -> argparse.ArgumentParser:
    """The flags of `tierkv-server stats` and `tierkv-server health`."""
    p = argparse.ArgumentParser(prog=f"tierkv-server {name}", description=what)
    p.add_argument("--target", required=True, help="HOST:PORT of the server (required)")
    p.add_argument("--token", help="bearer token, when the server has auth (default: none)")
    p.add_argument(
        "--tls-ca", help="CA certificate (PEM) of a TLS server (default: none, plaintext)"
    )
    p.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the answer (default: 5.0)"
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    """`tierkv-server [serve]`: one flag per knob of ServerConfig."""
    p = argparse.ArgumentParser(
        prog="tierkv-server",
        description="the tierkv gRPC cache server; `tierkv-server stats|health --help` for the "
        "client commands",
    )
    cfg.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:
        return asyncio.run(
            _health(client_parser("health", "check a server's health").parse_args(argv[1:]))
        )
    if argv[:1] == ["stats"]:
        return asyncio.run(
            _stats(client_parser("stats", "print a server's stats").parse_args(argv[1:]))
        )
    p = build_parser()
    args = p.parse_args(argv[1:] if argv[:1] == ["serve"] else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        c = cfg.load(args)
        store = build_store(c)
    except (cfg.ConfigError, OSError) as e:
        p.error(str(e))
    asyncio.run(serve(c, store))
    return 0
