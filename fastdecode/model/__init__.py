"""Model core: config (torch-free: the gateway reads it), and in its modules the weights, the rotary
embedding and the S-part of every supported family (fastdecode.model.dense). Imports no gRPC."""

from fastdecode.model.config import ModelConfig, RopeConfig

__all__ = ["ModelConfig", "RopeConfig"]
