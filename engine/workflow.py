"""Workflow steps (KVFlow): what the engine does when a hinted request starts a step.

The hint's steps-to-next-use table goes to the prefix cache's eviction (RadixTree.advise), and
the agents of the next step (steps-to-next-use 1) get their prompts prefetched through the
connector. The prompt of each (workflow, agent)'s last hinted request is remembered, bounded,
as the best guess of its next one (an agent's fixed system prompt leads it); an agent the
workflow has not run yet takes the last prompt of the same agent name under the same
cache_salt in any workflow (the agents of one application serve many workflows).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Generic, TypeVar

from tierkv.storage_backends.hints import KVHint

if TYPE_CHECKING:
    from tierkv.engine.block_manager import BlockManager
    from tierkv.engine.kv_connector import KVConnector

MAX_TAGGED = 16  # agents of a table whose cached prompts are tagged, the soonest first

Prompt = tuple[list[int], str | None]  # token ids and cache_salt
K = TypeVar("K")


@dataclass(slots=True)
class Bounded(Generic[K]):
    """The latest max_items values by key; the least recently set goes first."""

    max_items: int
    items: OrderedDict[K, Prompt] = field(default_factory=OrderedDict)

    def set(self, key: K, value: Prompt) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.max_items:
            self.items.popitem(last=False)


@dataclass(slots=True)
class StepPrefetch:
    max_agents: int = 1024  # remembered prompts, per (workflow, agent) and per (agent, salt)
    max_tokens: int = 1 << 16  # of one remembered prompt (its head is what gets reused)
    by_workflow: Bounded[tuple[str, str]] = field(default_factory=lambda: Bounded(1024))
    by_agent: Bounded[tuple[str, str | None]] = field(default_factory=lambda: Bounded(1024))
    # per workflow: the table last seen and the agents prefetched under it (once per step)
    done: OrderedDict[str, tuple[dict[str, int], set[str]]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.by_workflow.max_items = self.by_agent.max_items = self.max_agents

    def start(
        self,
        hint: KVHint,
        prompt: list[int],
        cache_salt: str | None,
        blocks: BlockManager,
        connector: KVConnector,
        prefetch: bool,
    ) -> list[tuple[list[int], KVHint, str | None]]:
        """A hinted request starts a step: its table ranks the prefix cache, the cached prompts
        of the agents it names are tagged (an agent's nodes rank by this workflow's table even
        before it runs in it: agents serve many workflows), and the next step's agents'
        prompts are prefetched (the connector's prefetch returns at once). Returns what was
        prefetched: (prompt, its agent's hint, cache_salt)."""
        if blocks.tree is not None:
            blocks.tree.advise(hint)
            soonest = sorted(hint.steps().items(), key=lambda kv: kv[1])[:MAX_TAGGED]
            for agent, _ in soonest:
                known = self.latest(hint.workflow, agent, cache_salt)
                if agent != hint.agent and known is not None:
                    blocks.tag_prompt(known[0], known[1], replace(hint, agent=agent))
        sent = []
        for agent, (tokens, salt) in self.step_started(hint, prompt, cache_salt):
            if prefetch:
                sent.append((tokens, replace(hint, agent=agent), salt))
                connector.prefetch(*sent[-1])
        return sent

    def latest(self, workflow: str, agent: str, cache_salt: str | None) -> Prompt | None:
        """The agent's last prompt in the workflow, else in any workflow under cache_salt."""
        known = self.by_workflow.items.get((workflow, agent))
        return known or self.by_agent.items.get((agent, cache_salt))

    def step_started(
        self, hint: KVHint, prompt: list[int], cache_salt: str | None = None
    ) -> list[tuple[str, Prompt]]:
        """Record prompt as the hint's agent's; returns (agent, (prompt, salt)) of each agent of
        the workflow's next step whose prompt is known and not yet prefetched for this step."""
        mine = (list(prompt[: self.max_tokens]), cache_salt)
        self.by_workflow.set((hint.workflow, hint.agent), mine)
        self.by_agent.set((hint.agent, cache_salt), mine)
        steps = hint.steps()
        table, sent = self.done.get(hint.workflow, (None, set()))
        if table != steps:  # a step started: nothing prefetched for it yet
            sent = set()
        self.done[hint.workflow] = (steps, sent)
        self.done.move_to_end(hint.workflow)
        while len(self.done) > self.max_agents:
            self.done.popitem(last=False)
        out = []
        for agent, d in steps.items():
            if d != 1 or agent in sent:
                continue
            known = self.latest(hint.workflow, agent, cache_salt)
            if known is not None:
                sent.add(agent)
                out.append((agent, known))
        return out
