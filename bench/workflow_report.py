"""bench.workflow's goals (the issue's, per memory size and concurrency) and its figure."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench.common import goal

SYSTEMS = ("lru", "hints", "hints+prefetch")


def summarize(recs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """A system's row from its step records (step, ttft, prompt, and the prompt tokens found
    in the engine, cpu and disk tiers; warm: the step started with its agent's prompt there)."""
    prompt = sum(r["prompt"] for r in recs)
    found = {k: sum(r[k] for r in recs) for k in ("engine", "cpu", "disk")}
    warned = [r["warm"] for r in recs if r["step"] > 0]
    return dict(
        time_s=wall,
        ttft_ms=1000 * statistics.median(r["ttft"] for r in recs),
        steps=len(recs),
        engine_pct=100 * found["engine"] / prompt,
        cpu_pct=100 * found["cpu"] / prompt,
        disk_pct=100 * found["disk"] / prompt,
        computed_pct=100 * (prompt - sum(found.values())) / prompt,
        warm_pct=100 * sum(warned) / max(1, len(warned)),
    )


def goals(rows: list[dict[str, Any]], conc: int) -> list[dict[str, Any]]:
    t = {(r["memory"], r["workflows"], r["system"]): r for r in rows}
    out = []
    for n, target in ((1, 1.8), (conc, 2.0)):
        lru, best = t[("tight", n, "lru")], t[("tight", n, "hints+prefetch")]
        out.append(
            goal(
                f"tight, {n} workflow(s): hints+prefetch speedup over LRU",
                lru["time_s"] / best["time_s"],
                ">=",
                target,
                "x",
            )
        )
    for n in (1, conc):
        lru, best = t[("loose", n, "lru")], t[("loose", n, "hints+prefetch")]
        out.append(
            goal(
                f"loose, {n} workflow(s): hints+prefetch time / LRU time",
                best["time_s"] / lru["time_s"],
                "<=",
                1.03,
                "x",
            )
        )
    warm = [t[("tight", n, "hints+prefetch")]["warm_pct"] for n in (1, conc)]
    out.append(
        goal("tight: warned steps that start warm (hints+prefetch)", min(warm), ">=", 90, "%")
    )
    return out


def plotter(rows: list[dict[str, Any]]) -> Callable[[Any], None]:
    """Draws the end-to-end time of each system, per memory size and concurrency."""
    return lambda ax: plot(ax, rows)


def plot(ax: Any, rows: list[dict[str, Any]]) -> None:
    labels = sorted({(r["memory"], r["workflows"]) for r in rows})
    systems = [s for s in (*SYSTEMS, "vllm") if any(r["system"] == s for r in rows)]
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        vals = [
            next(
                r["time_s"]
                for r in rows
                if (r["memory"], r["workflows"]) == lab and r["system"] == system
            )
            for lab in labels
        ]
        ax.bar([i + k * width for i in range(len(labels))], vals, width, label=system)
    ax.set_xticks([i + width for i in range(len(labels))])
    ax.set_xticklabels([f"{m}, {n} wf" for m, n in labels])
    ax.set_ylabel("end-to-end time of the workflows (s)")
    ax.legend()


def config(args: Any, plen: int, chunk: int, agents: tuple[str, ...]) -> dict[str, Any]:
    """The run's settings, as the results file records them."""
    return dict(
        model="smollm2",
        dtype="bf16",
        agents=list(agents),
        prompt_tokens=plen,
        chunk=chunk,
        concurrent=args.concurrent,
        max_tokens=args.max_tokens,
        quick=args.quick,
        tiers="engine blocks, cpu tier"
        + (", disk tier (holds all)" if args.slow == "disk" else ""),
    )
