"""The background puts of a step's staged saves: each chunk wrapped as a segment and put into
the store unless it holds it already."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tierkv.connector.plan import ConnectorStats, SavePlan
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.tier import Tier

log = logging.getLogger("tierkv.connector")


async def run_saves(
    saves: list[SavePlan],
    store: Tier,
    ns: str,
    fingerprint: bytes,
    codec: str,
    stats: ConnectorStats,
    done: Callable[[SavePlan], object],
) -> None:
    """Put each staged chunk that the store does not hold yet; done(plan) frees its staging."""
    for plan in saves:
        t0 = time.perf_counter()
        try:
            c = plan.chunk
            if (await store.contains([c.key], ns))[0]:
                stats.save_skipped += 1
                continue
            seg = KVSegment.from_tensor(
                plan.staging,
                key=c.key,
                parent=c.parent,
                tokens=plan.tokens,
                fingerprint=fingerprint,
                base_position=c.start,
                codec=codec,
                scales=None if plan.scales is None else plan.scales.numpy(),
            )
            seg.owned = True  # the staging tensor is this segment's alone from here on
            if await store.put(c.key, seg, ns):
                stats.saved_chunks += 1
                stats.saved_bytes += seg.nbytes
            else:
                stats.save_dropped += 1
        except Exception as e:
            stats.save_dropped += 1
            log.warning("connector save of request %s failed: %r", plan.request_id, e)
        finally:
            done(plan)
            stats.record(stats.save_seconds, time.perf_counter() - t0)
