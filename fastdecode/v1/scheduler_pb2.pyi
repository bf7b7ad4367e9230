from fastdecode.v1 import dense_pb2 as _dense_pb2
from fastdecode.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RemoveShardRequest(_message.Message):
    __slots__ = ("shard", "address", "timeout_seconds")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    address: str
    timeout_seconds: float
    def __init__(self, shard: _Optional[int] = ..., address: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RemoveShardResponse(_message.Message):
    __slots__ = ("shard", "migrated_sequences", "reprefilled_sequences", "seconds", "bytes")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    REPREFILLED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    shard: int
    migrated_sequences: int
    reprefilled_sequences: int
    seconds: float
    bytes: int
    def __init__(self, shard: _Optional[int] = ..., migrated_sequences: _Optional[int] = ..., reprefilled_sequences: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_tokens", "sampling", "stop_token_ids", "ignore_eos", "sample_index_offset", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: _dense_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    sample_index_offset: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_dense_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., sample_index_offset: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submit", "cancel")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    submit: SubmitRequest
    cancel: CancelRequest
    def __init__(self, submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelRequest, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("events", "plain_request_ids", "plain_token_ids", "plain_logprobs", "plain_steps", "plain_cached_tokens", "plain_token_counts")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    plain_request_ids: _containers.RepeatedScalarFieldContainer[str]
    plain_token_ids: _containers.RepeatedScalarFieldContainer[int]
    plain_logprobs: _containers.RepeatedScalarFieldContainer[float]
    plain_steps: _containers.RepeatedScalarFieldContainer[int]
    plain_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    plain_token_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ..., plain_request_ids: _Optional[_Iterable[str]] = ..., plain_token_ids: _Optional[_Iterable[int]] = ..., plain_logprobs: _Optional[_Iterable[float]] = ..., plain_steps: _Optional[_Iterable[int]] = ..., plain_cached_tokens: _Optional[_Iterable[int]] = ..., plain_token_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("request_id", "token", "error", "dependency_down")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DEPENDENCY_DOWN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: TokenEvent
    error: _tensor_pb2.ItemError
    dependency_down: bool
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ..., error: _Optional[_Union[_tensor_pb2.ItemError, _Mapping]] = ..., dependency_down: _Optional[bool] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "prompt_tokens", "completion_tokens", "step", "shard", "top", "prompt_logprobs", "cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    step: int
    shard: int
    top: _containers.RepeatedCompositeFieldContainer[_dense_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_dense_pb2.PositionLogprob]
    cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., step: _Optional[int] = ..., shard: _Optional[int] = ..., top: _Optional[_Iterable[_Union[_dense_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_dense_pb2.PositionLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SchedulerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardLoad(_message.Message):
    __slots__ = ("shard", "address", "healthy", "sequences", "tokens", "expected_tokens", "capacity_tokens", "block_tokens", "state", "waiting_to_move")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WAITING_TO_MOVE_FIELD_NUMBER: _ClassVar[int]
    shard: int
    address: str
    healthy: bool
    sequences: int
    tokens: int
    expected_tokens: int
    capacity_tokens: int
    block_tokens: int
    state: str
    waiting_to_move: int
    def __init__(self, shard: _Optional[int] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., sequences: _Optional[int] = ..., tokens: _Optional[int] = ..., expected_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., block_tokens: _Optional[int] = ..., state: _Optional[str] = ..., waiting_to_move: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("running", "waiting", "steps", "finished", "recoveries", "shards", "kv_load_tokens", "w_limit", "admission", "not_ready_reason", "preemptions", "migrations", "migrated_bytes", "migration_seconds", "migrations_failed", "spec_rows", "spec_drafts", "spec_accepted", "spec_emitted", "spec_offered_at", "spec_kept_at")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    W_LIMIT_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    NOT_READY_REASON_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FAILED_FIELD_NUMBER: _ClassVar[int]
    SPEC_ROWS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SPEC_EMITTED_FIELD_NUMBER: _ClassVar[int]
    SPEC_OFFERED_AT_FIELD_NUMBER: _ClassVar[int]
    SPEC_KEPT_AT_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    steps: int
    finished: int
    recoveries: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardLoad]
    kv_load_tokens: float
    w_limit: float
    admission: str
    not_ready_reason: str
    preemptions: int
    migrations: int
    migrated_bytes: int
    migration_seconds: float
    migrations_failed: int
    spec_rows: int
    spec_drafts: int
    spec_accepted: int
    spec_emitted: int
    spec_offered_at: _containers.RepeatedScalarFieldContainer[int]
    spec_kept_at: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., steps: _Optional[int] = ..., finished: _Optional[int] = ..., recoveries: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardLoad, _Mapping]]] = ..., kv_load_tokens: _Optional[float] = ..., w_limit: _Optional[float] = ..., admission: _Optional[str] = ..., not_ready_reason: _Optional[str] = ..., preemptions: _Optional[int] = ..., migrations: _Optional[int] = ..., migrated_bytes: _Optional[int] = ..., migration_seconds: _Optional[float] = ..., migrations_failed: _Optional[int] = ..., spec_rows: _Optional[int] = ..., spec_drafts: _Optional[int] = ..., spec_accepted: _Optional[int] = ..., spec_emitted: _Optional[int] = ..., spec_offered_at: _Optional[_Iterable[int]] = ..., spec_kept_at: _Optional[_Iterable[int]] = ...) -> None: ...
