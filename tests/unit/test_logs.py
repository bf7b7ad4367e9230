"""Structured logs: text and JSON formats carry the service and the request id of the running task."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from fastdecode.runtime.logs import bind_request_id, configure_logging, request_context


@pytest.fixture
def capture() -> Iterator[io.StringIO]:
    yield io.StringIO()
    logging.basicConfig(force=True, handlers=[logging.NullHandler()])  # leave no handler behind


def _redirect(buf: io.StringIO) -> None:
    for h in logging.getLogger().handlers:
        assert isinstance(h, logging.StreamHandler)
        h.setStream(buf)


def test_json_lines_name_service_and_request(capture: io.StringIO) -> None:
    log = configure_logging("scheduler", "INFO", json_logs=True)
    _redirect(capture)
    with request_context("req-1"):
        log.info("queued: %d prompt tokens", 5)
    log.info("per sequence", extra={"request_id": "req-2", "tokens": 3})
    log.debug("below the level")
    first, second = (json.loads(line) for line in capture.getvalue().splitlines())
    assert first == {
        "time": first["time"],
        "level": "INFO",
        "service": "scheduler",
        "logger": "fastdecode.scheduler",
        "request_id": "req-1",
        "message": "queued: 5 prompt tokens",
    }
    assert second["request_id"] == "req-2" and second["tokens"] == 3


def test_text_lines_tag_the_request(capture: io.StringIO) -> None:
    log = configure_logging("gateway", "INFO", json_logs=False)
    _redirect(capture)
    with request_context("abc"):
        log.warning("slow")
    log.info("no request")
    tagged, plain = capture.getvalue().splitlines()
    assert " gateway WARNING fastdecode.gateway [abc]: slow" in tagged
    assert plain.endswith(" gateway INFO fastdecode.gateway: no request")


def test_request_ids_do_not_leak_between_concurrent_tasks(capture: io.StringIO) -> None:
    log = configure_logging("gateway", "INFO", json_logs=True)
    _redirect(capture)

    async def handler(rid: str) -> None:
        bind_request_id(rid)
        for _ in range(3):
            await asyncio.sleep(0)
            log.info("step of %s", rid)

    async def main() -> None:
        await asyncio.gather(*(handler(f"r{i}") for i in range(4)))

    asyncio.run(main())
    records = [json.loads(line) for line in capture.getvalue().splitlines()]
    assert len(records) == 12
    assert all(r["message"] == f"step of {r['request_id']}" for r in records)
