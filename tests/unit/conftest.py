"""The unit tier starts no process and opens no port: every test here runs (setup, call and teardown,
so module- and session-scoped fixtures made for it too) under a guard that fails it the moment it
tries. Tests that need either belong in tests/integration or tests/e2e."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.support.guards import GUARDED, refuse


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    with pytest.MonkeyPatch.context() as mp:
        for owner, name in GUARDED:
            if hasattr(owner, name):
                mp.setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
        return (yield)
