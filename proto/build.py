"""Generate proto/tierkv_pb2.py, its type stub tierkv_pb2.pyi, and proto/tierkv_pb2_grpc.py
from proto/tierkv.proto.

Run as `python -m tierkv.proto.build` (or `make proto`). protoc names a generated module
after the .proto's path under its include root, so the source is compiled from a scratch
tree `tierkv/proto/tierkv.proto`: the stub then imports `from tierkv.proto import
tierkv_pb2`, the module's installed name, with no path tricks.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "tierkv.proto"
OUTPUTS = ("tierkv_pb2.py", "tierkv_pb2.pyi", "tierkv_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile SOURCE into out_dir; returns the generated files."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tierkv" / "proto"
        tree.mkdir(parents=True)
        shutil.copyfile(SOURCE, tree / SOURCE.name)
        args = [
            "protoc",
            f"-I{tmp}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",  # the message classes' types, for mypy
            f"--grpc_python_out={tmp}",
            str(tree / SOURCE.name),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {SOURCE}")
        for name in OUTPUTS:
            shutil.copyfile(tree / name, out_dir / name)
    return [out_dir / name for name in OUTPUTS]


def main() -> int:
    for path in generate(HERE):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
