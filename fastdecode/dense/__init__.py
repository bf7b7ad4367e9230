"""gpu_dense's core: the dense step runner and the pipeline chooser. Imports no gRPC. The sequences a
step runs are `fastdecode.contract.PlannedSeq`, the one type across the step boundary; the shards are
behind a `ShardPlane` (what a plane can do beyond it declared by `LayerPlane`), and the device's waits
behind a `Device` (fastdecode/dense/plane.py)."""

from fastdecode.dense.outcome import Outcome, Timings
from fastdecode.dense.pipeline import PipelineChooser
from fastdecode.dense.plane import Answered, Device, LayerPlane, ShardPlane, StepCancelled
from fastdecode.dense.runner import AttendItem, StepRunner

__all__ = [
    "Answered",
    "AttendItem",
    "Device",
    "LayerPlane",
    "Outcome",
    "PipelineChooser",
    "ShardPlane",
    "StepCancelled",
    "StepRunner",
    "Timings",
]
