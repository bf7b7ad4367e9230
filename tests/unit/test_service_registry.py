"""The entry points through which fastdecode's tools reach the service adapters (pyproject.toml,
fastdecode/runtime/serving.py): every `fastdecode serve` command has its service, every target loads, and
the installed metadata says what pyproject.toml says (a stale install is reported, not guessed)."""

from __future__ import annotations

import importlib
import inspect
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from fastdecode.cli.serve import serve
from fastdecode.runtime.errors import FailedPrecondition
from fastdecode.runtime.serving import SERVICES, SHARD_PLANES, registered

REPO = Path(__file__).resolve().parents[2]


def declared(group: str) -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["entry-points"][group]


def load(target: str) -> object:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_every_serve_command_has_a_registered_service() -> None:
    services = declared(SERVICES)
    assert set(services) == set(serve.commands)
    for name, target in services.items():
        fn = load(target)
        assert inspect.iscoroutinefunction(fn) and fn.__name__ == "serve", name
        assert target.startswith(f"services.{name.replace('-', '_')}."), target


def test_the_shard_plane_is_gpu_denses_links() -> None:
    from services.gpu_dense.exchange.connect import connect
    from services.gpu_dense.exchange.links import ShardLinks

    assert load(declared(SHARD_PLANES)["grpc"]) is connect
    # in process, or the same links in exchange worker processes (services/gpu_dense/exchange/plane.py)
    assert inspect.signature(connect).return_annotation in (ShardLinks, "ShardLinks | ExchangePlane")


@pytest.mark.parametrize("group", [SERVICES, SHARD_PLANES])
def test_the_installed_metadata_matches_pyproject(group: str) -> None:
    installed = {ep.name: ep.value for ep in entry_points(group=group)}
    assert installed == declared(group), "stale install: reinstall the project (pip install -e .)"
    for name in installed:
        assert registered(group, name) is load(installed[name])


def test_an_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(FailedPrecondition, match="nothing is registered as 'nope'.*pip install -e"):
        registered(SERVICES, "nope")
