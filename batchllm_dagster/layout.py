"""Where a job lives, derived from what it declares (``BatchJobConfig``): its files and locks under
its storage folder (``JobFiles``), its names in Dagster (``JobNames``: asset keys, the partition
set, jobs, sensors, the schedule, pools, the warehouse resource key), the run tags the package
reads and how a run names itself in a lock (``this_run``). Each name has this one owner: the assets,
sensors, checks and the demo ask it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Run tags. The instance's run queue limits two of them to one run per value (instance_limits).
PLAN_TAG = "batchllm/plan"  # runs that plan a job carry its name: one plan of a job at a time
POOL_TAG = "batchllm/pool"  # a hardware partition's runs carry its pool: one run per GPU at a time
HARDWARE_TAG = "batchllm/hardware"  # the hardware partition a shard's run is bound to
PLAN_RUN_TAG = "batchllm/plan_run"  # a shard's run: the plan run whose shards it was queued for
SHARDS_TAG = "batchllm/shards"  # the shard keys a sensor's run answers (``first..last`` for a range)
OUTPUT_TABLE_TAG = "batchllm/output_table"  # on the completions op: the table its answers go to


def this_run(context) -> str:
    """How a lock a step holds names its run to a run that waits or is refused (``engine.locks``)."""
    return f"run {context.run.run_id}, pid {os.getpid()}"


@dataclass(frozen=True)
class JobFiles:
    """A job's files and locks, under its storage folder: what its assets hand to each other."""

    name: str
    storage_dir: str
    lock_timeout_s: float  # how long a run waits for a lock another holds, then fails naming the holder

    @property
    def job_dir(self) -> Path:
        return Path(self.storage_dir) / self.name

    @property
    def prompts_path(self) -> Path:
        return self.job_dir / "prompts.parquet"

    @property
    def field_order_path(self) -> Path:
        """The job's field order, kept from night to night (``engine.table.field_order_state``)."""
        return self.job_dir / "field_order.parquet"

    @property
    def plan_path(self) -> Path:
        return self.job_dir / "plan.parquet"

    @property
    def token_cache_dir(self) -> Path:
        return self.job_dir / "token_cache"

    @property
    def checkpoints_dir(self) -> Path:
        return self.job_dir / "checkpoints"

    @property
    def checkpoints(self):
        """The shards' checkpoints, one folder per partition key (``engine.jobs.shard_job.JobCheckpoints``)."""
        from engine.jobs.shard_job import JobCheckpoints

        return JobCheckpoints(self.checkpoints_dir)

    @property
    def completions_dir(self) -> Path:
        return self.job_dir / "completions"

    def completions_parquet_path(self, partition_key: str) -> Path:
        return self.completions_dir / f"{partition_key}.parquet"

    def lock_path(self, name: str) -> Path:
        """A lock the job's runs take whatever launched them (``engine.locks``)."""
        return self.job_dir / "locks" / f"{name}.lock"

    def plan_lock(self, holder: str, shared: bool = False):
        """The job's plan lock: held exclusively while a plan is made and while a prompt snapshot
        lands, shared while a shard checks its answers against the plan and writes them. A wait
        past ``lock_timeout_s`` fails naming the exclusive holder."""
        from engine.locks import locked

        return locked(self.lock_path("plan"), shared=shared, holder=holder, timeout_s=self.lock_timeout_s,
                      what=f"the plan lock of job {self.name!r}")



@dataclass(frozen=True)
class JobNames:
    """A job's names in Dagster, from its name alone."""

    name: str

    def asset_key(self, asset: str):
        """The key of one of the job's assets: ``prompts``, ``prefix_groups`` or ``completions``."""
        import dagster as dg

        return dg.AssetKey([self.name, asset])

    @property
    def partitions_name(self) -> str:
        return f"{self.name}_shards"

    @property
    def warehouse_key(self) -> str:
        """Resource key of the job's output database (a dagster-duckdb ``DuckDBResource``)."""
        return f"{self.name}_warehouse"

    @property
    def plan_pool(self) -> str:
        """The op pool of ``prefix_groups``: one plan step of this job at a time, in any run."""
        return f"batchllm_plan_{self.name}"

    @property
    def plan_job_name(self) -> str:
        return f"{self.name}_plan"

    def shards_job_name(self, hardware_slug: str) -> str:
        return f"{self.name}_shards_{hardware_slug}"

    @property
    def run_shards_sensor_name(self) -> str:
        return f"{self.name}_run_shards"

    @property
    def source_sensor_name(self) -> str:
        return f"{self.name}_source_changed"

    @property
    def schedule_name(self) -> str:
        return f"{self.name}_nightly"

    @property
    def table_checks_name(self) -> str:
        return f"{self.name}_all_prompts_answered"
