"""Dagster building blocks of the batchllm engine: a job's declaration (config), the vLLM resource,
shard partitions, metadata, checks and DuckDB writes. The asset graph built from them is ``assets``;
this package never imports it."""

from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings

from .config import BatchJobConfig, DatasetSpec
from .resources import VLLMResource

# The engine's settings are a job's ``llm:``, ``sampling:`` and ``scheduler:`` (one model each).
__all__ = ["BatchJobConfig", "DatasetSpec", "EngineSettings", "SamplingSettings", "SchedulerSettings", "VLLMResource"]
