"""Python per decode step, for bench.engine_profile: the single-request decode run in each way
the engine can run a decode step, timed without a profiler and measured under cProfile.

- "one call": every layer in one op call (decode_layers), where the connector has no per-layer
  work in the step (the engine's default, and what the plain engine's decode steps do);
- "a call per layer": one op call per layer with the connector's hooks around each
  (decode_layer, what a step with loads or saves does);
- "Python loop": LlamaForCausalLM.forward's loop over the ops (`fused_decode` off): the
  baseline.

cProfile counts the time spent in Python functions' own code (its tottime, summed over every
function written in Python: the engine, scheduler, sampler, torch's Python wrappers around
ops), not in C calls; its own cost per call makes it an upper bound. torch's profiler
(bench.engine_profile's table) charges its cost per op event to the time outside the ops, and a
decode step keeps ~1,200 op events however it is called, so it overstates Python there.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tierkv.engine.noop_connector import NoOpConnector

MODES = ("one call", "a call per layer", "Python loop")


class PerLayer(NoOpConnector):
    """The default connector, asking for its (empty) per-layer hooks: the per-layer op calls."""

    def layer_work(self) -> bool:
        return True


@contextmanager
def mode(runner: Any, name: str) -> Iterator[None]:
    """runner's decode steps run the named way while inside."""
    fused, conn = runner.fused, runner.connector
    assert fused is not None and isinstance(conn, NoOpConnector), "the plain engine's C++ path"
    runner.fused = None if name == "Python loop" else fused
    runner.connector = PerLayer() if name == "a call per layer" else conn
    try:
        yield
    finally:
        runner.fused, runner.connector = fused, conn


def python_time(job: Callable[[], object]) -> tuple[float, int]:
    """(seconds in Python functions' own code, Python function calls) over job, by cProfile."""
    prof = cProfile.Profile()
    prof.enable()
    job()
    prof.disable()
    stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    own = [(v[2], v[1]) for k, v in stats.items() if k[0] != "~"]  # "~": C functions
    return sum(t for t, _ in own), sum(n for _, n in own)


def measure(
    runner: Any, job: Callable[[], object], steps: int, rounds: int
) -> list[dict[str, Any]]:
    """A row per mode: Python ms and calls per step (cProfile), and ms per step without any
    profiler (the median over rounds, the modes alternating within each round)."""
    from tqdm import tqdm

    walls: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in tqdm(range(rounds), desc="decode, unprofiled rounds"):
        for m in MODES:
            with mode(runner, m):
                t0 = time.perf_counter()
                job()
                walls[m].append(time.perf_counter() - t0)
    rows = []
    for m in MODES:
        with mode(runner, m):
            sec, calls = python_time(job)
        rows.append(
            dict(
                mode=m,
                python_ms_per_step=sec / steps * 1e3,
                python_calls_per_step=calls / steps,
                ms_per_step=statistics.median(walls[m]) / steps * 1e3,
            )
        )
    return rows
