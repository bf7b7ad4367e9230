from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArenaSlice(_message.Message):
    __slots__ = ("offset", "shape", "dtype")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ExchangeItem(_message.Message):
    __slots__ = ("shard", "seq_ids", "num_tokens", "start_pos", "q", "k", "v", "o_offset", "o_room")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    O_OFFSET_FIELD_NUMBER: _ClassVar[int]
    O_ROOM_FIELD_NUMBER: _ClassVar[int]
    shard: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    start_pos: _containers.RepeatedScalarFieldContainer[int]
    q: ArenaSlice
    k: ArenaSlice
    v: ArenaSlice
    o_offset: int
    o_room: int
    def __init__(self, shard: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., start_pos: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[ArenaSlice, _Mapping]] = ..., k: _Optional[_Union[ArenaSlice, _Mapping]] = ..., v: _Optional[_Union[ArenaSlice, _Mapping]] = ..., o_offset: _Optional[int] = ..., o_room: _Optional[int] = ...) -> None: ...

class ExchangeAttend(_message.Message):
    __slots__ = ("rid", "slot", "layer", "arena", "has_items", "items", "not_before_ns")
    RID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    HAS_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_NS_FIELD_NUMBER: _ClassVar[int]
    rid: int
    slot: int
    layer: int
    arena: str
    has_items: bool
    items: _containers.RepeatedCompositeFieldContainer[ExchangeItem]
    not_before_ns: int
    def __init__(self, rid: _Optional[int] = ..., slot: _Optional[int] = ..., layer: _Optional[int] = ..., arena: _Optional[str] = ..., has_items: _Optional[bool] = ..., items: _Optional[_Iterable[_Union[ExchangeItem, _Mapping]]] = ..., not_before_ns: _Optional[int] = ...) -> None: ...

class ExchangeShard(_message.Message):
    __slots__ = ("index", "address")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class ToWorker(_message.Message):
    __slots__ = ("secret", "attend", "cancel", "add_shard", "remove_shard", "restore_shard", "sync")
    class Secret(_message.Message):
        __slots__ = ("send",)
        SEND_FIELD_NUMBER: _ClassVar[int]
        send: str
        def __init__(self, send: _Optional[str] = ...) -> None: ...
    SECRET_FIELD_NUMBER: _ClassVar[int]
    ATTEND_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ADD_SHARD_FIELD_NUMBER: _ClassVar[int]
    REMOVE_SHARD_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SHARD_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    secret: ToWorker.Secret
    attend: ExchangeAttend
    cancel: int
    add_shard: ExchangeShard
    remove_shard: int
    restore_shard: int
    sync: int
    def __init__(self, secret: _Optional[_Union[ToWorker.Secret, _Mapping]] = ..., attend: _Optional[_Union[ExchangeAttend, _Mapping]] = ..., cancel: _Optional[int] = ..., add_shard: _Optional[_Union[ExchangeShard, _Mapping]] = ..., remove_shard: _Optional[int] = ..., restore_shard: _Optional[int] = ..., sync: _Optional[int] = ...) -> None: ...

class ExchangeResult(_message.Message):
    __slots__ = ("o", "status", "text")
    O_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    o: ArenaSlice
    status: int
    text: str
    def __init__(self, o: _Optional[_Union[ArenaSlice, _Mapping]] = ..., status: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class ToDense(_message.Message):
    __slots__ = ("ready", "done", "synced")
    class Done(_message.Message):
        __slots__ = ("rid", "results")
        RID_FIELD_NUMBER: _ClassVar[int]
        RESULTS_FIELD_NUMBER: _ClassVar[int]
        rid: int
        results: _containers.RepeatedCompositeFieldContainer[ExchangeResult]
        def __init__(self, rid: _Optional[int] = ..., results: _Optional[_Iterable[_Union[ExchangeResult, _Mapping]]] = ...) -> None: ...
    READY_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    ready: int
    done: ToDense.Done
    synced: int
    def __init__(self, ready: _Optional[int] = ..., done: _Optional[_Union[ToDense.Done, _Mapping]] = ..., synced: _Optional[int] = ...) -> None: ...
