"""bench.report: docs/benchmarks.md rendered from result JSONs, and the page without any."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from bench import report

MACHINE = {"cpu": "AMD EPYC 9R14", "threads": 2, "torch": "2.13.0", "python": "3.11.9"}


def tiers_result() -> dict[str, Any]:
    rows = [
        {"tier": "cpu", "op": "get", "mib": 4, "gb_s": 30.123456, "ratio": 0.8012},
        {
            "tier": "disk",
            "op": "get",
            "mib": 4,
            "gb_s": 14.2,
            "ratio": 0.62,
            "note": "page cache | warm",
        },
    ]
    goals = [
        {
            "name": "cpu get 4 MiB / memcpy",
            "value": 0.8012,
            "op": ">=",
            "target": 0.5,
            "unit": "",
            "met": True,
        },
        {
            "name": "disk get 1 MiB / file read",
            "value": 0.45,
            "op": ">=",
            "target": 0.5,
            "unit": "",
            "met": False,
        },
    ]
    machine = dict(MACHINE, flags=["sse4_2", "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"])
    return {
        "bench": "tiers",
        "machine": machine,
        "config": {"sizes_mib": [1, 4], "repeat": 25},
        "rows": rows,
        "goals": goals,
        "date": "2026-12-02",
    }


def server_result() -> dict[str, Any]:
    """As bench.common.write_results writes it, less the date (an older file): mtime stands in."""
    rows = [
        {
            "system": "tierkv-server (cpu tier)",
            "mib": 32,
            "clients": 1,
            "put_gb_s": 0.38,
            "get_gb_s": 0.65,
        },
        {
            "system": "loopback TCP",
            "mib": 32,
            "clients": 1,
            "put_gb_s": 1.26,
            "get_gb_s": 1.69,
            "lookup_p50_ms": 0.88,
        },
    ]
    goals = [
        {
            "name": "Lookup of 64 keys, p50",
            "value": 0.88,
            "op": "<=",
            "target": 1.0,
            "unit": "ms",
            "met": True,
        }
    ]
    machine = dict(MACHINE, cpu_capability="AVX2")
    return {
        "bench": "server",
        "machine": machine,
        "config": {"quick": True},
        "rows": rows,
        "goals": goals,
    }


def write(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_sections_tables_goals_and_machine_line(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    write(results / "tiers.json", tiers_result())
    server = write(results / "server.json", server_result())
    stamp = time.mktime((2026, 11, 30, 12, 0, 0, 0, 0, -1))
    os.utime(server, (stamp, stamp))
    (results / "broken.json").write_text("{not json")
    out = tmp_path / "docs" / "benchmarks.md"

    assert report.main(["--results", str(results), "--out", str(out)]) == 0
    page = out.read_text()

    # sections in the benchmarks' order, whatever the file names sort to
    assert page.index("## tiers") < page.index("## server")
    assert (
        "Run on 2026-12-02, AMD EPYC 9R14, flags: avx2, fma, avx512f, avx512_bf16, amx_bf16, "
        "2 threads, torch 2.13.0."
    ) in page
    assert "Run on 2026-11-30, AMD EPYC 9R14, flags: avx2, 2 threads, torch 2.13.0." in page
    # rows: the union of keys in order, floats shortened, pipes escaped, missing cells empty
    assert "| tier | op | mib | gb_s | ratio | note |" in page
    assert "| cpu | get | 4 | 30.12 | 0.8012 |  |" in page
    assert "| disk | get | 4 | 14.2 | 0.62 | page cache \\| warm |" in page
    assert "| system | mib | clients | put_gb_s | get_gb_s | lookup_p50_ms |" in page
    assert "| tierkv-server (cpu tier) | 32 | 1 | 0.38 | 0.65 |  |" in page
    # goals
    assert "| goal | value | target | met |" in page
    assert "| cpu get 4 MiB / memcpy | 0.8012 | >= 0.5 | yes |" in page
    assert "| disk get 1 MiB / file read | 0.45 | >= 0.5 | **no** |" in page
    assert "| Lookup of 64 keys, p50 | 0.88 ms | <= 1 ms | yes |" in page
    assert 'Config: `{"sizes_mib": [1, 4], "repeat": 25}`' in page
    # a file that does not parse is named, not fatal; no "run these" list when results exist
    assert "`broken.json`" in page
    assert "python -m bench.soak" not in page


def test_bare_row_list_and_number_formats(tmp_path: Path) -> None:
    rows = [{"question": 0, "cold_ms": 3245.4, "kl": 1.6e-4, "ok": True}]
    write(tmp_path / "rag_demo.json", rows)
    page = report.render(tmp_path)
    assert "## rag_demo" in page
    assert "| question | cold_ms | kl | ok |" in page
    assert "| 0 | 3245 | 0.00016 | yes |" in page
    assert "Goals:" not in page


def test_no_results_lists_the_commands(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(tmp_path / "missing"), "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("# Benchmarks")
    assert "No results in" in page
    for name in ("tiers", "server", "kernels", "engine", "ttft", "blend", "soak", "report"):
        assert f"python -m bench.{name}" in page
    assert "##" not in page
