"""gpu_dense's core: the dense step runner and the pipeline chooser. Imports no gRPC."""

from fastdecode.dense.pipeline import PipelineChooser
from fastdecode.dense.runner import AttendItem, DenseSeq, Outcome, ShardPlane, StepRunner, Timings

__all__ = ["AttendItem", "DenseSeq", "Outcome", "PipelineChooser", "ShardPlane", "StepRunner", "Timings"]
