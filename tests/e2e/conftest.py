"""One fleet started with `fastdecode up` (2 shards, auth on), shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from fastdecode.fleet import UpProcess
from tests_support import TOKEN, start_up


@pytest.fixture(scope="session")
def fleet(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    f = start_up(
        model_factory("llama"), tmp_path_factory.mktemp("fleet"), env={"FASTDECODE_AUTH_TOKEN": TOKEN}
    )
    yield f
    f.stop()
