"""The scheduler's domain core: admission, placement, step planning. Imports no gRPC."""

from fastdecode.scheduling.admission import (
    AdmissionPolicy,
    Candidate,
    MicroBatch,
    NaiveAdmission,
    StabilizedAdmission,
    earliest_start,
    start_micro_batch,
)
from fastdecode.scheduling.core import SchedulerCore
from fastdecode.scheduling.placement import ShardLoad, attention_cost, choose_shard, split_mini_batches
from fastdecode.scheduling.types import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    PlannedSeq,
    Request,
    Reservation,
    Sampled,
    SampledRun,
    Sampling,
    SchedulerStats,
    ShardSpec,
    ShardStats,
    Step,
    TokenEvent,
)

__all__ = [
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "AdmissionPolicy",
    "Candidate",
    "MicroBatch",
    "NaiveAdmission",
    "PlannedSeq",
    "Request",
    "Reservation",
    "Sampled",
    "SampledRun",
    "Sampling",
    "SchedulerCore",
    "SchedulerStats",
    "ShardLoad",
    "ShardSpec",
    "ShardStats",
    "StabilizedAdmission",
    "Step",
    "TokenEvent",
    "attention_cost",
    "choose_shard",
    "earliest_start",
    "split_mini_batches",
    "start_micro_batch",
]
