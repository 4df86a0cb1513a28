"""Generate proto/tierkv_pb2.py and proto/tierkv_pb2_grpc.py from proto/tierkv.proto.

Run from the repository root as `python -m proto.build` (or `make proto`). Compiling with
the repository root on the include path makes the generated stub import
`from proto import tierkv_pb2`, so the modules work as a package without path tricks.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "proto/tierkv.proto"
OUTPUTS = ("tierkv_pb2.py", "tierkv_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Compile SOURCE into out_root/proto/; returns the generated files."""
    from grpc_tools import protoc

    (out_root / "proto").mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--grpc_python_out={out_root}",
            str(ROOT / SOURCE)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {SOURCE}")
    return [out_root / "proto" / name for name in OUTPUTS]


def main() -> int:
    for path in generate(ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
