"""Workflow steps (KVFlow): what the engine does when a hinted request starts a step.

The hint's steps-to-next-use table goes to the prefix cache's eviction (RadixTree.advise), and
the agents of the next step (steps-to-next-use 1) get their prompts prefetched through the
connector: the prompt of each (workflow, agent)'s last hinted request is remembered, bounded,
as the best guess of its next one (an agent's fixed system prompt leads it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tierkv.storage_backends.hints import KVHint

Tag = tuple[str, str]  # (workflow, agent)
Prompt = tuple[list[int], str | None]  # token ids and cache_salt


@dataclass(slots=True)
class StepPrefetch:
    max_agents: int = 1024  # remembered (workflow, agent) prompts; the oldest goes first
    max_tokens: int = 1 << 16  # of one remembered prompt (its head is what gets reused)
    prompts: OrderedDict[Tag, Prompt] = field(default_factory=OrderedDict)
    # per workflow: the table last seen and the agents prefetched under it (once per step)
    done: OrderedDict[str, tuple[dict[str, int], set[str]]] = field(default_factory=OrderedDict)

    def step_started(
        self, hint: KVHint, prompt: list[int], cache_salt: str | None = None
    ) -> list[tuple[str, Prompt]]:
        """Record prompt as the hint's agent's; returns (agent, (prompt, salt)) of each agent of
        the workflow's next step whose prompt is known and not yet prefetched for this step."""
        tag = (hint.workflow, hint.agent)
        self.prompts[tag] = (list(prompt[: self.max_tokens]), cache_salt)
        self.prompts.move_to_end(tag)
        while len(self.prompts) > self.max_agents:
            self.prompts.popitem(last=False)
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
            known = self.prompts.get((hint.workflow, agent))
            if d == 1 and known is not None and agent not in sent:
                sent.add(agent)
                out.append((agent, known))
        return out
