"""The job's plan stamp as it is now, made from its prompt snapshot (``engine.table.prompt_snapshot``) and
its settings (the plan table itself is ``engine.plan.plan_table``'s)."""

from __future__ import annotations

from batchllm_dagster.config import BatchJobConfig
from engine.plan.plan_table import plan_stamp
from engine.settings import EngineSettings
from engine.table.prompt_snapshot import snapshot_digest


def plan_stamp_of(config: BatchJobConfig, settings: EngineSettings) -> dict[str, str]:
    """The job's plan stamp as it is now (``settings``: the job's, model resolved): the model's
    content, the prompt snapshot, and the settings that shape a plan."""
    return plan_stamp(settings.model_path, snapshot_digest(config.files.prompts_path), config.plan_shaping(settings))
