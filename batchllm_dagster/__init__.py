"""Dagster integration of the batchllm engine: config, resources, partitions, checks, factory."""

from .config import BatchJobConfig, DatasetSpec, ModelSpec, SamplingSpec
from .factory import build_batch_defs
from .resources import VLLMResource

__all__ = ["BatchJobConfig", "DatasetSpec", "ModelSpec", "SamplingSpec", "VLLMResource", "build_batch_defs"]
