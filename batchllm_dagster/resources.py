"""Dagster resources: the vLLM engine a partition runs on (the warehouse is dagster-duckdb's)."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from engine.runner import PreparedBatch, open_engine
from engine.settings import EngineSettings
from engine.vllm_engine import VLLMEngine
from engine.vllm_env import hardware_name


class VLLMResource(dg.ConfigurableResource):
    """Per-deployment: what the hardware is called (how vLLM runs is the job's ``llm:``)."""

    hardware_label: str | None = Field(None, description="name recorded as the hardware (default: GPU or CPU model)")

    def hardware(self) -> str:
        return self.hardware_label or hardware_name()

    def open(self, settings: EngineSettings, prepared: PreparedBatch) -> VLLMEngine:
        return open_engine(settings, prepared)


# One instance shared by every job's definitions, so that merging them finds no conflict.
DEFAULT_LLM = VLLMResource()
