"""Regenerate the committed Python modules from proto/*.proto (`make proto`).

The modules are committed so that no host needs grpcio-tools at run time;
tests/test_proto_generated.py fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Generate *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto under out_dir/proto."""
    sources = sorted(PROTO_DIR.glob("*.proto"))
    for source in sources:
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(source.relative_to(REPO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {source}")
    return sources


def main() -> None:
    for source in generate():
        print(f"generated modules for {source.relative_to(REPO_ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
