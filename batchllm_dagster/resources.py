"""Dagster resources: the vLLM engine a partition runs on (the warehouse is dagster-duckdb's)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
from pydantic import Field

from engine.jobs.shared_engine import SharedEngine
from engine.machine import device_name
from engine.settings import EngineSettings
from engine.vllm.library_output import LOG_DIR, library_output_routed
from engine.vllm.vllm_engine import VLLMEngine, open_engine


class VLLMResource(dg.ConfigurableResource):
    """Per-deployment: what the device is called (how vLLM runs is the job's ``llm:``). The device
    is the GPU or CPU model a partition ran on (metadata ``device``); a hardware partition is the
    job's name for a pool of such machines (the ``hardware`` column and ``hardware_partition``)."""

    device_label: str | None = Field(None, description="name recorded as the device (default: the GPU or CPU model)")

    def device(self) -> str:
        return self.device_label or device_name()

    @contextmanager
    def engine(self, settings: EngineSettings) -> Iterator[VLLMEngine]:
        """``with llm.engine(settings) as engine:`` vLLM with the job's settings, shut down
        when the block ends (normally or not): the resource owns the engine's lifetime, as
        ``DuckDBResource.get_connection()`` owns a connection's."""
        with open_engine(settings) as engine:
            yield engine

    def shared_engine(self) -> SharedEngine:
        """One engine for the shards of a run, one after another: started at the first that needs it,
        stopped once when the ``with`` block ends."""
        return SharedEngine(self.engine)

    def library_output_routed(self, log_name: str):
        """vLLM's, torch's and the other libraries' own lines (a missing Triton, NUMA binding, vLLM's
        start-up report) go to ``LOG_DIR/<log_name>.log``, not into the run's log, as on the CLI;
        the context gives the file's path."""
        return library_output_routed(LOG_DIR / f"{log_name}.log")


# One instance shared by every job's definitions, so that merging them finds no conflict.
DEFAULT_LLM = VLLMResource()
