"""Dagster integration of the batchllm engine: config, resources, partitions, checks, factory."""

from .component import BatchJobComponent
from .config import BatchJobConfig, DatasetSpec, ModelSpec, SamplingSpec
from .factory import build_batch_defs
from .resources import VLLMResource

__all__ = [
    "BatchJobComponent", "BatchJobConfig", "DatasetSpec", "ModelSpec", "SamplingSpec", "VLLMResource", "build_batch_defs",
]
