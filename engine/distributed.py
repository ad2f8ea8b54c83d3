"""Run a batch on a Ray cluster: one long-lived vLLM replica per GPU (or CPU slot), prefix groups
kept whole on one replica.

The driver takes a prepared (planned) batch, cuts it into one shard per replica along the run
order without splitting a group (weighted by each replica's speed when known), and sends each
shard's prepared rows (token ids, groups, order: no tokenizer or planner on the replica) to a
replica actor, which runs them with ``run_resumable``, checkpointing finished rows to the
shard's folder (a path every node can reach). A replica that dies has its shard rerun on another
live replica, which resumes from the checkpoint: nothing is lost or computed twice.

``placement="round_robin"`` spreads rows over replicas one by one, as a plain data-parallel
runner does: every replica then pays for every prefix (kept for comparison).

Ray is an optional extra (``pip install batchllm-dagster[ray]``); this module imports it lazily.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .prepared import PreparedBatch
from .results import RowResult, RunStats, merge_stats
from .resume import RunOutcome
from .settings import EngineSettings, Policy, SamplingSettings, SchedulerSettings
from .shards import split_prepared

log = logging.getLogger(__name__)


class Placement(Policy):
    GROUPS = "groups"  # whole prefix groups per replica, balanced by cost
    ROUND_ROBIN = "round_robin"  # rows dealt one by one, as a plain data-parallel runner does


class ReplicaWorker:
    """What runs inside a Ray actor: one vLLM engine at a time, for the shards it is handed."""

    def __init__(self, replica: int, cpu_core: int | None = None):
        self.replica = replica
        if cpu_core is not None:  # replicas on one CPU machine must not bind the same cores
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core)
        from .vllm_env import hardware_name

        self.hardware = hardware_name()

    def ping(self) -> int:
        return os.getpid()

    def run_shard(self, shard: int, prepared: PreparedBatch, engine_settings: EngineSettings, sampling: SamplingSettings,
                  scheduler_settings: SchedulerSettings, checkpoint_dir: str) -> dict:
        from .resume import run_resumable

        outcome = run_resumable(prepared, engine_settings, sampling, checkpoint_dir, scheduler_settings,
                                checkpoint_every_rows=32)
        for result in outcome.results:
            result.shard = shard
        return {"shard": shard, "replica": self.replica, "pid": os.getpid(), "hardware": self.hardware,
                "outcome": outcome}


@dataclass
class RayRunResult:
    outcomes: dict[int, RunOutcome]  # shard -> what its replica returned
    shard_of_row: np.ndarray  # input row -> shard
    replica_of_shard: dict[int, int]  # shard -> replica that finished it
    reassigned_shards: list[int] = field(default_factory=list)

    @property
    def results(self) -> list[RowResult]:
        return [r for outcome in self.outcomes.values() for r in outcome.results]

    @property
    def stats_of_shard(self) -> dict[int, RunStats]:
        return {s: outcome.stats for s, outcome in self.outcomes.items()}

    @property
    def prefill_tokens(self) -> int:
        return sum(stats.prefill_tokens for stats in self.stats_of_shard.values())

    def merged(self) -> RunOutcome:
        """One outcome for the whole batch (the replicas ran side by side)."""
        return RunOutcome(self.results, merge_stats(list(self.stats_of_shard.values())), None)


def replica_resources(node_gpus: list[float], replicas: int, tensor_parallel_size: int) -> dict:
    """What each replica asks Ray for, from the GPUs of the cluster's live nodes. A cluster with GPUs
    runs every replica on ``tensor_parallel_size`` GPUs of one node (a model split over machines
    would cross the network at every layer), or is refused with the numbers: never a silent
    fallback to CPU actors. A cluster without any GPU (the CPU build) runs a replica per CPU slot."""
    if not any(node_gpus):
        return {"num_cpus": 1}
    total, fits = sum(node_gpus), sum(int(g // tensor_parallel_size) for g in node_gpus)
    if total < replicas * tensor_parallel_size:
        raise RuntimeError(f"the Ray cluster has {total:g} GPUs; {replicas} replicas x tensor_parallel_size "
                           f"{tensor_parallel_size} need {replicas * tensor_parallel_size}: lower ray_replicas or add GPUs")
    if fits < replicas:
        raise RuntimeError(f"a replica's {tensor_parallel_size} GPUs must be on one node; the nodes have "
                           f"{sorted((int(g) for g in node_gpus if g), reverse=True)} GPUs, room for {fits} of the "
                           f"{replicas} replicas: lower ray_replicas or tensor_parallel_size")
    return {"num_gpus": tensor_parallel_size}


def _shards(prepared: PreparedBatch, replicas: int, placement: Placement, weights: list[float] | None) -> np.ndarray:
    if placement is Placement.GROUPS:
        return split_prepared(prepared, replicas, weights)
    return np.arange(prepared.num_rows) % replicas


def run_on_ray(
    prepared: PreparedBatch,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    checkpoint_root: str | Path,
    *,
    replicas: int = 2,
    address: str | None = None,
    scheduler_settings: SchedulerSettings = SchedulerSettings(),
    placement: Placement | str = Placement.GROUPS,
    replica_weights: list[float] | None = None,
    resources_per_replica: dict | None = None,
    bind_cpu_cores: bool = False,
    actor_prefix: str = "batchllm-replica",
    max_attempts: int = 3,
    start_timeout_s: float = 900.0,
) -> RayRunResult:
    """Run every row of ``prepared`` on ``replicas`` Ray actors; shards are whole prefix groups.

    ``resources_per_replica`` defaults to ``replica_resources`` of the cluster's nodes. Replicas that
    have not started and answered within ``start_timeout_s`` (the cluster lacks what they ask for,
    an image pull hangs) fail the run with what they asked for, instead of waiting forever.
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    shard_of_row = _shards(prepared, replicas, Placement.parse(placement), replica_weights)
    if resources_per_replica is None:
        node_gpus = [node["Resources"].get("GPU", 0.0) for node in ray.nodes() if node.get("Alive")]
        resources_per_replica = replica_resources(node_gpus, replicas, engine_settings.tensor_parallel_size)
    actor_class = ray.remote(max_restarts=0, **resources_per_replica)(ReplicaWorker)
    actors = {
        i: actor_class.options(name=f"{actor_prefix}-{i}").remote(i, i if bind_cpu_cores else None)
        for i in range(replicas)
    }
    try:
        ray.get([a.ping.remote() for a in actors.values()], timeout=start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        for actor in actors.values():
            ray.kill(actor)
        raise RuntimeError(f"{replicas} replicas asking for {resources_per_replica} each did not start within "
                           f"{start_timeout_s:g}s: the cluster may not have these resources free "
                           f"(it has {ray.available_resources()})") from None

    def submit(shard: int, replica: int):
        part = prepared.subset(np.flatnonzero(shard_of_row == shard))
        folder = str(Path(checkpoint_root) / f"shard-{shard:03d}")
        return actors[replica].run_shard.remote(shard, part, engine_settings, sampling, scheduler_settings, checkpoint_dir=folder)
    pending = {submit(s, s): (s, s) for s in range(replicas) if (shard_of_row == s).any()}
    attempts = {s: 1 for s, _ in pending.values()}
    done: dict[int, dict] = {}
    reassigned: list[int] = []
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        shard, replica = pending.pop(ready[0])
        try:
            done[shard] = ray.get(ready[0])
            log.info("shard %d finished on replica %d", shard, replica)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
            actors.pop(replica, None)
            if not actors or attempts[shard] >= max_attempts:
                raise RuntimeError(f"shard {shard} failed on replica {replica} and no replica is left: {exc}") from exc
            # The busy replicas' shards are in flight; the least loaded live replica takes this one.
            load = {r: sum(1 for _, rr in pending.values() if rr == r) for r in actors}
            spare = min(load, key=load.get)
            log.warning("replica %d died running shard %d; rerunning it on replica %d", replica, shard, spare)
            attempts[shard] += 1
            reassigned.append(shard)
            pending[submit(shard, spare)] = (shard, spare)
    for actor in actors.values():
        ray.kill(actor)

    return RayRunResult(
        outcomes={s: out["outcome"] for s, out in done.items()},
        shard_of_row=shard_of_row,
        replica_of_shard={s: out["replica"] for s, out in done.items()},
        reassigned_shards=reassigned,
    )
