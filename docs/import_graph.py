"""`python docs/import_graph.py`: docs/architecture.png, the parts and who imports whom.

The graph is read from the source (every `import tierkv.<part>` and `from tierkv.<part>`,
at module level or inside a function), so the picture cannot drift from the code; the
allowed directions are checked by tests/test_package.py with the same function.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# Files that assemble a process (a CLI, the HTTP server) and so may wire a part in from above:
# `tierkv-engine` attaches the connector and reads the tier knobs' documentation. Drawn dashed;
# the core never does.
ENTRY = ("engine/cli", "engine/serve/")
# The allowed directions (docs/architecture.md); tests/test_package.py checks the code against them.
ALLOWED = {
    "kernels": set(),
    "storage_backends": set(),
    "proto": set(),
    "cacheserver": {"storage_backends", "proto"},
    "engine": {"kernels", "storage_backends"},  # storage_backends: the workflow hints only
    "connector": {"kernels", "storage_backends", "cacheserver", "engine"},
    "vllm": {"connector", "storage_backends", "kernels"},
}


def parts() -> dict[str, str]:
    """tierkv.<part> -> folder, from pyproject.toml (the parts' one list)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {k.split(".")[1]: v for k, v in setup["package-dir"].items()}


def edges() -> dict[tuple[str, str], list[str]]:
    """(importer part, imported part) -> the importing files, relative to the root."""
    out: dict[tuple[str, str], list[str]] = {}
    for part, folder in parts().items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module]
                for name in names:
                    bits = name.split(".")
                    if bits[0] == "tierkv" and len(bits) > 1 and bits[1] != part:
                        files = out.setdefault((part, bits[1]), [])
                        rel = str(path.relative_to(ROOT))
                        if rel not in files:
                            files.append(rel)
    return out


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Layers from the top: whoever imports more sits higher.
    names = list(parts())
    graph = edges()
    core = {e for e, files in graph.items() if not all(f.startswith(ENTRY) for f in files)}
    level = {n: 0 for n in names}
    for _ in names:  # longest path to a leaf over the core edges, which have no cycle
        for a, b in core:
            level[a] = max(level[a], level[b] + 1)
    rows: dict[int, list[str]] = {}
    for n in names:
        rows.setdefault(level[n], []).append(n)
    pos: dict[str, tuple[float, float]] = {}
    for lv in sorted(rows, reverse=True):  # top down, each part under its importers' middle
        ups = {n: [pos[a][0] for a, b in core if b == n and a in pos] for n in rows[lv]}
        members = sorted(rows[lv], key=lambda n: sum(ups[n]) / len(ups[n]) if ups[n] else 0.5)
        span = 0.7 if lv else 0.5
        for i, n in enumerate(members):
            x = 0.5 + (i - (len(members) - 1) / 2) * span / max(len(members) - 1, 1)
            pos[n] = (x, 0.1 + 0.8 * lv / max(rows))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for (a, b), files in graph.items():
        (xa, ya), (xb, yb) = pos[a], pos[b]
        up = yb > ya  # an entry point wiring in a part from above
        style = {"arrowstyle": "->", "lw": 1 + 0.1 * len(files), "color": "0.35"}
        if (a, b) not in core:
            style.update(linestyle="--", color="#c0504d", connectionstyle="arc3,rad=0.3")
        ax.annotate(
            "",
            (xb, yb - 0.05 if up else yb + 0.05),
            (xa, ya + 0.05 if up else ya - 0.05),
            arrowprops=style,
        )
    for n, (x, y) in pos.items():
        ax.text(
            x,
            y,
            f"tierkv.{n}\n{parts()[n]}/",
            ha="center",
            va="center",
            fontsize=9,
            bbox={"boxstyle": "round", "fc": "#e8f0fe", "ec": "#4a6fa5"},
        )
    ax.set_axis_off()
    ax.set_title(
        "tierkv: who imports whom (importer -> imported; width: files;\n"
        "dashed: the entry point tierkv-engine wiring in the connector and the tier knobs)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    for (a, b), files in sorted(edges().items()):
        print(f"{a} -> {b}: {', '.join(files)}")
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "architecture.png"
    draw(target)
    print(f"wrote {target}")
