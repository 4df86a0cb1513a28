"""Loads kept past their step: a layered prefill (engine/layered.py) computes its prompt's layers
over several steps, so its load need not land in the step that starts it. Its step hands the
load over (`hold`); later steps wait for a layer only when the prefill's own pieces are about to
read it (`resume` names whose load `WorkerCore.wait_layer` then waits on), and the prefill ends
it when its last layer ran or when it is dropped (`end`). The step's other rows never wait on
it. Each held load goes on streaming on the connector's loop thread meanwhile.

Safety contract: a held load writes only into the blocks of the request it was held for, as any
load does; `end(..., cancel=True)` returns once nothing more is written (LoadJob.cancel), so the
caller may free those blocks right after. What a held load failed to deliver is reported by the
first `WorkerCore.load_errors` after its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.connector.transfer import LoadJob


@dataclass(slots=True, eq=False)
class HeldLoads:
    """The held loads of one worker, by request id. The engine's thread calls every method."""

    jobs: dict[str, LoadJob] = field(default_factory=dict)
    active: LoadJob | None = None  # the one wait_layer and loaded_ranges read, while set
    ended: list[LoadJob] = field(default_factory=list)  # booked by the next load_errors

    def hold(self, request_id: str, job: LoadJob | None) -> bool:
        """Keep job past its step for request_id: only a load of that request alone, whose
        layers scatter as they arrive (not on wait)."""
        if job is None or job.staged is not None or request_id in self.jobs:
            return False
        if any(p.request_id != request_id for p in job.plans):
            return False
        self.jobs[request_id] = job
        return True

    def resume(self, request_id: str | None) -> None:
        """wait_layer waits on request_id's held load (None: on the step's own)."""
        self.active = None if request_id is None else self.jobs.get(request_id)

    def end(self, request_id: str, cancel: bool) -> None:
        """request_id's held load is done with: cancelled first when its blocks go."""
        job = self.jobs.pop(request_id, None)
        if job is None:
            return
        if cancel:
            job.cancel()
        if self.active is job:
            self.active = None
        self.ended.append(job)

    def take_ended(self) -> list[LoadJob]:
        ended, self.ended = self.ended, []
        return ended
