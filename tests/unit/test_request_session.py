"""A session of many requests on the scheduler driver, against in-process fakes of gpu_dense and the
shards (no process, no port): one batch per step for all of its requests, per-request errors that
leave the session running, cancels and the session's end freeing KV."""

from __future__ import annotations

import asyncio

from fastdecode.contract import SamplingParams
from fastdecode.runtime.errors import InvalidInput, NotFound, ServiceError, Unavailable
from fastdecode.runtime.settings import SchedulerSettings
from fastdecode.scheduling import Request, Step
from fastdecode.scheduling.driver import SchedulerDriver
from fastdecode.scheduling.ports import StepOutcome
from fastdecode.scheduling.session import Batch, RequestSession
from fastdecode.scheduling.types import TokenEvent
from tests.support.fakes import FakeDense, FakeShard

SETTINGS = SchedulerSettings(dense="fake:1", shards="fake:2,fake:3", health_interval=0.01)


class PacedDense(FakeDense):
    """A step takes time, as gpu_dense's does: the step loop waits on it (FakeDense answers at once,
    so its steps would run back to back without the session's writer ever running between them)."""

    async def run(self, step: Step, pipeline: bool) -> StepOutcome:
        await asyncio.sleep(0.001)
        return await super().run(step, pipeline)


async def _running(
    *shards: FakeShard, dense: FakeDense | None = None
) -> tuple[SchedulerDriver, asyncio.Task]:
    driver = SchedulerDriver(
        SETTINGS, dense or PacedDense(), list(shards or (FakeShard("fake:2"), FakeShard("fake:3")))
    )
    await driver.connect()
    return driver, asyncio.create_task(driver.step_loop())


async def _drain(session: RequestSession, batches: list[Batch]) -> None:
    while (batch := await session.next_batch()) is not None:
        batches.append(batch)


def _tokens(batches: list[Batch]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for batch in batches:
        for sid, item in batch:
            if isinstance(item, TokenEvent):
                out.setdefault(sid, []).extend(item.token_ids)
    return out


def test_a_steps_events_for_every_request_of_the_session_are_one_batch() -> None:
    async def main() -> tuple[list[Batch], dict[str, list[int]], int]:
        driver, loop = await _running()
        reference = [t async for ev in driver.generate(Request("alone", [1, 2, 3], 6)) for t in ev.token_ids]
        session = RequestSession(driver)
        for i, n in enumerate([6, 9, 12]):
            session.submit(Request(f"r{i}", [1, 2, 3 + i], n))
        session.end_input()  # the session ends once its requests have
        batches: list[Batch] = []
        await asyncio.wait_for(_drain(session, batches), 10)
        loop.cancel()
        return batches, {"alone": reference}, len(driver.streams)

    batches, reference, left = asyncio.run(main())
    tokens = _tokens(batches)
    assert {sid: len(t) for sid, t in tokens.items()} == {"r0": 6, "r1": 9, "r2": 12}
    assert tokens["r0"] == reference["alone"]  # FakeDense samples 1 + sample index: same as a Submit
    steps = [item.step for b in batches for _, item in b if isinstance(item, TokenEvent)]
    assert steps == sorted(steps)  # in step order
    batch_of_step: dict[int, set[int]] = {}
    for i, batch in enumerate(batches):
        for _, item in batch:
            if isinstance(item, TokenEvent):
                batch_of_step.setdefault(item.step, set()).add(i)
    assert all(len(b) == 1 for b in batch_of_step.values())  # a step's events are never split
    assert len(batches) <= len(set(steps))  # one batch per loop turn, not per event
    assert max(len({sid for sid, _ in b}) for b in batches) == 3  # one batch carried all three
    assert left == 0


def test_a_requests_errors_are_in_band_and_the_session_goes_on() -> None:
    async def main() -> tuple[list[Batch], dict[str, int]]:
        shard = FakeShard("fake:2")
        driver, loop = await _running(shard, FakeShard("fake:3"))
        session = RequestSession(driver)
        session.submit(Request("ok", [1, 2, 3], 20))
        session.submit(Request("ok", [1, 2, 3], 5))  # duplicate id: that submit fails, "ok" runs on
        session.submit(Request("", [1, 2], 5))  # no id
        session.submit(Request("nan", [1, 2], 5, sampling=SamplingParams(temperature=float("nan"))))
        session.submit(Request("empty", [], 5))
        session.cancel("never-submitted")
        session.end_input()
        batches: list[Batch] = []
        await asyncio.wait_for(_drain(session, batches), 10)
        loop.cancel()
        return batches, dict(shard.held)

    batches, held = asyncio.run(main())
    errors: dict[str, list[ServiceError]] = {}
    for batch in batches:
        for sid, item in batch:
            if isinstance(item, ServiceError):
                errors.setdefault(sid, []).append(item)
    assert isinstance(errors["ok"][0], InvalidInput) and "already running" in errors["ok"][0].message
    assert len(errors["ok"]) == 1  # only the duplicate submit failed
    assert isinstance(errors[""][0], InvalidInput)
    assert isinstance(errors["nan"][0], InvalidInput)
    assert isinstance(errors["empty"][0], InvalidInput)
    assert isinstance(errors["never-submitted"][0], NotFound)
    assert len(_tokens(batches)["ok"]) == 20  # the good request finished on the same session
    assert held == {}


def test_cancel_and_the_sessions_end_free_the_kv() -> None:
    async def main() -> tuple[list[str], list[str], dict[str, int], list[Batch]]:
        shards = FakeShard("fake:2"), FakeShard("fake:3")
        driver, loop = await _running(*shards)
        session = RequestSession(driver)
        for sid in ("a", "b", "c"):
            session.submit(Request(sid, [1, 2, 3], 400))
        batches: list[Batch] = []
        while sum(1 for b in batches for _ in b) < 9:  # a few steps in: every sequence holds KV
            batch = await asyncio.wait_for(session.next_batch(), 10)
            assert batch is not None
            batches.append(batch)
        held = sorted(sid for s in shards for sid in s.held)
        session.cancel("a")
        for _ in range(20):
            await asyncio.sleep(0.01)
        after_cancel = sorted(sid for s in shards for sid in s.held)
        session.close()  # the call ended (the gateway went away): the rest is cancelled
        for _ in range(20):
            await asyncio.sleep(0.01)
        left = {sid: n for s in shards for sid, n in s.held.items()}
        later = session.pending
        loop.cancel()
        return held, after_cancel, left, [later]

    held, after_cancel, left, (later,) = asyncio.run(main())
    assert held == ["a", "b", "c"]
    assert after_cancel == ["b", "c"]
    assert left == {}
    assert all(sid != "a" for sid, _ in later)  # nothing more for a cancelled request


def test_the_drains_cut_off_ends_the_sessions_requests_in_band() -> None:
    async def main() -> list[Batch]:
        driver, loop = await _running()
        session = RequestSession(driver)
        session.submit(Request("x", [1, 2, 3], 400))
        assert await session.next_batch()
        driver.cut_off()
        session.end_input()
        batches: list[Batch] = []
        await asyncio.wait_for(_drain(session, batches), 10)
        loop.cancel()
        return batches

    last = asyncio.run(main())[-1][-1]
    assert last[0] == "x" and isinstance(last[1], Unavailable)
