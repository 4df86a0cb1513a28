"""The grpc.aio server around the servicer: limits, TLS, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tierkv.cacheserver import wire
from tierkv.cacheserver.config import ServerConfig
from tierkv.cacheserver.dataplane.server import DataPlane
from tierkv.cacheserver.frames import parser
from tierkv.cacheserver.metrics import Metrics, stats_dict
from tierkv.cacheserver.servicer import Servicer
from tierkv.cacheserver.watch import WatchHub
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.store import TieredStore
from tierkv.storage_backends.workflow import book_of

log = logging.getLogger("tierkv.server")
# HTTP/2 frames as large as the spec allows: a 1 MiB message then crosses in one frame, not 64.
HTTP2_FRAME = (1 << 24) - 1
SERVICE = pb.DESCRIPTOR.services_by_name["TierKV"].full_name


def add_servicer(servicer: Servicer, server: grpc.aio.Server) -> None:
    """Register the TierKV methods, like the generated helper, but with parsers that never raise."""
    svc = pb.DESCRIPTOR.services_by_name["TierKV"]
    makers = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
    }

    def serializer(m) -> Callable:  # streamed frames leave the handler already serialized
        return (
            wire.identity
            if m.server_streaming
            else getattr(pb, m.output_type.name).SerializeToString
        )

    def deserializer(m) -> Callable:  # Put frames are read in place (see cacheserver.wire)
        return wire.parse_put if m.client_streaming else parser(getattr(pb, m.input_type.name))

    handlers = {
        m.name: makers[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name),
            request_deserializer=deserializer(m),
            response_serializer=serializer(m),
        )
        for m in svc.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(svc.full_name, handlers),)
    )


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Messages are frames (<= max_frame_bytes) or key lists; allow those with headroom, no more."""
    limit = max(config.max_frame_bytes, config.max_keys * 20) + 64 * 1024
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.http2.max_frame_size", HTTP2_FRAME),
        # HTTP/2 would queue streams over its limit silently; leave room so max_streams
        # refuses them with a message instead (unary calls count as HTTP/2 streams too).
        ("grpc.max_concurrent_streams", config.max_streams + 32),
    ]


@dataclass(slots=True)
class Server:
    """A started grpc.aio server; `stop()` drains in-flight RPCs, then closes the store."""

    config: ServerConfig
    store: TieredStore
    metrics: Metrics
    grpc_server: grpc.aio.Server
    health: health.HealthServicer
    port: int
    data: DataPlane | None
    watch: WatchHub | None = None

    @staticmethod
    async def start(
        config: ServerConfig, store: TieredStore, metrics: Metrics | None = None
    ) -> Server:
        metrics = metrics or Metrics()
        srv = grpc.aio.server(options=grpc_options(config))
        servicer = Servicer(store, config, metrics)
        add_servicer(servicer, srv)
        hs = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, srv)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), srv
        )
        addr = f"{config.host}:{config.port}"
        tls = None
        if config.tls_cert:
            with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            port = srv.add_secure_port(addr, creds)
            # The TCP data port speaks TLS with the same certificate.
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(config.tls_cert, config.tls_key)
        else:
            port = srv.add_insecure_port(addr)
        data, path = None, config.data_socket_path(port)
        tcp = None if config.data_port < 0 else (config.host, config.data_port)
        if path is not None or tcp is not None:
            data = DataPlane(
                store,
                servicer.auth,
                path,
                config.shm_region_bytes,
                config.max_sessions,
                servicer.inflight,
                servicer,
                config.max_segment_bytes,
                tcp,
                tls,
            )
            await data.start()
            servicer.data_socket = "" if path is None else str(path)
            servicer.data_port = data.tcp_port
        await srv.start()
        for name in ("", SERVICE):
            hs.set(name, health_pb2.HealthCheckResponse.SERVING)
        if config.metrics_port:
            metrics.serve(config.metrics_port, config.host)
        return Server(config, store, metrics, srv, hs, port, data, servicer.watch)

    def refresh_metrics(self) -> None:
        self.metrics.update_tiers({t.name: t.stats() for t in self.store.tiers})
        if (book := book_of(self.store.tiers)) is not None:
            self.metrics.update_hints(book.counts(), stats_dict(book.stats))

    async def stop(self) -> None:
        self.health.enter_graceful_shutdown()
        if self.watch is not None:  # open watches would hold the grace period to its end
            self.watch.close()
        await self.grpc_server.stop(self.config.grace_s)
        if self.data is not None:
            await self.data.stop()
        try:  # flush the write-behind queue, but never hang the shutdown on a stuck tier
            await asyncio.wait_for(self.store.close(), max(self.config.grace_s, 1.0))
        except asyncio.TimeoutError:
            log.error(
                "store did not close within %.0fs; queued background writes are lost",
                self.config.grace_s,
            )
