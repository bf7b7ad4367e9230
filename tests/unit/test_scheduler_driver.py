"""The scheduler driver against in-process fakes of gpu_dense and the shards (no process, no port)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from fastdecode.contract import SamplingParams
from fastdecode.runtime.errors import InvalidInput, ServiceError, Unavailable
from fastdecode.runtime.geometry import KVGeometry
from fastdecode.runtime.settings import SchedulerSettings
from fastdecode.scheduling import Request
from fastdecode.scheduling.driver import SchedulerDriver
from fastdecode.scheduling.ports import DEFAULT_BLOCK_SIZE, StepOutcome, StepTimes, capacity_tokens
from fastdecode.scheduling.types import Step
from fastdecode.spec.controller import DECIDE_EVERY
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
        assert driver.core.stats().shards[1].healthy
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
        return [s.capacity_tokens for s in driver.core.stats().shards]

    capacities = asyncio.run(main())
    assert capacities == [
        1000 // 48 * 48 - 48,
        1000 // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE - DEFAULT_BLOCK_SIZE,
    ]
    assert capacities == [912, 976]  # 48-token blocks leave fewer tokens than the default 16


def test_capacity_of_a_configured_shard_is_what_it_reports() -> None:
    from fastdecode.scheduling.ports import ShardState

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


def test_a_lost_gpu_dense_pauses_requests_and_they_resume_where_they_were() -> None:
    """gpu_dense dies mid-run: no request fails; the lost step is planned again once it is back, and
    every request's tokens are those of a fault-free run (FakeDense samples 1 + sample_index)."""

    async def main() -> None:
        dense = FakeDense(dies_after=3)
        driver = driver_with(FakeShard("fake:2"), FakeShard("fake:3"), dense=dense)
        await driver.connect()
        assert driver.not_ready_reason() is None
        loop = asyncio.create_task(driver.step_loop())
        try:
            runs = [
                asyncio.create_task(_collect(driver, Request(f"r{i}", [3, 4], max_tokens=6)))
                for i in range(4)
            ]
            while not dense.down:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)  # down for a while: the loop retries with backoff
            assert dense.lost_steps == 1  # the failed step was not re-sent to a dead gpu_dense
            reason = driver.not_ready_reason()
            assert reason is not None and "gpu_dense" in reason
            assert not any(r.done() for r in runs)  # paused, not failed
            dense.down = False
            outs = await asyncio.wait_for(asyncio.gather(*runs), 10)
        finally:
            loop.cancel()
        assert outs == [[1, 2, 3, 4, 5, 6]] * 4
        assert driver.not_ready_reason() is None
        # The re-planned step starts where the lost one did.
        assert all(p.start_pos in (0, 2, 3, 4, 5, 6, 7) for st in dense.steps for p in st.seqs)

    asyncio.run(main())


def test_a_restarted_gpu_dense_gets_the_shards_added_at_run_time_again() -> None:
    async def main() -> None:
        dense = FakeDense()
        driver = driver_with(FakeShard("fake:2"), FakeShard("fake:3"), dense=dense)
        await driver.connect()
        await driver.add_shard("fake:4", lambda a: FakeShard(a))
        assert dense.info_.num_shards == 3
        dense.info_ = FakeDense().info_  # a fresh process knows only its --shards (2)
        dense.dies_after = len(dense.steps)
        loop = asyncio.create_task(driver.step_loop())
        try:
            run = asyncio.create_task(_collect(driver, Request("a", [3, 4], max_tokens=3)))
            while not dense.down:
                await asyncio.sleep(0.005)
            dense.down = False
            assert await asyncio.wait_for(run, 10) == [1, 2, 3]
        finally:
            loop.cancel()
        assert dense.info_.num_shards == 3  # registered again, so shard 2 means the same shard

    asyncio.run(main())


def test_shards_lost_to_a_failed_stream_come_back_and_requests_complete() -> None:
    """Every shard's stream fails for one step while the shard processes stay up holding their
    sequences (gpu_dense saw this when a scheduler died mid-step): the health loop frees what they
    hold and takes them back, and every request completes instead of waiting for a shard forever."""

    async def main() -> None:
        dense = FakeDense()
        shards = [FakeShard("fake:2"), FakeShard("fake:3")]
        driver = driver_with(*shards, dense=dense)
        await driver.connect()
        dense.fail_items = {0: Unavailable("stream lost"), 1: Unavailable("stream lost")}

        async def transient() -> None:
            while not dense.steps:
                await asyncio.sleep(0.001)
            dense.fail_items = {}

        tasks = [asyncio.create_task(t) for t in (driver.step_loop(), driver.health_loop(), transient())]
        try:
            reqs = [_collect(driver, Request(f"r{i}", [3, 4], max_tokens=3)) for i in range(4)]
            outs = await asyncio.wait_for(asyncio.gather(*reqs), 10)
        finally:
            for t in tasks:
                t.cancel()
        assert outs == [[1, 2, 3]] * 4
        assert all(track.healthy for track in driver.shards)

    asyncio.run(main())


def test_a_shard_back_after_a_loss_starts_at_a_neutral_speed() -> None:
    """A shard measured slow, then lost and back (a restarted process): its old speed would keep
    placement away from it; it starts at 1.0 again until it is measured anew."""

    async def main() -> None:
        shards = [FakeShard("fake:2"), FakeShard("fake:3")]
        driver = driver_with(*shards)
        await driver.connect()
        assert driver.core is not None
        driver.core.set_speed(1, 0.05)
        driver.shards[1].r = 20.0
        driver._shard_lost(1, "killed")
        await driver.probe_shards()
        assert driver.shards[1].healthy
        assert driver.core._shards[1].spec.speed == 1.0 and driver.shards[1].r is None

    asyncio.run(main())


def test_not_ready_without_a_healthy_shard() -> None:
    async def main() -> None:
        shards = [FakeShard("fake:2"), FakeShard("fake:3")]
        driver = driver_with(*shards)
        assert driver.not_ready_reason() == "scheduler is starting"
        await driver.connect()
        assert driver.not_ready_reason() is None
        shards[0].serving = False
        await driver.probe_shards()
        assert driver.not_ready_reason() is None  # one shard is enough
        shards[1].serving = False
        await driver.probe_shards()
        assert driver.not_ready_reason() == "no healthy kv_attention shard"
        shards[1].serving = True
        await driver.probe_shards()
        assert driver.not_ready_reason() is None

    asyncio.run(main())


def test_a_restarted_scheduler_adopts_the_shards_gpu_dense_gained_at_run_time() -> None:
    async def main() -> None:
        dense = FakeDense()
        await dense.add_shard("fake:4", 1.0)  # added through the scheduler that died
        made: list[str] = []

        def link(address: str) -> FakeShard:
            made.append(address)
            return FakeShard(address)

        driver = SchedulerDriver(
            SETTINGS, dense, [FakeShard("fake:2"), FakeShard("fake:3")], make_shard_link=link
        )
        await driver.connect()
        assert made == ["fake:4"] and [t.link.address for t in driver.shards] == [
            "fake:2",
            "fake:3",
            "fake:4",
        ]
        assert driver.core is not None and driver.core.num_shards == 3
        # Without a way to reach it, the mismatch is refused as before.
        with pytest.raises(InvalidInput, match="3 shards"):
            await SchedulerDriver(SETTINGS, dense, [FakeShard("fake:2"), FakeShard("fake:3")]).connect()

    asyncio.run(main())


def test_a_shard_that_refuses_reservations_is_its_fault_not_a_loop(caplog: pytest.LogCaptureFixture) -> None:
    """One shard answers every Reserve with INVALID_ARGUMENT (a geometry it should not hold): it is
    marked lost, requests complete on the other one, it is asked again after a doubling wait rather
    than every step, and the log says so a few times, not once per step."""

    async def main() -> tuple[int, int]:
        bad = FakeShard("fake:2", reserve_error=InvalidInput("holds KV of another geometry"))
        good = FakeShard("fake:3")
        driver = driver_with(bad, good)
        await driver.connect()
        tasks = [asyncio.create_task(t) for t in (driver.step_loop(), driver.health_loop())]
        done = 0
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + 0.5  # 50 health intervals of steady load
            while loop.time() < end:
                reqs = [_collect(driver, Request(f"r{done}-{i}", [3, 4], max_tokens=3)) for i in range(2)]
                assert await asyncio.wait_for(asyncio.gather(*reqs), 10) == [[1, 2, 3]] * 2
                done += 2
        finally:
            for t in tasks:
                t.cancel()
        return done, bad.reserve_calls

    with caplog.at_level("WARNING", logger="fastdecode"):
        done, calls = asyncio.run(main())
    assert done >= 10
    assert 1 <= calls <= 7, calls  # waits 0.02, 0.04, 0.08, 0.16, 0.32 s: a handful in 0.5 s
    lost = [r for r in caplog.records if "refused a reservation" in r.getMessage()]
    assert len(lost) == calls


def test_a_gpu_dense_that_stays_down_fails_requests_within_the_bound_and_refuses_new_ones() -> None:
    """Past dense_down_timeout every paused request ends UNAVAILABLE naming gpu_dense, new ones are
    refused at once (admission), readiness says why; once gpu_dense is back, requests run again."""
    from fastdecode.runtime.errors import DependencyDown

    settings = SETTINGS.model_copy(update={"dense_down_timeout": 0.3})

    async def main() -> None:
        dense = FakeDense(dies_after=2)
        driver = SchedulerDriver(settings, dense, [FakeShard("fake:2"), FakeShard("fake:3")])
        await driver.connect()
        loop = asyncio.create_task(driver.step_loop())
        try:
            t0 = asyncio.get_running_loop().time()
            runs = [_collect(driver, Request(f"r{i}", [3, 4], max_tokens=50)) for i in range(3)]
            outs = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 5)
            took = asyncio.get_running_loop().time() - t0
            assert all(isinstance(o, DependencyDown) and "gpu_dense" in o.message for o in outs), outs
            assert 0.3 <= took < 2.5, took
            t1 = asyncio.get_running_loop().time()
            with pytest.raises(DependencyDown, match="gpu_dense"):
                await _collect(driver, Request("late", [3, 4], max_tokens=3))
            assert asyncio.get_running_loop().time() - t1 < 0.1  # refused, not queued
            assert "gpu_dense" in (driver.not_ready_reason() or "")
            dense.down = False
            for _ in range(200):
                if driver.dense_dead is None:
                    break
                await asyncio.sleep(0.02)
            assert await _collect(driver, Request("after", [3, 4], max_tokens=3)) == [1, 2, 3]
        finally:
            loop.cancel()

    asyncio.run(main())


MANY = 200  # tokens each request of the shard-loss tests asks for: still decoding when the shard goes


@pytest.mark.parametrize("pool_survives", [True, False])
def test_a_persistent_shard_lost_mid_step_is_waited_for_and_resumes_its_sequences(
    pool_survives: bool,
) -> None:
    """A shard whose KV pool outlives its process: its sequences wait (unplanned, not re-prefilled)
    and resume on it once it answers again and re-attaches; with its pool lost they are re-prefilled."""

    async def main() -> tuple[list[list[int]], SchedulerDriver, FakeShard]:
        dense = FakeDense()
        shards = [FakeShard("fake:2", persistent=True), FakeShard("fake:3", persistent=True)]
        shards[0].lose_pool = not pool_survives
        driver = driver_with(*shards, dense=dense)
        await driver.connect()
        loop = asyncio.create_task(driver.step_loop())
        probes = asyncio.create_task(driver.health_loop())

        async def crash_and_restart() -> None:
            while len(dense.steps) < 2 or not driver.core.seqs_on(0):  # type: ignore[union-attr]
                await asyncio.sleep(0.001)  # decoding, some of it on shard 0
            dense.fail_items = {0: Unavailable("attend stream to shard 0 lost")}
            shards[0].serving = False
            while not driver.shards[0].suspended_at:
                await asyncio.sleep(0.001)
            held = driver.core.seqs_on(0) if driver.core else []
            steps = len(dense.steps)
            await asyncio.sleep(0.05)  # steps go on without it; its sequences are not planned
            assert not any(p.shard == 0 for s in dense.steps[steps:] for p in s.seqs)
            assert held and all(driver.core.shard_of(sid) == 0 for sid in held)  # type: ignore[union-attr]
            dense.fail_items = {}
            shards[0].serving = True  # the restarted process, its pool re-attached

        try:
            outs = await asyncio.wait_for(  # a failure, never a hang
                asyncio.gather(
                    # long enough that shard 0's sequences still run when its loss is seen, however
                    # slow the host (at 12 they had all finished once on a loaded one: none was held)
                    *(_collect(driver, Request(f"r{i}", [3, 4], max_tokens=MANY)) for i in range(6)),
                    crash_and_restart(),
                ),
                60,
            )
        finally:
            loop.cancel()
            probes.cancel()
        return outs[:-1], driver, shards[0]

    outs, driver, shard = asyncio.run(main())
    assert outs == [list(range(1, MANY + 1))] * 6
    assert shard.reattach_calls and shard.reattach_calls[0]
    assert driver.core is not None and driver.shards[0].healthy
    recovered = driver.core.membership.recoveries
    assert recovered == 0 if pool_survives else recovered == len(shard.reattach_calls[0])


def test_a_persistent_shard_that_stays_down_past_the_grace_is_lost() -> None:
    async def main() -> tuple[list[list[int]], SchedulerDriver]:
        dense = FakeDense()
        shards = [FakeShard("fake:2", persistent=True), FakeShard("fake:3")]
        settings = SETTINGS.model_copy(update={"shard_restart_grace": 0.05})
        driver = SchedulerDriver(settings, dense, shards)
        await driver.connect()
        loop = asyncio.create_task(driver.step_loop())
        probes = asyncio.create_task(driver.health_loop())

        async def crash() -> None:
            while len(dense.steps) < 2 or not driver.core.seqs_on(0):  # type: ignore[union-attr]
                await asyncio.sleep(0.001)
            dense.fail_items = {0: Unavailable("attend stream to shard 0 lost")}
            shards[0].serving = False  # and it never comes back

        try:
            outs = await asyncio.wait_for(
                asyncio.gather(
                    *(_collect(driver, Request(f"r{i}", [3, 4], max_tokens=MANY)) for i in range(4)), crash()
                ),
                60,
            )
        finally:
            loop.cancel()
            probes.cancel()
        return list(outs[:-1]), driver

    outs, driver = asyncio.run(main())
    assert outs == [list(range(1, MANY + 1))] * 4
    assert driver.shards[0].suspended_at is None and not driver.shards[0].healthy
    assert driver.core is not None and driver.core.membership.recoveries > 0  # re-prefilled on shard 1


class _TimedDense(FakeDense):
    """gpu_dense that reports each step's timings, as the real one does."""

    async def run(self, step: Step, pipeline: bool) -> StepOutcome:
        out = await super().run(step, pipeline)
        return replace(out, timings=StepTimes(0.002, 0.001, 0.003))


@pytest.mark.parametrize(
    ("dense", "speculative_k"), [(_TimedDense, "auto"), (FakeDense, "auto"), (_TimedDense, "fixed")]
)
def test_each_steps_timings_reach_the_draft_controller(dense: type[FakeDense], speculative_k: str) -> None:
    settings = SETTINGS.model_copy(
        update={"speculative": "ngram", "plan_ahead": "off", "speculative_k": speculative_k}
    )

    async def main() -> None:
        driver = SchedulerDriver(settings, dense(), [FakeShard("fake:2"), FakeShard("fake:3")])
        await driver.connect()
        loop = asyncio.create_task(driver.step_loop())
        try:
            out = await _collect(driver, Request("a", [5, 6, 7, 5, 6, 7], max_tokens=2 * DECIDE_EVERY + 8))
            assert out == list(range(1, 2 * DECIDE_EVERY + 9))
        finally:
            loop.cancel()
        assert driver.core is not None and driver.core.drafting is not None
        control = driver.core.drafting.control
        timed = dense is _TimedDense and speculative_k == "auto"
        assert control.cost.ready == timed and (control.decisions >= 2) == timed
        assert driver.core.stats().spec_k == 3  # the sampled tokens never repeat: no draft found, none costs

    asyncio.run(main())
