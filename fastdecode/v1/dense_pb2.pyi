from fastdecode.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class LoraAdapterList(_message.Message):
    __slots__ = ("adapters", "enabled")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    enabled: bool
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., enabled: _Optional[bool] = ...) -> None: ...

class DenseRemoveShardRequest(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: int
    def __init__(self, shard: _Optional[int] = ...) -> None: ...

class DenseRemoveShardResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AddShardRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class AddShardResponse(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: int
    def __init__(self, shard: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "top_logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "suppress_token_ids", "grammar", "logit_bias", "min_p", "allowed_token_ids", "bad_words", "lora")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    top_logprobs: int
    prompt_logprobs: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    suppress_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar: str
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    lora: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., suppress_token_ids: _Optional[_Iterable[int]] = ..., grammar: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., lora: _Optional[str] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PositionLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: TopLogprobs
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Union[TopLogprobs, _Mapping]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step", "pipeline", "ended", "seq_ids", "shards", "mini_batches", "start_pos", "token_counts", "token_ids", "sample", "sample_index", "use_last_sample", "samplings", "sampling_index", "next_token_ids", "steps", "drafts")
    class NextTokenIdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    MINI_BATCHES_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    USE_LAST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLINGS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_INDEX_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    pipeline: bool
    ended: _containers.RepeatedScalarFieldContainer[str]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    shards: _containers.RepeatedScalarFieldContainer[int]
    mini_batches: _containers.RepeatedScalarFieldContainer[int]
    start_pos: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[bool]
    sample_index: _containers.RepeatedScalarFieldContainer[int]
    use_last_sample: _containers.RepeatedScalarFieldContainer[bool]
    samplings: _containers.RepeatedCompositeFieldContainer[SamplingParams]
    sampling_index: _containers.RepeatedScalarFieldContainer[int]
    next_token_ids: _containers.ScalarMap[int, int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    drafts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., pipeline: _Optional[bool] = ..., ended: _Optional[_Iterable[str]] = ..., seq_ids: _Optional[_Iterable[str]] = ..., shards: _Optional[_Iterable[int]] = ..., mini_batches: _Optional[_Iterable[int]] = ..., start_pos: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[bool]] = ..., sample_index: _Optional[_Iterable[int]] = ..., use_last_sample: _Optional[_Iterable[bool]] = ..., samplings: _Optional[_Iterable[_Union[SamplingParams, _Mapping]]] = ..., sampling_index: _Optional[_Iterable[int]] = ..., next_token_ids: _Optional[_Mapping[int, int]] = ..., steps: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("positions",)
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedCompositeFieldContainer[PositionLogprob]
    def __init__(self, positions: _Optional[_Iterable[_Union[PositionLogprob, _Mapping]]] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("s_part_seconds", "shard_wait_seconds", "step_seconds", "attend_seconds", "overlap_ratio", "pipelined", "s_part_cpu_seconds")
    S_PART_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_RATIO_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    S_PART_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    s_part_seconds: float
    shard_wait_seconds: float
    step_seconds: float
    attend_seconds: float
    overlap_ratio: float
    pipelined: bool
    s_part_cpu_seconds: float
    def __init__(self, s_part_seconds: _Optional[float] = ..., shard_wait_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., attend_seconds: _Optional[float] = ..., overlap_ratio: _Optional[float] = ..., pipelined: _Optional[bool] = ..., s_part_cpu_seconds: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step", "timings", "error", "seq_ids", "token_ids", "logprobs", "errors", "top", "prompt_logprobs", "token_counts")
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: _tensor_pb2.ItemError
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[_tensor_pb2.ItemError, _Mapping]] = ...) -> None: ...
    class TopEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: TopLogprobs
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[TopLogprobs, _Mapping]] = ...) -> None: ...
    class PromptLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: PromptLogprobs
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    timings: StepTimings
    error: _tensor_pb2.ItemError
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    errors: _containers.MessageMap[int, _tensor_pb2.ItemError]
    top: _containers.MessageMap[int, TopLogprobs]
    prompt_logprobs: _containers.MessageMap[int, PromptLogprobs]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., error: _Optional[_Union[_tensor_pb2.ItemError, _Mapping]] = ..., seq_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., errors: _Optional[_Mapping[int, _tensor_pb2.ItemError]] = ..., top: _Optional[_Mapping[int, TopLogprobs]] = ..., prompt_logprobs: _Optional[_Mapping[int, PromptLogprobs]] = ..., token_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_type", "model_path", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "max_position_embeddings", "eos_token_ids", "bos_token_id", "dtype", "device", "num_shards", "shards", "removed_shards", "layer_windows", "attn_logit_softcap", "weights_id")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    ATTN_LOGIT_SOFTCAP_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    model_path: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    dtype: str
    device: str
    num_shards: int
    shards: _containers.RepeatedScalarFieldContainer[str]
    removed_shards: _containers.RepeatedScalarFieldContainer[int]
    layer_windows: _containers.RepeatedScalarFieldContainer[int]
    attn_logit_softcap: float
    weights_id: str
    def __init__(self, model_type: _Optional[str] = ..., model_path: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., num_shards: _Optional[int] = ..., shards: _Optional[_Iterable[str]] = ..., removed_shards: _Optional[_Iterable[int]] = ..., layer_windows: _Optional[_Iterable[int]] = ..., attn_logit_softcap: _Optional[float] = ..., weights_id: _Optional[str] = ...) -> None: ...
