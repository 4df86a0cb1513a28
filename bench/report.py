"""Render docs/benchmarks.md from the benchmarks' JSON results.

    python -m bench.report [--results DIR] [--out FILE]

Each bench/results/NAME.json ({"bench", "machine", "config", "rows", "goals", "date"}, written
by bench.common.write_results) becomes one section: the machine line, a table of its rows and
a table of its goals. With no results the page lists the commands that produce them.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import RESULTS

OUT = RESULTS.parent.parent / "docs" / "benchmarks.md"
# Benchmarks in the order the page shows them; any other result follows, by name.
ORDER = ("tiers", "server", "kernels", "engine", "engine_fp32", "ttft", "blend", "soak")
COMMANDS = ("tiers", "server", "kernels", "engine", "ttft", "blend", "soak")
# CPU flags that decide kernel speed (x86 SIMD and AMX, Arm SIMD), in the order printed.
SIMD = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
)


@dataclass(slots=True)
class Result:
    name: str
    date: str
    machine: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    goals: list[dict[str, Any]] = field(default_factory=list)


def load(path: Path) -> Result:
    """One result file; a bare list of rows (the demo's) is a result without machine or goals."""
    doc = json.loads(path.read_text())
    mtime = time.strftime("%Y-%m-%d", time.localtime(path.stat().st_mtime))
    if isinstance(doc, list):
        doc = {"rows": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("rows", []), list):
        raise TypeError("not a benchmark result (expected an object with a list of rows)")
    rows = [r for r in doc.get("rows") or [] if isinstance(r, dict)]
    return Result(
        str(doc.get("bench") or path.stem),
        str(doc.get("date") or mtime),
        doc.get("machine") or {},
        doc.get("config") or {},
        rows,
        [g for g in doc.get("goals") or [] if isinstance(g, dict)],
    )


def fmt(v: Any) -> str:
    """A table cell: floats to about 4 significant digits, no exponent above 1000."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, (dict, list)):
        v = json.dumps(v, separators=(",", ":"))
    return str(v).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [f"| {' | '.join(r)} |" for r in [header, ["---"] * len(header), *rows]]


def flags(machine: dict[str, Any]) -> str:
    """The SIMD flags of the machine: from its flag list, else torch's CPU capability."""
    raw = machine.get("flags")
    have = set(raw.split() if isinstance(raw, str) else raw or [])
    found = ", ".join(f for f in SIMD if f in have)
    return found or str(machine.get("cpu_capability") or "not recorded").lower()


def machine_line(r: Result) -> str:
    m = r.machine
    if not m:
        return f"Run on {r.date}."
    gpu = [f"GPU {m['gpu']}"] if m.get("gpu") else []
    parts = [
        f"Run on {r.date}",
        str(m.get("cpu", "unknown CPU")),
        *gpu,
        f"flags: {flags(m)}",
        f"{m.get('threads', '?')} threads",
        f"torch {m.get('torch', '?')}",
    ]
    return ", ".join(parts) + "."


def section(r: Result) -> list[str]:
    out = [f"## {r.name}", "", machine_line(r), ""]
    if r.config:
        out += [f"Config: `{json.dumps(r.config, separators=(', ', ': '))}`", ""]
    cols: list[str] = []
    for row in r.rows:
        cols += [k for k in row if k not in cols]
    if r.rows:
        out += table(cols, [[fmt(row.get(c)) for c in cols] for row in r.rows]) + [""]
    goals = [
        [
            fmt(g.get("name")),
            f"{fmt(g.get('value'))} {g.get('unit', '')}".strip(),
            f"{g.get('op', '')} {fmt(g.get('target'))} {g.get('unit', '')}".strip(),
            "yes" if g.get("met") else "**no**",
        ]
        for g in r.goals
    ]
    if goals:
        out += ["Goals:", ""] + table(["goal", "value", "target", "met"], goals) + [""]
    return out


def empty_page(results: Path) -> list[str]:
    where = "bench/results" if results.resolve() == RESULTS else str(results)
    intro = (
        f"No results in `{where}` yet. Run the benchmarks from the repository root (each "
        "takes `--quick` for a version of under a minute), then regenerate this page:"
    )
    out = [intro, "", "```bash"]
    out += [f"python -m bench.{name}" for name in COMMANDS]
    return out + [
        "python -m bench.engine --dtype fp32   # both systems in fp32",
        "python -m bench.report",
        "```",
        "",
    ]


def render(results: Path) -> str:
    intro = (
        "Generated by `python -m bench.report` from `bench/results/*.json`; edit the "
        "benchmarks, not this page. Unless a section says otherwise the model is the bench "
        "model: Llama architecture, hidden 512, 8 layers, 8 heads, 2 KV heads, "
        "intermediate 1408, vocab 32000, bf16, random weights from seed 0."
    )
    lines = ["# Benchmarks", "", intro, ""]
    found, skipped = [], []
    for path in sorted(results.glob("*.json")) if results.is_dir() else []:
        try:
            found.append(load(path))
        except (OSError, TypeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            skipped.append(f"`{path.name}`: {e}")
    if not found:
        lines += empty_page(results)
    rank = {name: i for i, name in enumerate(ORDER)}
    for r in sorted(found, key=lambda r: (rank.get(r.name, len(ORDER)), r.name)):
        lines += section(r)
    if skipped:
        lines += ["Skipped files:", ""] + [f"- {s}" for s in skipped] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="render docs/benchmarks.md from bench results")
    p.add_argument("--results", type=Path, default=RESULTS, help="directory of NAME.json results")
    p.add_argument("--out", type=Path, default=OUT, help="the page to write")
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(args.results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
