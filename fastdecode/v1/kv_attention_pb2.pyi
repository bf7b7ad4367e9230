from fastdecode.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MigrateOutRequest(_message.Message):
    __slots__ = ("seq_id", "target", "tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    target: str
    tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., target: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class MigrateOutResponse(_message.Message):
    __slots__ = ("tokens", "bytes", "seconds")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    bytes: int
    seconds: float
    def __init__(self, tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("seq_id", "geometry", "kv_dtype", "tokens", "layer", "k", "v", "k_scale", "v_scale", "first_token")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    K_SCALE_FIELD_NUMBER: _ClassVar[int]
    V_SCALE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    geometry: KVGeometry
    kv_dtype: _tensor_pb2.DType
    tokens: int
    layer: int
    k: _tensor_pb2.Tensor
    v: _tensor_pb2.Tensor
    k_scale: _tensor_pb2.Tensor
    v_scale: _tensor_pb2.Tensor
    first_token: int
    def __init__(self, seq_id: _Optional[str] = ..., geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., kv_dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., tokens: _Optional[int] = ..., layer: _Optional[int] = ..., k: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., v: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., k_scale: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., v_scale: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., first_token: _Optional[int] = ...) -> None: ...

class ImportResponse(_message.Message):
    __slots__ = ("tokens", "bytes")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    bytes: int
    def __init__(self, tokens: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class RetireRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RetireResponse(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: int
    def __init__(self, sequences: _Optional[int] = ...) -> None: ...

class KVGeometry(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "layer_windows", "attn_logit_softcap")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    ATTN_LOGIT_SOFTCAP_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: _containers.RepeatedScalarFieldContainer[int]
    attn_logit_softcap: float
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layer_windows: _Optional[_Iterable[int]] = ..., attn_logit_softcap: _Optional[float] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("request_id", "layer", "seq_ids", "num_tokens", "start_pos", "q", "k", "v")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    layer: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    start_pos: _containers.RepeatedScalarFieldContainer[int]
    q: _tensor_pb2.Tensor
    k: _tensor_pb2.Tensor
    v: _tensor_pb2.Tensor
    def __init__(self, request_id: _Optional[int] = ..., layer: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., start_pos: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., k: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., v: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("request_id", "o", "error", "attend_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    O_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ATTEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    o: _tensor_pb2.Tensor
    error: _tensor_pb2.ItemError
    attend_seconds: float
    def __init__(self, request_id: _Optional[int] = ..., o: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., error: _Optional[_Union[_tensor_pb2.ItemError, _Mapping]] = ..., attend_seconds: _Optional[float] = ...) -> None: ...

class SequenceReservation(_message.Message):
    __slots__ = ("seq_id", "max_tokens", "token_ids", "cache_salt")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    max_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, seq_id: _Optional[str] = ..., max_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("geometry", "sequences", "model")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    geometry: KVGeometry
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceReservation]
    model: str
    def __init__(self, geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., sequences: _Optional[_Iterable[_Union[SequenceReservation, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("free_tokens", "cached_tokens")
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    free_tokens: int
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, free_tokens: _Optional[int] = ..., cached_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids", "all")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    all: bool
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., all: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReattachRequest(_message.Message):
    __slots__ = ("geometry", "model", "keep")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    geometry: KVGeometry
    model: str
    keep: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., model: _Optional[str] = ..., keep: _Optional[_Iterable[str]] = ...) -> None: ...

class HeldSequence(_message.Message):
    __slots__ = ("seq_id", "tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class ReattachResponse(_message.Message):
    __slots__ = ("sequences", "released", "torn_positions", "discarded")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    TORN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[HeldSequence]
    released: int
    torn_positions: int
    discarded: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[HeldSequence, _Mapping]]] = ..., released: _Optional[int] = ..., torn_positions: _Optional[int] = ..., discarded: _Optional[str] = ...) -> None: ...

class ShardStats(_message.Message):
    __slots__ = ("shard_id", "sequences", "tokens_held", "tokens_reserved", "bytes_used", "bytes_capacity", "attention_busy_seconds", "attend_items", "free_tokens", "kv_dtype", "configured", "attended_token_pairs", "block_size", "blocks_in_use", "blocks_free", "host_busy_seconds", "prefix_queries", "prefix_hits", "prefix_hit_tokens", "prefix_evictions", "prefix_cached_blocks", "prefix_shared_bytes", "kv_persistent")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTEND_ITEMS_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    ATTENDED_TOKEN_PAIRS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    HOST_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    sequences: int
    tokens_held: int
    tokens_reserved: int
    bytes_used: int
    bytes_capacity: int
    attention_busy_seconds: float
    attend_items: int
    free_tokens: int
    kv_dtype: _tensor_pb2.DType
    configured: bool
    attended_token_pairs: float
    block_size: int
    blocks_in_use: int
    blocks_free: int
    host_busy_seconds: float
    prefix_queries: int
    prefix_hits: int
    prefix_hit_tokens: int
    prefix_evictions: int
    prefix_cached_blocks: int
    prefix_shared_bytes: int
    kv_persistent: bool
    def __init__(self, shard_id: _Optional[int] = ..., sequences: _Optional[int] = ..., tokens_held: _Optional[int] = ..., tokens_reserved: _Optional[int] = ..., bytes_used: _Optional[int] = ..., bytes_capacity: _Optional[int] = ..., attention_busy_seconds: _Optional[float] = ..., attend_items: _Optional[int] = ..., free_tokens: _Optional[int] = ..., kv_dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., configured: _Optional[bool] = ..., attended_token_pairs: _Optional[float] = ..., block_size: _Optional[int] = ..., blocks_in_use: _Optional[int] = ..., blocks_free: _Optional[int] = ..., host_busy_seconds: _Optional[float] = ..., prefix_queries: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_evictions: _Optional[int] = ..., prefix_cached_blocks: _Optional[int] = ..., prefix_shared_bytes: _Optional[int] = ..., kv_persistent: _Optional[bool] = ...) -> None: ...

class FillRequest(_message.Message):
    __slots__ = ("seq_ids", "tokens", "seed")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    tokens: int
    seed: int
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., tokens: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class FillResponse(_message.Message):
    __slots__ = ("tokens_written",)
    TOKENS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    tokens_written: int
    def __init__(self, tokens_written: _Optional[int] = ...) -> None: ...
