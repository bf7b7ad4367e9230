"""The scheduler driver against in-process fakes of gpu_dense and the shards (no process, no port)."""

from __future__ import annotations

import asyncio

from fastdecode.errors import InvalidInput, ServiceError, Unavailable
from fastdecode.geometry import KVGeometry
from fastdecode.sampling import SamplingParams
from fastdecode.scheduling import Request
from fastdecode.scheduling.driver import DEFAULT_BLOCK_SIZE, SchedulerDriver, capacity_tokens
from fastdecode.settings import SchedulerSettings
from tests.support.fakes import FakeDense, FakeShard

NAN_TEMPERATURE = SamplingParams(temperature=float("nan"))
SETTINGS = SchedulerSettings(dense="fake:1", shards="fake:2,fake:3", health_interval=0.01)


def driver_with(*shards: FakeShard, dense: FakeDense | None = None) -> SchedulerDriver:
    dense = dense or FakeDense()
    return SchedulerDriver(SETTINGS, dense, list(shards))


async def _collect(driver: SchedulerDriver, req: Request) -> list[int]:
    return [t async for ev in driver.generate(req) for t in ev.token_ids]


def test_health_loop_survives_a_shard_that_passes_health_then_fails_stats() -> None:
    """The bug: health SERVING, then Stats raising, killed the loop (and with it the scheduler)."""

    async def main() -> None:
        flaky = FakeShard("fake:3")
        driver = driver_with(FakeShard("fake:2"), flaky)
        await driver.connect()
        assert driver.core is not None
        flaky.serving = False
        await driver.probe_shards()
        assert not driver.shards[1].healthy  # lost
        flaky.serving, flaky.stats_error = True, Unavailable("Stats refused")
        loop = asyncio.create_task(driver.health_loop())
        calls = flaky.stats_calls
        while flaky.stats_calls < calls + 3:  # several probes see SERVING, then a failing Stats
            await asyncio.sleep(0.01)
            assert not loop.done(), loop.exception()
        assert not driver.shards[1].healthy  # still lost: it could not say it is empty
        flaky.stats_error = None
        while not driver.shards[1].healthy:
            await asyncio.sleep(0.01)
            assert not loop.done(), loop.exception()
        assert driver.core.stats()["shards"][1]["healthy"]
        loop.cancel()

    asyncio.run(main())


def test_block_size_comes_from_the_shards() -> None:
    geometry = FakeDense().info_.geometry
    per_token = geometry.bytes_per_token(4)
    big_blocks = FakeShard("fake:2", block_size=48, bytes_capacity=1000 * per_token)
    default = FakeShard("fake:3", block_size=0, bytes_capacity=1000 * per_token)  # says nothing

    async def main() -> list[int]:
        driver = driver_with(big_blocks, default)
        await driver.connect()
        assert driver.core is not None
        return [s["capacity_tokens"] for s in driver.core.stats()["shards"]]

    capacities = asyncio.run(main())
    assert capacities == [
        1000 // 48 * 48 - 48,
        1000 // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE - DEFAULT_BLOCK_SIZE,
    ]
    assert capacities == [912, 976]  # 48-token blocks leave fewer tokens than the default 16


def test_capacity_of_a_configured_shard_is_what_it_reports() -> None:
    from fastdecode.scheduling.driver import ShardState

    st = ShardState(1, True, 300, 200, 1 << 30, 4, 16, 0.0, 0.0)
    assert capacity_tokens(st, KVGeometry(2, 2, 8)) == 500


def test_generate_streams_tokens_and_validates_at_the_edge() -> None:
    async def main() -> None:
        driver = driver_with(FakeShard("fake:2"), FakeShard("fake:3"))
        await driver.connect()
        loop = asyncio.create_task(driver.step_loop())
        try:
            assert await _collect(driver, Request("a", [5, 6, 7], max_tokens=4)) == [1, 2, 3, 4]
            for bad in (
                Request("v", [5, 100], max_tokens=2),  # outside the vocabulary of 100
                Request("t", [5], max_tokens=2, sampling=NAN_TEMPERATURE),
            ):
                try:
                    await _collect(driver, bad)
                except InvalidInput:
                    continue
                raise AssertionError(f"{bad.seq_id} was accepted")
        finally:
            loop.cancel()

    asyncio.run(main())


def test_a_shard_lost_mid_step_costs_time_not_requests() -> None:
    async def main() -> None:
        dense = FakeDense()
        shards = [FakeShard("fake:2"), FakeShard("fake:3")]
        driver = driver_with(*shards, dense=dense)
        await driver.connect()
        dense.fail_items = {0: Unavailable("attend stream to shard 0 lost")}
        shards[0].serving = False
        loop = asyncio.create_task(driver.step_loop())
        try:
            outs = await asyncio.gather(
                *(_collect(driver, Request(f"r{i}", [3, 4], max_tokens=3)) for i in range(4))
            )
        finally:
            loop.cancel()
        assert outs == [[1, 2, 3]] * 4
        assert not driver.shards[0].healthy

    asyncio.run(main())


def test_a_failed_item_ends_its_request_with_a_typed_error() -> None:
    async def main() -> ServiceError:
        dense = FakeDense(fail_items={0: InvalidInput("bad plan item"), 1: InvalidInput("bad plan item")})
        driver = driver_with(FakeShard("fake:2"), FakeShard("fake:3"), dense=dense)
        await driver.connect()
        loop = asyncio.create_task(driver.step_loop())
        try:
            await _collect(driver, Request("x", [3], max_tokens=2))
        except ServiceError as e:
            return e
        finally:
            loop.cancel()
        raise AssertionError("no error")

    err = asyncio.run(main())
    assert type(err) is InvalidInput and err.message == "bad plan item"
