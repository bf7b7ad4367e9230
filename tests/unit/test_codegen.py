"""Generated stubs never drift from protos/: regenerate into a temp dir and compare."""

from pathlib import Path

from fastdecode.tools.codegen import REPO, generate


def test_stubs_match_protos(tmp_path: Path) -> None:
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in (REPO / "fastdecode" / "v1").glob("*_pb2*")}
    assert fresh.keys() == committed.keys(), "stub set differs: run `make protos`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stubs out of date with protos/: {stale}; run `make protos`"
