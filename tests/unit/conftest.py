"""The unit tier starts no process and opens no port: every test here runs (setup, call and teardown,
so module- and session-scoped fixtures made for it too) under a guard that fails it the moment it
tries. Tests that need either belong in tests/integration or tests/e2e."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

from tests.support.guards import GUARDED, refuse

UNIT_DIR = Path(__file__).resolve().parent


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    # pytest calls this hook for every test of the session, not only for this directory's.
    if UNIT_DIR not in Path(item.path).resolve().parents:
        return (yield)
    with pytest.MonkeyPatch.context() as mp:
        for owner, name in GUARDED:
            if hasattr(owner, name):
                mp.setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
        return (yield)
