"""gpu_dense's core: the dense step runner and the pipeline chooser. Imports no gRPC. The sequences a
step runs are `fastdecode.contract.PlannedSeq`, the one type across the step boundary."""

from fastdecode.dense.pipeline import PipelineChooser
from fastdecode.dense.runner import AttendItem, Outcome, ShardPlane, StepRunner, Timings

__all__ = ["AttendItem", "Outcome", "PipelineChooser", "ShardPlane", "StepRunner", "Timings"]
