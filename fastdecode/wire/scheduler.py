"""scheduler.proto: the gateway's Submit to the scheduler's Request, its token events back (a
Submit's one by one, a Session's a step's at a time); the scheduler's stats and RemoveShard answer
for operators."""

from __future__ import annotations

from collections.abc import Sequence

from fastdecode.runtime.errors import DependencyDown, ServiceError
from fastdecode.scheduling.driver import SchedulerDriver
from fastdecode.scheduling.types import RemoveResult, Request, TokenEvent
from fastdecode.v1 import scheduler_pb2
from fastdecode.wire.dense import position_to_proto, sampling_from_proto, top_to_proto
from fastdecode.wire.errors import item_error


def request_from_submit(seq_id: str, r: scheduler_pb2.SubmitRequest) -> Request:
    return Request(
        seq_id=seq_id,
        prompt=list(r.prompt_token_ids),
        max_tokens=r.max_tokens,
        sampling=sampling_from_proto(r.sampling),
        stop_token_ids=frozenset(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
        sample_offset=r.sample_index_offset,
        cache_salt=r.cache_salt,
    )


def token_event_to_proto(ev: TokenEvent) -> scheduler_pb2.TokenEvent:
    out = scheduler_pb2.TokenEvent()
    _fill_token_event(out, ev)
    return out


def _fill_token_event(out: scheduler_pb2.TokenEvent, ev: TokenEvent) -> None:
    out.token_ids.extend(ev.token_ids)
    out.logprobs.extend(ev.logprobs)
    if ev.finish_reason:
        out.finish_reason = ev.finish_reason
    out.prompt_tokens = ev.prompt_tokens
    out.completion_tokens = ev.completion_tokens
    out.step = ev.step
    out.shard = ev.shard
    if ev.cached_tokens:
        out.cached_tokens = ev.cached_tokens
    # one event per request every step: the repeated parts only when asked (empty lists cost ~1/3)
    if ev.top:
        out.top.extend(top_to_proto(t) for t in ev.top)
    if ev.prompt_logprobs:
        out.prompt_logprobs.extend(position_to_proto(p) for p in ev.prompt_logprobs)


def _plain(item: TokenEvent | ServiceError) -> bool:
    """A token event SessionEvents carries as a row of its plain columns."""
    return (
        isinstance(item, TokenEvent)
        and item.error is None
        and not item.finish_reason
        and len(item.token_ids) >= 1
        and len(item.logprobs) == len(item.token_ids)
        and not item.top
        and not item.prompt_logprobs
    )


def session_events_to_proto(
    batch: Sequence[tuple[str, TokenEvent | ServiceError]],
) -> scheduler_pb2.SessionEvents:
    """A step's events for a session's requests, as one message: the plain ones as columns, the
    rest (and every event of a request that has one of the rest) as SessionEvent messages. A
    failure (a ServiceError, or an event carrying one) is that request's in-band error, with
    Submit's dependency-down meaning."""
    out = scheduler_pb2.SessionEvents()
    rich = {seq_id for seq_id, item in batch if not _plain(item)}
    ids: list[str] = []
    plain: list[TokenEvent] = []
    add = out.events.add
    for seq_id, item in batch:
        if seq_id not in rich:
            assert isinstance(item, TokenEvent)
            ids.append(seq_id)
            plain.append(item)
            continue
        error = item if isinstance(item, ServiceError) else item.error
        e = add(request_id=seq_id)
        if error is not None:
            e.error.CopyFrom(item_error(error))
            e.dependency_down = isinstance(error, DependencyDown)
        else:
            assert isinstance(item, TokenEvent)
            _fill_token_event(e.token, item)
    if plain:
        out.plain_request_ids.extend(ids)
        counts = [len(ev.token_ids) for ev in plain]
        if max(counts) > 1:  # several tokens a row (--decode-steps): their counts say where each ends
            out.plain_token_counts.extend(counts)
            out.plain_token_ids.extend([t for ev in plain for t in ev.token_ids])
            out.plain_logprobs.extend([lp for ev in plain for lp in ev.logprobs])
        else:
            out.plain_token_ids.extend([ev.token_ids[0] for ev in plain])
            out.plain_logprobs.extend([ev.logprobs[0] for ev in plain])
        out.plain_steps.extend([ev.step for ev in plain])
        out.plain_cached_tokens.extend([ev.cached_tokens for ev in plain])
    return out


def scheduler_stats_to_proto(driver: SchedulerDriver) -> scheduler_pb2.SchedulerStats:
    """GetStats: the core's figures, each shard's address, and the driver's migration totals."""
    assert driver.core is not None  # the servicer answers UNAVAILABLE before the driver connected
    st, not_ready_reason = driver.core.stats(), driver.not_ready_reason()
    addresses = [shard.link.address for shard in driver.shards]
    out = scheduler_pb2.SchedulerStats(
        running=st.running,
        waiting=st.waiting,
        steps=st.steps,
        finished=st.finished,
        recoveries=st.recoveries,
        preemptions=st.preemptions,
        kv_load_tokens=st.kv_load_tokens,
        w_limit=st.w_limit or 0.0,
        admission=st.admission,
        not_ready_reason=not_ready_reason or "",
        migrations=st.migrations,
    )
    out.spec_rows, out.spec_drafts, out.spec_accepted, out.spec_emitted = st.spec
    out.spec_offered_at.extend(st.spec_at[0])
    out.spec_kept_at.extend(st.spec_at[1])
    for sh in st.shards:
        out.shards.add(
            shard=sh.shard,
            address=addresses[sh.shard],
            healthy=sh.healthy,
            sequences=sh.sequences,
            tokens=sh.tokens,
            expected_tokens=sh.expected_tokens,
            capacity_tokens=sh.capacity_tokens,
            block_tokens=sh.reserved_tokens,
            state=sh.state,
            waiting_to_move=driver.waiting_to_move(sh.shard),
        )
    out.migrated_bytes, out.migration_seconds = driver.migrated_bytes, driver.migration_seconds
    out.migrations_failed = driver.migrations_failed
    return out


def remove_result_to_proto(r: RemoveResult) -> scheduler_pb2.RemoveShardResponse:
    return scheduler_pb2.RemoveShardResponse(
        shard=r.shard,
        migrated_sequences=r.migrated,
        reprefilled_sequences=r.reprefilled,
        seconds=r.seconds,
        bytes=r.bytes,
    )
