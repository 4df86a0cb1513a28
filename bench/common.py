"""What every benchmark shares: machine info, timing, goals, table, JSON and PNG output.

Each `python -m bench.NAME` writes `bench/results/NAME.json` and `NAME.png` with
{"bench", "machine", "config", "rows", "goals"}; docs/benchmarks.md is generated from them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from tierkv.kernels.cpu import cpu_flags

    simd = "avx avx2 fma f16c avx512f avx512bw avx512_bf16 avx512_fp16 avx512_vnni amx_tile"
    simd += " amx_bf16 amx_int8 neon asimd sve"
    info = {
        "cpu": cpu,
        # the SIMD flags the kernels and torch's GEMMs depend on; all flags below
        "flags": [f for f in simd.split() if f in cpu_flags()],
        "all_flags": sorted(cpu_flags()),
        "threads": os.cpu_count(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a small version, under a minute")
    return p


def add_model_arg(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--model",
        default="bench",
        choices=("bench", "smollm2"),
        help="bench: the random-weight bench model; smollm2: SmolLM2-135M-Instruct (pulled)",
    )
    return p


def median_time(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds; the machine is noisy, so never a single run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_bw(nbytes: int, repeat: int = 7) -> float:
    """Bytes per second of one torch copy of nbytes on every thread (median; the warm-up copy
    faults the pages in): the memory baseline that benchmarks measure in the same run."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return nbytes / median_time(lambda: dst.copy_(src), repeat=repeat)


def goal(name: str, value: float, op: str, target: float, unit: str = "") -> dict[str, Any]:
    if op not in (">=", "<="):
        raise ValueError(f"goal op must be '>=' or '<=', got {op!r}")
    met = value >= target if op == ">=" else value <= target
    return {
        "name": name,
        "value": value,
        "op": op,
        "target": target,
        "unit": unit,
        "met": bool(met),
    }


def print_table(rows: Sequence[dict[str, Any]], columns: Iterable[str] | None = None) -> str:
    if not rows:
        return ""
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [
        " | ".join(c.ljust(w) for c, w in zip(cols, widths)),
        "-|-".join("-" * w for w in widths),
    ]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    text = "\n".join(lines)
    print(text)
    return text


def print_goals(goals: Sequence[dict[str, Any]]) -> None:
    for g in goals:
        mark = "MET " if g["met"] else "MISS"
        print(
            f"[{mark}] {g['name']}: {g['value']:.4g} {g['unit']} "
            f"(target {g['op']} {g['target']:.4g})"
        )


def write_results(
    name: str,
    config: dict[str, Any],
    rows: list[dict[str, Any]],
    goals: list[dict[str, Any]],
    plot: Callable[[Any], None] | None = None,
) -> Path:
    """Write bench/results/NAME.json and, when plot is given, NAME.png (plot draws on an Axes)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    doc = {
        "bench": name,
        "machine": machine_info(),
        "config": config,
        "rows": rows,
        "goals": goals,
        "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps(doc, indent=2))
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        plot(ax)
        ax.set_title(name)
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=110)
        plt.close(fig)
    print_goals(goals)
    print(f"wrote {out}")
    return out


class Checkpoint:
    """A long benchmark's finished work units (lists of records, the first carrying the unit's
    id under "q"), appended as each ends, so a run cut short resumes; kept only while the
    settings (its first line) are the same."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        self.done: dict[Any, list[dict[str, Any]]] = {}
        lines = path.read_text().splitlines() if path.exists() else []
        if lines and json.loads(lines[0]) == settings:
            for line in lines[1:]:
                try:
                    recs = json.loads(line)
                except json.JSONDecodeError:
                    break  # the unit being written when the run was cut: done again
                self.done[recs[0]["q"]] = recs
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [json.dumps(r) for r in self.done.values()]
        path.write_text("".join(line + "\n" for line in [json.dumps(settings), *kept]))

    def add(self, recs: list[dict[str, Any]]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(recs) + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
