"""Workflow hints (KVFlow): which agent's KV is needed how soon, as an application tells it.

A hint names a workflow, the agent a request runs for, and how many workflow steps remain until
each of the workflow's agents runs next: given directly (`next_use`), or as the workflow's step
graph (`graph`: the agents of each step in order, the step running now, and whether the
workflow loops), from which `steps_to_next_use` computes it. The same JSON object is accepted by
`tierkv-engine serve` (the request body's `kv_hints`), `LLM.generate(kv_hints=...)` and the
cache server's Hint call:

    {"workflow": "w1", "agent": "coder", "next_use": {"planner": 2, "coder": 0, "reviewer": 1}}
    {"workflow": "w1", "agent": "coder",
     "graph": {"steps": [["planner"], ["coder", "tester"], ["reviewer"]], "at": 1, "loop": true}}

Hints are advice: a stale or wrong hint can only make a cache slower, never wrong. A malformed
one raises HintError naming the field, before anything changes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_AGENTS = 256  # agents named in one hint
MAX_STEPS = 1024  # steps of one graph, and the largest steps-to-next-use accepted
NAME = re.compile(r"[A-Za-z0-9_.:/@+-]{1,128}")
NEVER = math.inf  # steps to the next use of an agent the hint does not name


class HintError(ValueError):
    """A malformed hint; `field` names the offending field (e.g. "kv_hints.next_use.coder")."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


@dataclass(slots=True, frozen=True)
class StepGraph:
    steps: tuple[tuple[str, ...], ...]  # the agents run at each step, in order
    at: int  # the step running now
    loop: bool = False  # after the last step the workflow starts again at step 0


@dataclass(slots=True, frozen=True)
class KVHint:
    workflow: str
    agent: str  # the agent this request runs for
    next_use: Mapping[str, int] = field(default_factory=dict)  # agent -> steps until it runs
    graph: StepGraph | None = None

    def steps(self) -> dict[str, int]:
        """Steps until each named agent runs next (0: in the step running now)."""
        return dict(self.next_use) if self.graph is None else steps_to_next_use(self.graph)


def hint_json(h: KVHint) -> dict[str, Any]:
    """h in the JSON form parse_hint reads (parse_hint(hint_json(h)) == h)."""
    out: dict[str, Any] = {"workflow": h.workflow, "agent": h.agent}
    if h.graph is None:
        out["next_use"] = dict(h.next_use)
    else:
        g = h.graph
        out["graph"] = {"steps": [list(s) for s in g.steps], "at": g.at, "loop": g.loop}
    return out


def steps_to_next_use(g: StepGraph) -> dict[str, int]:
    """For each agent of the graph, how many steps after `at` it runs next (0: at `at`). An
    agent that never runs again (no loop, and only before `at`) is left out."""
    out: dict[str, int] = {}
    n = len(g.steps)
    span = n if g.loop else n - g.at
    for d in range(span):
        for agent in g.steps[(g.at + d) % n]:
            out.setdefault(agent, d)
    return out


def parse_hint(obj: Any, where: str = "kv_hints") -> KVHint:
    """A KVHint from its JSON form; HintError naming the field when anything is off."""
    if not isinstance(obj, Mapping):
        raise HintError(where, "must be an object")
    unknown = set(obj) - {"workflow", "agent", "next_use", "graph"}
    if unknown:
        raise HintError(f"{where}.{sorted(unknown)[0]}", "unknown field")
    wf = _name(obj.get("workflow"), f"{where}.workflow")
    agent = _name(obj.get("agent"), f"{where}.agent")
    if ("next_use" in obj) == ("graph" in obj):
        raise HintError(where, "needs exactly one of next_use and graph")
    if "graph" in obj:
        return KVHint(wf, agent, graph=_graph(obj["graph"], f"{where}.graph"))
    nu = obj["next_use"]
    if not isinstance(nu, Mapping) or not 0 < len(nu) <= MAX_AGENTS:
        raise HintError(f"{where}.next_use", f"must be an object of 1 to {MAX_AGENTS} agents")
    steps = {}
    for k, v in nu.items():
        f = f"{where}.next_use.{k}"
        _name(k, f)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_STEPS:
            raise HintError(f, f"must be an integer in 0..{MAX_STEPS}")
        steps[k] = v
    return KVHint(wf, agent, next_use=steps)


def _graph(obj: Any, where: str) -> StepGraph:
    if not isinstance(obj, Mapping) or set(obj) - {"steps", "at", "loop"}:
        raise HintError(where, "must be an object of steps, at and loop")
    steps = obj.get("steps")
    if not isinstance(steps, list) or not 0 < len(steps) <= MAX_STEPS:
        raise HintError(f"{where}.steps", f"must be a list of 1 to {MAX_STEPS} steps")
    out: list[tuple[str, ...]] = []
    agents: set[str] = set()
    for i, step in enumerate(steps):
        if not isinstance(step, list) or not step:
            raise HintError(f"{where}.steps[{i}]", "must be a non-empty list of agents")
        out.append(tuple(_name(a, f"{where}.steps[{i}]") for a in step))
        agents.update(out[-1])
    if len(agents) > MAX_AGENTS:
        raise HintError(f"{where}.steps", f"names more than {MAX_AGENTS} agents")
    at, loop = obj.get("at", 0), obj.get("loop", False)
    if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at < len(out):
        raise HintError(f"{where}.at", f"must be a step index in 0..{len(out) - 1}")
    if not isinstance(loop, bool):
        raise HintError(f"{where}.loop", "must be true or false")
    return StepGraph(tuple(out), at, loop)


def _name(v: Any, where: str) -> str:
    if not isinstance(v, str) or not NAME.fullmatch(v):
        raise HintError(where, "must be 1 to 128 of A-Z a-z 0-9 _ . : / @ + -")
    return v
