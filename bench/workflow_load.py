"""bench.workflow's workload: five agents with fixed system prompts, and the order in which a
workflow calls them (a planner, then coder and tester in a loop, a branch, a reviewer and a
writer, per task)."""

from __future__ import annotations

import random

from tierkv.engine.tokenizer import Tokenizer

AGENTS = ("planner", "coder", "tester", "reviewer", "writer")
CHUNK = 64  # the connector's chunk tokens: a step's turn spoils one chunk only
WORDS = (
    "module interface contract test branch merge review latency cache token budget schema "
    "parser service queue retry timeout index shard replica rollback deploy metric trace span "
    "patch diff commit release owner ticket sprint design spec input output error log config"
).split()


def system_prompt(agent: str, words: int) -> str:
    """A distinct, deterministic system prompt of about words words."""
    rng = random.Random(agent)
    rules = []
    for i in range(words // 12):
        body = " ".join(rng.choice(WORDS) for _ in range(9))
        rules.append(f"Rule {i + 1} for the {agent}: {body}.")
    return f"You are the {agent} of a software team. " + " ".join(rules)


def plan(wf: int, tasks: int = 2) -> list[str]:
    """A workflow's steps: tasks, each a loop of coder and tester and a branch."""
    rng, steps = random.Random(wf), []
    for _ in range(tasks):
        steps.append("planner")
        for _ in range(rng.randint(1, 2)):
            steps += ["coder", "tester"]
        if rng.random() < 0.5:  # the branch: the tester checks the fix once more
            steps.append("tester")
        steps += ["reviewer", "writer"]
    return steps


def next_use(steps: list[str], i: int) -> dict[str, int]:
    """What the application knows at step i: the steps until each agent runs next."""
    out: dict[str, int] = {}
    for j in range(i, len(steps)):
        out.setdefault(steps[j], j - i)
    return out


def chat_ids(tok: Tokenizer, system: str) -> list[int]:
    """The system message as the chat template renders it: every step's prompt starts so."""
    text = tok.apply_chat_template([{"role": "system", "content": system}], False)
    return tok.encode(text, add_special_tokens=False)
