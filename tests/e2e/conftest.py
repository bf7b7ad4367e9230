"""One fleet started with `fastdecode up` (2 shards, auth on, JSON logs), shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from fastdecode.tools.fleet import UpProcess, free_port
from tests.support import TOKEN, start_up


@pytest.fixture(scope="session")
def fleet(model_factory: Callable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    f = start_up(
        model_factory("llama"),
        tmp_path_factory.mktemp("fleet"),
        "--log-json",  # tests/e2e/test_observability.py follows one request through the JSON logs
        "--http-port",  # the OpenAI-compatible HTTP API: tests/e2e/test_openai.py
        str(free_port()),
        env={"FASTDECODE_AUTH_TOKEN": TOKEN},
    )
    yield f
    f.stop()
