"""The scheduler's Session RPC and the gateway's link over it, on loopback: the real servicer, driver
and core (gpu_dense and the shards are in-process fakes behind the driver's ports), the real
GrpcSchedulerLink and GatewayCore. Many requests share one call, a step's events come in one
message, a request's failure stays its own, a cancel or deadline frees the KV, a restarted
scheduler is a SchedulerLost the gateway resubmits from, and the fleet secret guards the call."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import pytest

from fastdecode.gateway.core import GatewayCore, SchedulerLost, UpstreamEvent
from fastdecode.gateway.text import GenerateParams, ValidRequest
from fastdecode.model import ModelConfig
from fastdecode.runtime.errors import DeadlineExceeded, InternalError, InvalidInput, Status
from fastdecode.runtime.fleet_secret import FleetSecret
from fastdecode.runtime.rpc import Server
from fastdecode.runtime.settings import GatewaySettings, SchedulerSettings, TLSFiles
from fastdecode.runtime.tokenizer import Tokenizer
from fastdecode.scheduling import Step
from fastdecode.scheduling.driver import SchedulerDriver
from fastdecode.scheduling.ports import StepOutcome
from fastdecode.v1 import scheduler_pb2 as pb
from fastdecode.v1 import scheduler_pb2_grpc as pb_grpc
from services.gateway.scheduler_link import GrpcSchedulerLink
from services.scheduler.server import SchedulerServicer
from tests.support.fakes import FakeDense, FakeShard

SECRET = FleetSecret.parse("s" * 40, "test")


class PacedDense(FakeDense):
    """Each step takes a millisecond, as a real one takes time (the loop yields between steps)."""

    async def run(self, step: Step, pipeline: bool) -> StepOutcome:
        await asyncio.sleep(0.001)
        return await super().run(step, pipeline)


class Scheduler:
    """A scheduler service on 127.0.0.1: its gRPC server, servicer and step loop."""

    def __init__(self, port: int = 0, tls: TLSFiles | None = None) -> None:
        self.settings = SchedulerSettings(
            dense="fake:1", shards="fake:2,fake:3", host="127.0.0.1", port=port, health_interval=0.01
        )
        self.shards = [FakeShard("fake:2"), FakeShard("fake:3")]
        self.shards[0].peers, self.shards[1].peers = {"fake:3": self.shards[1]}, {"fake:2": self.shards[0]}
        self.tls = tls

    async def __aenter__(self) -> Scheduler:
        self.service = SchedulerServicer(self.settings)
        self.service.driver = SchedulerDriver(self.settings, PacedDense(), self.shards)
        self.server = Server(["fastdecode.v1.Scheduler"], "127.0.0.1", self.settings.port, self.tls, 1.0)
        pb_grpc.add_SchedulerServicer_to_server(self.service, self.server.server)
        await self.server.start()
        await self.service.driver.connect()
        self.loop = asyncio.create_task(self.service.driver.step_loop())
        self.address = f"127.0.0.1:{self.server.port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    async def kill(self) -> None:
        """Gone at once, as a process killed with -9 (no drain, no status for what runs)."""
        self.loop.cancel()
        await self.server.server.stop(0)
        # the servicer's own links (replaced by fakes): an aio channel left to the garbage collector
        # shuts grpc's aio poller down from there, and that join hung the next test
        await self.service.close()

    def held(self) -> dict[str, int]:
        return {sid: n for s in self.shards for sid, n in s.held.items()}

    async def until_no_kv(self, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while self.held():
                await asyncio.sleep(0.01)


def _request(prompt: list[int], n: int, temperature: float = 0.0) -> ValidRequest:
    return ValidRequest(prompt, n, temperature, 1.0, 0, None, (), (), True)


async def _tokens(events: AsyncIterator) -> list[int]:
    return [t async for ev in events for t in ev.token_ids]


def test_many_requests_share_one_call_and_a_step_is_one_message() -> None:
    async def main() -> None:
        async with Scheduler() as s:
            link = GrpcSchedulerLink(s.address, None)
            runs = [link.submit(f"r{i}", _request([1, 2, 3 + i], 8 + 4 * i), 30) for i in range(4)]
            got = await asyncio.gather(*(_tokens(r) for r in runs))
            assert got == [list(range(1, 9 + 4 * i)) for i in range(4)]  # FakeDense: 1 + sample index
            assert link.session is not None and link.session.lost is None  # one call, still open
            await link.close()

            # The same, read off the wire: one message per step, at most one event per request.
            async with grpc.aio.insecure_channel(s.address) as ch:
                out: asyncio.Queue = asyncio.Queue()
                for i in range(3):
                    out.put_nowait(
                        pb.SessionRequest(
                            submit=pb.SubmitRequest(
                                request_id=f"w{i}", prompt_token_ids=[1, 2], max_tokens=10
                            )
                        )
                    )

                async def requests() -> AsyncIterator[pb.SessionRequest]:
                    while (m := await out.get()) is not None:
                        yield m

                call = pb_grpc.SchedulerStub(ch).Session(requests())
                done: set[str] = set()
                steps: list[int] = []  # of every event, in arrival order
                messages = widest = 0
                async for msg in call:
                    messages += 1
                    steps += sorted([e.token.step for e in msg.events] + list(msg.plain_steps))
                    ids = {e.request_id for e in msg.events} | set(msg.plain_request_ids)
                    widest = max(widest, len(ids))
                    done |= {e.request_id for e in msg.events if e.token.finish_reason}
                    # a request is in the plain columns or in the events, never both
                    assert not {e.request_id for e in msg.events} & set(msg.plain_request_ids)
                    if done == {"w0", "w1", "w2"}:
                        out.put_nowait(None)  # half-close: the call ends once its requests have
                assert steps == sorted(steps)  # in step order
                # one message per loop turn: a step (or, planned ahead, two finished back to back)
                assert messages <= len(set(steps)) and widest == 3
                assert await call.code() == grpc.StatusCode.OK
            assert s.held() == {} and not s.service.driver.streams

    asyncio.run(main())


def test_a_requests_failure_is_its_own_and_bad_input_gets_a_clear_in_band_error() -> None:
    async def main() -> None:
        async with Scheduler() as s:
            link = GrpcSchedulerLink(s.address, None)
            good = asyncio.create_task(_tokens(link.submit("good", _request([1, 2], 30), 30)))
            with pytest.raises(InvalidInput, match="temperature"):
                await _tokens(link.submit("bad", _request([1, 2], 5, temperature=float("nan")), 30))
            with pytest.raises(InvalidInput, match="prompt"):
                await _tokens(link.submit("too-long", _request([1] * 600, 5), 30))
            assert await good == list(range(1, 31))
            await link.close()

            async with grpc.aio.insecure_channel(s.address) as ch:
                sub = pb.SubmitRequest(request_id="dup", prompt_token_ids=[1, 2], max_tokens=50)
                messages = [
                    pb.SessionRequest(submit=sub),
                    pb.SessionRequest(submit=sub),  # the same id again while it runs
                    pb.SessionRequest(submit=pb.SubmitRequest(prompt_token_ids=[1], max_tokens=2)),  # no id
                    pb.SessionRequest(submit=pb.SubmitRequest(request_id="empty", max_tokens=2)),
                    pb.SessionRequest(cancel=pb.CancelRequest(request_id="nobody")),
                    pb.SessionRequest(),  # neither kind
                ]
                call = pb_grpc.SchedulerStub(ch).Session(iter(messages))
                errors: dict[str, tuple[int, str]] = {}
                finished = False
                async for msg in call:
                    for e in msg.events:
                        if e.HasField("error"):
                            errors.setdefault(e.request_id, (e.error.code, e.error.message))
                        finished |= e.request_id == "dup" and bool(e.token.finish_reason)
                assert await call.code() == grpc.StatusCode.OK and finished  # "dup" ran to its end
                assert (
                    errors["dup"][0] == Status.INVALID_ARGUMENT.value
                    and "already running" in errors["dup"][1]
                )
                assert errors[""][0] == Status.INVALID_ARGUMENT.value
                assert errors["empty"][0] == Status.INVALID_ARGUMENT.value
                assert errors["nobody"] == (
                    Status.NOT_FOUND.value,
                    "request id 'nobody' is not running in this session",
                )

                # Bytes that are no SessionRequest: the peer speaks another protocol; the call ends.
                raw = ch.stream_stream("/fastdecode.v1.Scheduler/Session")(iter([b"\xff\xff\xff"]))
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    async for _ in raw:
                        pass
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert s.held() == {}
            # ...and the server goes on serving sessions.
            link = GrpcSchedulerLink(s.address, None)
            assert await _tokens(link.submit("after", _request([1, 2], 3), 30)) == [1, 2, 3]
            await link.close()

    asyncio.run(main())


def test_a_cancel_a_deadline_or_a_gone_gateway_frees_the_kv() -> None:
    async def main() -> None:
        async with Scheduler() as s:
            link = GrpcSchedulerLink(s.address, None)
            stays = link.submit("stays", _request([1, 2], 200), 30)
            first = await anext(stays)
            async with contextlib.aclosing(link.submit("closed", _request([1, 2], 400), 30)) as events:
                await anext(events)
                await anext(events)
                assert "closed" in s.held()
            # the early close cancelled it upstream
            async with asyncio.timeout(5):
                while "closed" in s.held():
                    await asyncio.sleep(0.01)

            with pytest.raises(DeadlineExceeded):
                await _tokens(link.submit("late", _request([1, 2], 400), 0.05))
            async with asyncio.timeout(5):
                while "late" in s.held():
                    await asyncio.sleep(0.01)
            # the session and the other request were untouched
            assert first.token_ids + await _tokens(stays) == list(range(1, 201))
            # The gateway goes away with requests running: the scheduler cancels them all.
            runs = [link.submit(f"g{i}", _request([1, 2], 400), 30) for i in range(3)]
            for r in runs:
                await anext(r)
            assert {"g0", "g1", "g2"} <= set(s.held())
            await link.close()
            await s.until_no_kv()
            assert not s.service.driver.streams

    asyncio.run(main())


def test_a_consumer_that_falls_behind_gets_what_waited_as_one_event() -> None:
    async def main() -> None:
        async with Scheduler() as s:
            link = GrpcSchedulerLink(s.address, None)
            events = link.submit("slow", _request([1, 2], 60), 30)
            got = [await anext(events)]
            await asyncio.sleep(0.1)  # ~1 ms steps: dozens of tokens wait meanwhile
            got += [ev async for ev in events]
            tokens = [t for ev in got for t in ev.token_ids]
            assert tokens == list(range(1, 61))  # every token once, in order
            assert max(len(ev.token_ids) for ev in got) > 1 and len(got) < 60
            assert all(len(ev.logprobs) == len(ev.token_ids) for ev in got)  # still per token
            assert [ev.finish_reason for ev in got] == [""] * (len(got) - 1) + ["length"]

            # A failure behind waiting tokens ends the request after them, not before.
            late = link.submit("late", _request([1, 2], 400), 0.05)
            first = await anext(late)
            await asyncio.sleep(0.15)  # the deadline passes with tokens waiting before it
            after = await anext(late)
            assert first.token_ids[0] == 1 and after.token_ids[0] == first.token_ids[-1] + 1
            assert len(after.token_ids) > 1
            with pytest.raises(DeadlineExceeded):
                await anext(late)
            await link.close()

    asyncio.run(main())


def test_a_stream_interval_sends_the_first_token_at_once_then_several_a_message() -> None:
    async def main() -> None:
        async with Scheduler() as s:
            link = GrpcSchedulerLink(s.address, None, stream_interval=4)
            got = [ev async for ev in link.submit("r", _request([1, 2], 30), 30)]
            assert [t for ev in got for t in ev.token_ids] == list(range(1, 31))
            assert all(len(ev.token_ids) >= 4 for ev in got[1:-1])  # the last: whatever was left
            assert got[-1].finish_reason == "length" and len(got) <= 1 + 29 // 4 + 1
            await link.close()
            # the first token is not held for the interval: with 64, the rest comes with the end
            link = GrpcSchedulerLink(s.address, None, stream_interval=64)
            got = [ev async for ev in link.submit("q", _request([1, 2], 30), 30)]
            assert len(got) == 2 and got[0].token_ids[0] == 1 and got[1].finish_reason == "length"
            assert got[0].token_ids + got[1].token_ids == list(range(1, 31))
            await link.close()

    asyncio.run(main())


def _serve_scheduler(conn: Connection) -> None:
    """A Scheduler in a process of its own (spawned), whose loop the test's blocking cannot hold."""

    async def main() -> None:
        async with Scheduler() as s:
            conn.send(s.address)
            await asyncio.to_thread(conn.recv)  # until told to stop

    asyncio.run(main())


def test_a_gateway_short_of_cpu_gets_several_steps_a_message() -> None:
    """The gateway's loop busy (as its CPU work holds it) while the scheduler steps on: what it cannot
    read waits in the Session's window, then the scheduler writes the steps it delivered meanwhile as
    one message, and each request gets them as one event. With the window gRPC's bandwidth probe
    grows, everything was buffered and went one token a message however far behind the gateway was."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve_scheduler, args=(there,), daemon=True)
    proc.start()
    try:
        assert here.poll(60), "the scheduler process did not start"
        address = here.recv()

        async def main() -> list[list[UpstreamEvent]]:
            link = GrpcSchedulerLink(address, None)

            async def consume(i: int, busy_s: float) -> list[UpstreamEvent]:
                got = []
                async for ev in link.submit(f"{'x' * 100}-{i}", _request([1, 2], 100), 60):
                    time.sleep(busy_s)  # the gateway's CPU per event, holding its loop as CPU work does
                    got.append(ev)
                return got

            # first at pace, as a gateway runs for a while before it falls behind (gRPC's probe, where
            # on, has grown the window by then)
            await asyncio.gather(*(consume(i, 0.0) for i in range(64)))
            runs = await asyncio.gather(*(consume(64 + i, 0.001) for i in range(64)))
            await link.close()
            return runs

        runs = asyncio.run(main())
        for got in runs:
            assert [t for ev in got for t in ev.token_ids] == list(range(1, 101))
            assert all(len(ev.logprobs) == len(ev.token_ids) for ev in got)
        # ~64 ms a turn of the gateway's loop while a step takes a few: once the window is full, each
        # message holds many steps (the probe-grown window: at most 2 tokens an event, measured)
        assert max(len(ev.token_ids) for got in runs for ev in got) >= 8
    finally:
        here.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_merged_events_keep_per_token_lists_aligned() -> None:
    a = UpstreamEvent([5, 6], "", [-0.1, -0.2], [], cached_tokens=4)
    b = UpstreamEvent([7], "stop", [-0.3], [((7, -0.3),)], cached_tokens=2)
    m = a.then(b)
    assert (m.token_ids, m.finish_reason, m.logprobs) == ([5, 6, 7], "stop", [-0.1, -0.2, -0.3])
    assert m.top == [(), (), ((7, -0.3),)] and m.cached_tokens == 4
    assert a.then(UpstreamEvent([8])).top == []  # none asked: none made up


def test_a_restarted_scheduler_is_lost_then_resubmitted_to(llama_dir: Path) -> None:
    async def main() -> None:
        first = Scheduler()
        await first.__aenter__()
        link = GrpcSchedulerLink(first.address, None)
        port = int(first.address.rsplit(":", 1)[1])
        # At the link: a broken session is SchedulerLost for every request on it.
        a, b = link.submit("a", _request([1, 2], 400), 30), link.submit("b", _request([1, 2], 400), 30)
        await anext(a), await anext(b)
        await first.kill()
        for events in (a, b):
            with pytest.raises(SchedulerLost):
                await _tokens(events)

        # Through the gateway core: lost mid-request, resubmitted to the scheduler that comes back.
        second = Scheduler(port)
        await second.__aenter__()
        core = GatewayCore(
            GatewaySettings(scheduler=second.address, model=llama_dir, scheduler_recovery_timeout=20),
            Tokenizer.from_pretrained(llama_dir),
            ModelConfig.from_pretrained(llama_dir),
            link,
        )
        params = GenerateParams(token_ids=[1, 2], max_tokens=300, ignore_eos=True)
        got: list[int] = []
        restarted = asyncio.Event()

        async def restart() -> None:
            await second.kill()
            await asyncio.sleep(0.3)
            third = Scheduler(port)
            await third.__aenter__()
            restarted.set()
            try:
                await asyncio.sleep(30)  # served until the test ends (cancelled there)
            finally:
                await third.kill()

        restarter: asyncio.Task | None = None
        async with contextlib.aclosing(core.generate(params, "c", None, "grpc")) as chunks:
            async for chunk in chunks:
                got += chunk.token_ids
                if len(got) >= 20 and restarter is None:
                    restarter = asyncio.create_task(restart())
        assert restarted.is_set()
        # FakeDense samples 1 + the sample index; the resubmission continued the index: no gap, no repeat
        assert got == list(range(1, 301))
        assert restarter is not None
        restarter.cancel()
        await asyncio.gather(restarter, return_exceptions=True)
        await link.close()

    asyncio.run(main())


def test_the_fleet_secret_guards_the_session() -> None:
    async def main() -> None:
        async with Scheduler(tls=TLSFiles(secret=SECRET)) as s:
            without = GrpcSchedulerLink(s.address, None)
            with pytest.raises(InternalError, match="UNAUTHENTICATED"):
                await _tokens(without.submit("x", _request([1, 2], 3), 30))
            await without.close()
            assert s.held() == {} and not s.service.driver.streams
            with_secret = GrpcSchedulerLink(s.address, TLSFiles(secret=SECRET))
            assert await _tokens(with_secret.submit("y", _request([1, 2], 3), 30)) == [1, 2, 3]
            await with_secret.close()

    asyncio.run(main())


def test_submit_and_the_session_run_side_by_side() -> None:
    async def main() -> None:
        async with Scheduler() as s:
            link = GrpcSchedulerLink(s.address, None)
            session = asyncio.create_task(_tokens(link.submit("s", _request([1, 2], 40), 30)))
            async with grpc.aio.insecure_channel(s.address) as ch:
                call = pb_grpc.SchedulerStub(ch).Submit(
                    pb.SubmitRequest(request_id="u", prompt_token_ids=[1, 2], max_tokens=40), timeout=30
                )
                unary = [t async for ev in call for t in ev.token_ids]
                info = pb_grpc.SchedulerStub(ch).GetStats(pb.SchedulerStatsRequest(), timeout=5)
                assert (await info).steps > 0
            assert unary == await session == list(range(1, 41))
            await link.close()

    asyncio.run(main())
