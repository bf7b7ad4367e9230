"""Regenerate the Python gRPC stubs (with .pyi) from protos/ into fastdecode/v1/.

Run `python -m fastdecode.tools.codegen` (or `make protos`). Generated files are never
edited by hand; tests/unit/test_codegen.py fails when they drift from protos/.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "fastdecode" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into out_dir (which receives fastdecode/v1/*_pb2*.py[i])."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "fastdecode" / "v1").glob("*_pb2*"))


def main() -> int:
    generated = generate(REPO)
    init = REPO / "fastdecode" / "v1" / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf/gRPC stubs for fastdecode.v1 (see protos/)."""\n')
    for path in generated:
        print(path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
