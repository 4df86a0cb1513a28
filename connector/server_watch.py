"""Following a tierkv-server's Watch stream: what enters and leaves the shared tier, for the
KV events an engine publishes (tierkv serve's and tierkv.vllm's)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

log = logging.getLogger("tierkv.connector")


async def follow(tier: Any, handle: Callable[[Any], None], stored: bool, who: str) -> None:
    """Give handle every WatchEvent of tier's namespace (a RemoteTier; with `stored`, what enters
    the server too), reconnecting with backoff (0.5 s doubling to 10 s), until cancelled. A
    server without Watch ends it, logged once. handle runs on the caller's loop: it must not
    block."""
    pause = 0.5
    while True:
        try:
            async for ev in tier.watch(stored=stored):
                pause = 0.5
                handle(ev)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the server away or restarting: try again later
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("%s: the server has no Watch: its changes are not published", who)
                return
            log.info("%s: the server's Watch stream ended (%r); retrying", who, e)
        await asyncio.sleep(pause)
        pause = min(pause * 2, 10.0)
