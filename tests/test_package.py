"""The distribution installs one importable package, `tierkv`, and its two console scripts;
the repository's folders are never importable under their own names."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
_SETUP = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
DIRS: dict[str, str] = _SETUP["package-dir"]  # the parts' one list: tierkv.<part> -> folder
PARTS = tuple(DIRS[k] for k in DIRS)  # the folders


def test_parts_listed_once() -> None:
    """pyproject maps each part to its folder; every package folder under a part is listed in
    `packages` (a subpackage left out would be missing from the wheel), and no other top-level
    folder is a package."""
    packages = set(_SETUP["packages"])
    assert set(DIRS) <= packages
    found = set()
    for pkg, folder in DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((pkg, *rel)))
    assert found == packages, (sorted(found - packages), sorted(packages - found))
    tops = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert tops - set(PARTS) <= {"bench", "examples", "tests"}, tops


def test_wheel_holds_only_tierkv(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    (wheel,) = tmp_path.glob("tierkv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    dist = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist == {"tierkv"}, tops
    for pkg in _SETUP["packages"]:
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    assert "tierkv/kernels/cpu_attention.cpp" in names  # sources the C++ kernels build from
    assert not any(n.startswith(("tierkv/bench", "tierkv/tests", "tierkv/examples")) for n in names)
    (meta,) = dist
    scripts = zipfile.ZipFile(wheel).read(f"{meta}/entry_points.txt").decode()
    assert "tierkv-server = tierkv.cacheserver.cli:main" in scripts
    assert "tierkv-engine = tierkv.engine.cli:main" in scripts


def test_folder_names_are_not_importable_outside_the_repository(tmp_path: Path) -> None:
    """From another directory, `import engine` etc. fail; `kernels` may only be another
    distribution's (transformers depends on Hugging Face's `kernels`), never this folder."""
    code = (
        "import importlib.util, json, sys\n"
        "out = {}\n"
        f"for name in {['bench', 'examples', 'tests', *PARTS]!r}:\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    where = None if spec is None else spec.origin or spec.submodule_search_locations\n"
        "    out[name] = None if where is None else str(where)\n"
        "import tierkv.engine, tierkv.kernels\n"
        "out['tierkv.kernels'] = tierkv.kernels.__file__\n"
        "print(json.dumps(out))\n"
    )
    p = subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    import json

    found = json.loads(p.stdout)
    assert found.pop("tierkv.kernels") == str(ROOT / "kernels" / "__init__.py")
    ours = [str(ROOT / name) for name in found]
    for name, origin in found.items():
        assert origin is None or not origin.startswith(tuple(ours)), (name, origin)
    for name in (
        "engine",
        "proto",
        "bench",
        "storage_backends",
        "cacheserver",
        "connector",
        "vllm_adapter",
    ):
        assert found[name] is None, (name, found[name])


def test_imports_point_one_way() -> None:
    """The allowed directions of docs/architecture.md, read from the source by the script that draws
    docs/architecture.png; only an entry point (tierkv-engine) wires a part in from above."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "docs/import_graph.py")
    assert spec is not None and spec.loader is not None
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    assert set(graph.parts()) == set(graph.ALLOWED)
    edges = graph.edges()
    assert ("cacheserver", "storage_backends") in edges  # the scan sees imports
    for (a, b), files in edges.items():
        core = [f for f in files if not f.startswith(graph.ENTRY)]
        assert not core or b in graph.ALLOWED[a], (a, b, core)


def test_no_name_imported_for_type_checking_only_is_used_at_run_time() -> None:
    """A name imported under `if TYPE_CHECKING:` and called at run time passes ruff and mypy
    but fails when that code runs (examples and benchmarks have no test that runs them all):
    each such use must import the name again where it runs."""
    import ast

    bad = []
    for path in sorted(p for d in (*PARTS, "bench", "examples") for p in (ROOT / d).rglob("*.py")):
        src = path.read_text()
        if "TYPE_CHECKING" not in src:
            continue
        tree = ast.parse(src)
        guarded = {
            a.asname or a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"
            for s in n.body
            if isinstance(s, ast.Import | ast.ImportFrom)
            for a in s.names
        }
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            local = {
                a.asname or a.name.split(".")[0]
                for s in ast.walk(fn)
                if isinstance(s, ast.Import | ast.ImportFrom)
                for a in s.names
            }
            annotations = {
                id(m)
                for n in ast.walk(fn)
                for x in (getattr(n, "annotation", None), getattr(n, "returns", None))
                if x is not None
                for m in ast.walk(x)
            }
            bad += [
                f"{path.relative_to(ROOT)}:{n.lineno}: {n.id}"
                for n in ast.walk(fn)
                if isinstance(n, ast.Name)
                and n.id in guarded - local
                and isinstance(n.ctx, ast.Load)
                and id(n) not in annotations
            ]
    assert not bad, bad
