"""Loads held past their step (connector/held.py) for a layered prefill: which loads may be held,
what wait_layer reads while one is resumed, cancellation, and the report of what failed; then
through the engine: a layered prefill over connector hits spreads its load's waits over its
steps and gives the same tokens, also when the held load fails or the prompt is aborted."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tierkv.connector.held import HeldLoads
from tierkv.connector.plan import LoadPlan
from tierkv.connector.transfer import LoadJob


def job(*rids: str, staged: bool = False) -> LoadJob:
    plans = [
        LoadPlan(r, torch.arange(4, dtype=torch.int32), 0, 64, [], [], np.zeros(64, np.int64))
        for r in rids
    ]
    j = LoadJob(plans, [threading.Event() for _ in range(3)])
    j.staged = {} if staged else None
    return j


def test_only_a_load_of_one_request_scattered_on_arrival_is_held() -> None:
    h = HeldLoads()
    assert not h.hold("a", None)
    assert not h.hold("a", job("a", "b"))  # the step loads for another request too
    assert not h.hold("a", job("a", staged=True))  # its layers scatter on the engine's wait
    j = job("a", "a")
    assert h.hold("a", j) and h.jobs == {"a": j}
    assert not h.hold("a", job("a"))  # one held load per request
    assert h.active is None


def test_resume_names_the_load_waited_on_and_end_reports_it_once() -> None:
    h = HeldLoads()
    a, b = job("a"), job("b")
    assert h.hold("a", a) and h.hold("b", b)
    h.resume("b")
    assert h.active is b
    h.resume("nobody")
    assert h.active is None
    h.resume("a")
    h.end("a", cancel=False)
    assert h.active is None and "a" not in h.jobs and not a.cancelled
    h.end("a", cancel=True)  # already ended: nothing more
    assert h.take_ended() == [a] and h.take_ended() == []
    h.end("b", cancel=True)
    assert b.cancelled and all(p.failed_from == p.start for p in b.plans)
    assert h.take_ended() == [b] and h.jobs == {}


def test_cancel_waits_for_a_scatter_in_progress() -> None:
    """end(cancel=True) returns only once a scatter holding the job's lock let go of it."""
    h, j = HeldLoads(), job("a")
    assert h.hold("a", j)
    order: list[str] = []
    inside = threading.Event()

    def scatter() -> None:
        with j.lock:
            inside.set()
            threading.Event().wait(0.2)
            order.append("scatter")

    t = threading.Thread(target=scatter)
    t.start()
    inside.wait(5)
    h.end("a", cancel=True)
    order.append("ended")
    t.join()
    assert order == ["scatter", "ended"]


@pytest.mark.parametrize("bad", ["raise", "staged"])
def test_bad_holds_change_nothing(bad: str) -> None:
    h = HeldLoads()
    j = job("a", staged=bad == "staged") if bad == "staged" else job("a", "b")
    assert not h.hold("a", j)
    assert h.jobs == {} and h.active is None and h.ended == []
