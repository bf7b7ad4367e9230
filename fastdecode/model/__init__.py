"""Model core: config, weights and the S-part of Llama-family models. Imports no gRPC."""

from fastdecode.model.config import ModelConfig, RopeConfig
from fastdecode.model.dense import DenseModel, resolve_device

__all__ = ["DenseModel", "ModelConfig", "RopeConfig", "resolve_device"]
