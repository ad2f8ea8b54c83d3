"""The ``<name>_run_shards`` sensor: every shard of the current plan runs until it lands.

After a plan it asks for one run per hardware partition, of every shard the plan lists to run there
(``partitions_to_run``: the shards whose rows are all answered as planned are not run again; at most
``partitions_per_run`` shards a run where the job sets it), on its hardware partition's job: one
vLLM start per hardware partition and night. On every later tick it asks again for the shards of
that plan that have not landed and have no run queued or running: a run that failed (another run
still held its key, a plan that changed under it, an engine error) or that landed nothing is
retried, the shard it stopped at alone, up to ``shard_attempts`` runs per shard run and plan,
without any run-retry setting of the instance.
"""

from __future__ import annotations

import dagster as dg

from batchllm_dagster.checks import shards_outstanding
from batchllm_dagster.config import BatchJobConfig
from batchllm_dagster.layout import PLAN_RUN_TAG, SHARDS_TAG
from batchllm_dagster.partitions import RANGE_END, RANGE_START, hardware_of_key, run_keys, shard_runs

IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
FINISHED = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]


def keys_in_flight(instance: dg.DagsterInstance, config: BatchJobConfig, keys: list[str]) -> set[str]:
    """The shard keys (of ``keys``, the partitions in order) that a queued or running run of the
    job's shard jobs answers, whichever plan it was queued for."""
    busy: set[str] = set()
    for hardware in config.hardware:
        runs = instance.get_runs(filters=dg.RunsFilter(job_name=config.names.shards_job_name(hardware.slug),
                                                       statuses=IN_FLIGHT))
        for run in runs:
            busy.update(run_keys(run.tags, keys))
    return busy


def failed_here(instance: dg.DagsterInstance, plan_run: str, keys: list[str], outstanding: set[str]) -> set[str]:
    """The shards a failed run of this plan stopped at: its first partition still outstanding (a run
    answers its partitions in order and stops at a failure). Each is asked again in a run of its
    own, so that one failing shard never holds back the shards after it."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={PLAN_RUN_TAG: plan_run},
                                                   statuses=[dg.DagsterRunStatus.FAILURE]))
    stopped_at = set()
    for run in runs:
        left = [key for key in run_keys(run.tags, keys) if key in outstanding]
        if left:
            stopped_at.add(left[0])
    return stopped_at


def shard_requests(instance: dg.DagsterInstance, config: BatchJobConfig, job_of_hardware: dict[str, str],
                   log=None) -> list[dg.RunRequest]:
    """The runs to ask for now (see the module doc)."""
    plan = instance.fetch_materializations(config.names.asset_key("prefix_groups"), limit=1).records
    if not plan:
        return []
    plan_run = plan[0].run_id
    keys = instance.get_dynamic_partitions(config.names.partitions_name)
    outstanding = set(shards_outstanding(instance, config))
    busy = keys_in_flight(instance, config, keys) if outstanding else set()
    failed = failed_here(instance, plan_run, keys, outstanding)
    requests = []
    for run in shard_runs(config, keys, wanted=outstanding - busy, alone=failed):
        label = run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}"
        tags = {PLAN_RUN_TAG: plan_run, SHARDS_TAG: label}  # a superseded plan's run says so
        tried = len(instance.get_run_ids(filters=dg.RunsFilter(tags=tags, statuses=FINISHED)))
        if tried >= config.shard_attempts:
            if log:
                log(f"{label}: {tried} runs for this plan did not land it (shard_attempts); not asked again")
            continue
        if len(run) > 1:  # a range of neighbouring partitions, one vLLM start
            tags.update({RANGE_START: run[0], RANGE_END: run[-1]})
        requests.append(dg.RunRequest(
            run_key=f"{plan_run}:{label}" + (f":attempt-{tried + 1}" if tried else ""),
            partition_key=run[0] if len(run) == 1 else None,
            job_name=job_of_hardware[hardware_of_key(config, run[0]).name], tags=tags))
    return requests


def build_run_shards_sensor(config: BatchJobConfig, shards_jobs: dict[str, dg.UnresolvedAssetJobDefinition]):
    job_of_hardware = {hardware: job.name for hardware, job in shards_jobs.items()}

    @dg.sensor(
        jobs=list(shards_jobs.values()),
        name=config.names.run_shards_sensor_name,
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description="Run each shard of the current plan that has rows to answer until it lands (one run, one "
        "vLLM start, per hardware partition, on its job; at most partitions_per_run shards a run where set): a "
        "failed run is asked again, up to shard_attempts times per plan.",
    )
    def run_shards(context: dg.SensorEvaluationContext):
        requests = shard_requests(context.instance, config, job_of_hardware, context.log.info)
        return requests or dg.SkipReason("every shard of the current plan has landed or has a run")

    return run_shards
