"""`python -m bench.gpu_check` (`make gpu-check`): what only a GPU can show, in one run.

On a machine with CUDA and a Triton build it runs, each as its own pytest process:
- the Triton kernels' tests compiled for the GPU (no interpreter), against their torch
  references on the same device (TIERKV_TEST_DEVICE=cuda);
- the engine, connector and CacheBlend tests on the Triton path (on CUDA the engine runs
  the Triton kernels);
- the gpu tier's tests (segments on the CUDA device);
- a short TTFT run (`bench.ttft --quick`: cold prefill against hits from every tier);
and writes bench/results/gpu_check.json with each step's counts, time and exit status. It
refuses to run without CUDA: on a CPU the interpreted Triton path is `make test-triton`.
The wheels it needs besides torch and Triton are installed from a local folder by
`make gpu-check WHEELS=DIR` (docs/kernels.md, "GPU check").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS, goal, parser, print_table, write_results

ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Step:
    name: str
    args: list[str]  # after `python -m`
    env: dict[str, str]
    pytest: bool = True


def steps(quick: bool) -> list[Step]:
    gpu = {"TIERKV_TEST_DEVICE": "cuda"}
    steps = [
        Step("triton kernels, compiled", ["pytest", "tests/test_kernels_triton.py"], gpu),
        Step("engine and connector, Triton path", ["pytest", "-m", "triton_path", "tests"], {}),
        Step("gpu tier", ["pytest", "tests/test_tiers.py", "tests/test_store.py", "-k", "gpu"], {}),
        Step("ttft", ["bench.ttft", *(["--quick"] if quick else ["--lengths", "8192"])], {}, False),
    ]
    return steps


def requirements() -> list[str]:
    """What the check needs besides torch and Triton: the package's dependencies and its test
    and bench extras, read from pyproject.toml (their one list)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    specs = [*project["dependencies"], *extras["test"], *extras["bench"]]
    names = {s.split(">")[0].split("=")[0].split("[")[0].strip(): s for s in specs}
    return [s for n, s in names.items() if n not in ("torch", "triton")]


def counts(junit: Path) -> dict[str, int]:
    """passed/failed/errors/skipped from pytest's JUnit XML (its summary line is not stable)."""
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    if not junit.exists():
        return out
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        tests, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0))
        errors, skipped = int(suite.get("errors", 0)), int(suite.get("skipped", 0))
        out["failed"] += failed
        out["errors"] += errors
        out["skipped"] += skipped
        out["passed"] += tests - failed - errors - skipped
    return out


def run(step: Step, tmp: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", *step.args]
    junit = tmp / f"{step.name.replace(' ', '_').replace(',', '')}.xml"
    if step.pytest:
        cmd += ["-q", f"--junitxml={junit}"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    print(f"== {step.name}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, env={**env, **step.env}).returncode
    row: dict[str, Any] = {"step": step.name, "rc": rc, "seconds": time.perf_counter() - t0}
    if step.pytest:
        row.update(counts(junit))
    else:
        ttft = json.loads((RESULTS / "ttft.json").read_text()) if rc == 0 else {"goals": []}
        row["goals met"] = sum(g["met"] for g in ttft["goals"])
        row["goals"] = len(ttft["goals"])
    return row


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--requirements", action="store_true", help="print the wheels it needs")
    args = p.parse_args()
    if args.requirements:
        print("\n".join(requirements()))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check needs CUDA (torch.cuda.is_available() is False); on a CPU run "
            "`make test-triton` for the interpreted Triton path",
            file=sys.stderr,
        )
        return 2
    import triton

    tmp = RESULTS / "gpu_check"
    tmp.mkdir(parents=True, exist_ok=True)
    rows = [run(s, tmp) for s in steps(args.quick)]
    print_table(rows)
    ok = sum(r["rc"] == 0 for r in rows)
    config = {
        "gpu": torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "quick": args.quick,
    }
    goals = [goal("steps passed", ok, ">=", len(rows))]

    def plot(ax: Any) -> None:
        ax.barh([r["step"] for r in rows], [r["seconds"] for r in rows])
        ax.set_xlabel("seconds")

    write_results("gpu_check", config, rows, goals, plot)
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
