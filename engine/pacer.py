"""The layered prefill's measured pace (EngineConfig.layered_gap): a step that runs layered
pieces beside decodes aims at layered_gap x the median time of recent decode-only steps, so
the decodes' inter-token gap stays near that multiple of their median. The pieces' rate (rows
x layers a second) and the decode-only steps' seconds come from recent steps: the decode step
is their median; the pieces' time is fitted as a fixed cost per step plus units at a rate
(least squares, where their units differ enough to tell the two apart; else the median rate),
since each piece costs something whatever its rows and a rate measured on small steps alone
would shrink the next step's work, and so on. The step's layered work is what the fit runs
in the time left over. Only the pace depends on
time: the tokens do not (a layer's row chunks are exact, engine/tiles.py).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.engine.schedule_output import SchedulerOutput

WINDOW = 16  # the recent measurements each median is over


@dataclass(slots=True)
class Pacer:
    """The measurements and the step budget they give. The engine feeds it each step (measure);
    the scheduler reads budget() when it sets each layered prefill's work for the step."""

    gap: float  # layered_gap: the target step time over a decode-only step's; 0 = off
    floor: int  # the least rows x layers a step runs when paced, so a prompt always advances
    decode_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    works: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def decode_step(self, seconds: float) -> None:
        """A decode-only step took seconds (schedule to postprocess)."""
        if seconds > 0:
            self.decode_s.append(seconds)

    def layered_work(self, units: int, seconds: float) -> None:
        """A step's layered pieces ran units rows x layers in seconds."""
        if units > 0 and seconds > 0:
            self.works.append((units, seconds))

    def budget(self) -> int | None:
        """Rows x layers a step's layered pieces run in all, (gap - 1) decode-only steps' time at
        the measured rate, at least floor; None when off or before both are measured (then
        the fixed budgets hold)."""
        if self.gap <= 0 or not self.decode_s or not self.works:
            return None
        spare = (self.gap - 1.0) * statistics.median(self.decode_s)
        fixed, rate = self.fit()
        return max(self.floor, int((spare - fixed) * rate))

    def fit(self) -> tuple[float, float]:
        """(seconds a step's pieces cost whatever their work, units a second beyond that): the
        least-squares line through the recent (units, seconds) where their units span at least
        2x and it is a line of positive slope and cost; else (0, the median rate)."""
        us = [u for u, _ in self.works]
        if len(us) >= 3 and max(us) >= 2 * min(us):
            line = statistics.linear_regression(us, [s for _, s in self.works])
            if line.slope > 0 and line.intercept >= 0:
                return line.intercept, 1.0 / line.slope
        return 0.0, statistics.median(u / s for u, s in self.works)


def measure(pacer: Pacer, out: SchedulerOutput, seconds: float) -> None:
    """Feed pacer a finished step: its layered pieces' work and time (the runner's, out.ran), or
    its whole time when it ran decodes only."""
    if out.layered:
        pacer.layered_work(*out.ran)
    elif out.seqs and out.blend is None and all(n == 1 for n in out.num_new_tokens):
        pacer.decode_step(seconds)


def clock(device_type: str, paced: bool) -> float:
    """Now, once the device's queued work ended where it runs asynchronously and the time is
    used (paced)."""
    if paced and device_type == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()
