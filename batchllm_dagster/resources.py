"""Dagster resources: the vLLM engine a partition runs on (the warehouse is dagster-duckdb's)."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from engine.runner import PreparedBatch, open_engine
from engine.settings import EngineSettings
from engine.vllm_engine import VLLMEngine
from engine.vllm_env import hardware_name


class VLLMResource(dg.ConfigurableResource):
    """Per-deployment vLLM settings: how much memory the KV cache gets and what the hardware is called."""

    kv_cache_gib: int = Field(2, description="KV cache memory on CPU (GiB); on a GPU vLLM sizes it itself")
    hardware_label: str | None = Field(None, description="name recorded as the hardware (default: GPU or CPU model)")

    def hardware(self) -> str:
        return self.hardware_label or hardware_name()

    def open(self, settings: EngineSettings, prepared: PreparedBatch) -> VLLMEngine:
        return open_engine(settings, prepared)


# One instance shared by every job's definitions, so that merging them finds no conflict.
DEFAULT_LLM = VLLMResource()
