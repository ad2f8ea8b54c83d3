"""Run a batch on a Ray cluster: one long-lived vLLM replica per GPU (or CPU slot), prefix groups
kept whole on one replica.

The driver takes a prepared (planned) batch, cuts it into one shard per replica along the run
order without splitting a group (weighted by each replica's speed when known), and sends each
shard's prepared rows (token ids, groups, order: no tokenizer or planner on the replica) to a
replica actor, which runs them with ``run_resumable``, reusing what the caller names (the output
table's rows, other shards' checkpoints) and checkpointing finished rows to the shard's own
checkpoint folder (a path every node can reach), the one a local run of the shard writes: reuse and
pruning see them the same. A replica that dies has its sub-shard rerun on another live replica,
which resumes from the checkpoint: nothing is lost or computed twice.

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

from ..plan.prepared import PreparedBatch
from ..plan.shard_cut import split_prepared
from ..run.results import RowResult, RunStats, merge_stats
from ..settings import EngineSettings, Policy, SamplingSettings, SchedulerSettings
from .resume import RunOutcome

log = logging.getLogger(__name__)


class Placement(Policy):
    GROUPS = "groups"  # whole prefix groups per replica, balanced by cost
    ROUND_ROBIN = "round_robin"  # rows dealt one by one, as a plain data-parallel runner does


class ReplicaWorker:
    """What runs inside a Ray actor: one vLLM engine at a time, for the shards it is handed."""

    def __init__(self, replica: int, cpu_core: int | None = None):
        self.replica = replica
        if cpu_core is not None:  # replicas on one CPU machine must not bind the same cores
            from ..vllm.vllm_env import bind_cpu_threads

            bind_cpu_threads(str(cpu_core))
        from ..machine import device_name

        self.device = device_name()

    def ping(self) -> int:
        return os.getpid()

    def run_sub_shard(
        self,
        sub_shard: int,
        prepared: PreparedBatch,
        engine_settings: EngineSettings,
        sampling: SamplingSettings,
        scheduler_settings: SchedulerSettings,
        checkpoint_dir: str,
        reuse_from: list = (),
    ) -> dict:
        from .resume import run_resumable

        outcome = run_resumable(prepared, engine_settings, sampling, checkpoint_dir, scheduler_settings,
                                reuse_from=reuse_from, checkpoint_every_rows=32)
        return {"sub_shard": sub_shard, "replica": self.replica, "pid": os.getpid(), "device": self.device,
                "outcome": outcome}


@dataclass
class RayRunResult:
    outcomes: dict[int, RunOutcome]  # shard -> what its replica returned
    sub_shard_of_row: np.ndarray  # input row -> shard
    replica_of_sub_shard: dict[int, int]  # shard -> replica that finished it
    reassigned_sub_shards: list[int] = field(default_factory=list)

    @property
    def results(self) -> list[RowResult]:
        return [r for outcome in self.outcomes.values() for r in outcome.results]

    @property
    def stats_of_sub_shard(self) -> dict[int, RunStats]:
        return {s: outcome.stats for s, outcome in self.outcomes.items()}

    @property
    def prefill_tokens(self) -> int:
        return sum(stats.prefill_tokens for stats in self.stats_of_sub_shard.values())

    def merged(self) -> RunOutcome:
        """One outcome for the whole batch (the replicas ran side by side)."""
        return RunOutcome(self.results, merge_stats(list(self.stats_of_sub_shard.values())), None)


def replica_resources(node_gpus: list[float], replicas: int, tensor_parallel_size: int) -> dict:
    """What each replica asks Ray for, from the GPUs of the cluster's live nodes. A cluster with GPUs
    runs every replica on ``tensor_parallel_size`` GPUs of one node (a model split over machines
    would cross the network at every layer), or is refused with the numbers: never a silent
    fallback to CPU actors. A cluster without any GPU (the CPU build) runs a replica per CPU slot."""
    if not any(node_gpus):
        return {"num_cpus": 1}
    total, fits = sum(node_gpus), sum(int(g // tensor_parallel_size) for g in node_gpus)
    if total < replicas * tensor_parallel_size:
        raise RuntimeError(
            f"the Ray cluster has {total:g} GPUs; {replicas} replicas x tensor_parallel_size "
            f"{tensor_parallel_size} need {replicas * tensor_parallel_size}: lower ray_replicas or add GPUs"
        )
    if fits < replicas:
        raise RuntimeError(f"a replica's {tensor_parallel_size} GPUs must be on one node; the nodes have "
                           f"{sorted((int(g) for g in node_gpus if g), reverse=True)} GPUs, room for {fits} of the "
                           f"{replicas} replicas: lower ray_replicas or tensor_parallel_size")
    return {"num_gpus": tensor_parallel_size}


def gpus_of_live_nodes(nodes: list[dict]) -> list[float]:
    return [node["Resources"].get("GPU", 0.0) for node in nodes if node.get("Alive")]


def wait_for_gpu_nodes(nodes, wants_gpus: bool | None, timeout_s: float, sleep=None) -> list[float]:
    """The GPUs of the cluster's live nodes (``nodes()``: Ray's node list). A job built for GPUs
    waits up to ``timeout_s`` for a GPU node to join (an autoscaler starting one), then refuses
    with the numbers: it never runs its replicas as CPU actors."""
    import time

    sleep = sleep or time.sleep
    deadline = time.monotonic() + timeout_s
    while True:
        gpus = gpus_of_live_nodes(nodes())
        if any(gpus) or not wants_gpus:
            return gpus
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no GPU node joined the Ray cluster within {timeout_s:g}s ({len(gpus)} live nodes, "
                               f"0 GPUs): this job runs vLLM's GPU build, so its replicas need GPUs; start GPU nodes "
                               f"or raise ray_gpu_wait_s")
        sleep(5.0)


def _sub_shards(
    prepared: PreparedBatch, replicas: int, placement: Placement, weights: list[float] | None
) -> np.ndarray:
    if placement is Placement.GROUPS:
        return split_prepared(prepared, replicas, weights)
    return np.arange(prepared.num_rows) % replicas


def run_on_ray(
    prepared: PreparedBatch,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    checkpoint_dir: str | Path,
    *,
    replicas: int = 2,
    reuse_from: list = (),
    wants_gpus: bool | None = None,
    address: str | None = None,
    scheduler_settings: SchedulerSettings = SchedulerSettings(),
    placement: Placement | str = Placement.GROUPS,
    replica_weights: list[float] | None = None,
    resources_per_replica: dict | None = None,
    bind_cpu_cores: bool = False,
    actor_prefix: str = "batchllm-replica",
    max_attempts: int = 3,
    start_timeout_s: float = 900.0,
    run_timeout_s: float | None = None,
    gpu_wait_s: float = 600.0,
) -> RayRunResult:
    """Run every row of ``prepared`` on ``replicas`` Ray actors; shards are whole prefix groups,
    checkpointed to ``checkpoint_dir`` (the shard's own, as a local run), reusing ``reuse_from``
    (``run_resumable``'s) where the fingerprints hold.

    ``resources_per_replica`` defaults to ``replica_resources`` of the cluster's nodes: ``wants_gpus``
    (the job's hardware partition is a GPU's) waits up to ``gpu_wait_s`` for a GPU node, then
    refuses, never places vLLM on CPU actors; it is the job's to say, not the driver's (a driver
    without a GPU drives GPU replicas). None: whatever the cluster has. Replicas that have not
    started and answered within ``start_timeout_s`` (the cluster lacks what they ask for, an image
    pull hangs) fail the run with what they asked for, and a run whose shards are not all done
    within ``run_timeout_s`` (a hung engine) fails with what was done: never a wait forever. Its
    actors are killed however the run ends, so a retry finds their names and GPUs free.
    """
    import ray

    from ..ray_address import check_reachable

    if not ray.is_initialized():
        check_reachable(address, "backend: ray")  # an address nobody answers fails now, not after minutes
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    sub_shard_of_row = _sub_shards(prepared, replicas, Placement.parse(placement), replica_weights)
    if resources_per_replica is None:
        node_gpus = wait_for_gpu_nodes(ray.nodes, bool(wants_gpus), gpu_wait_s)
        resources_per_replica = replica_resources(node_gpus, replicas, engine_settings.tensor_parallel_size)
    actor_class = ray.remote(max_restarts=0, **resources_per_replica)(ReplicaWorker)
    actors = {
        i: actor_class.options(name=f"{actor_prefix}-{i}").remote(i, i if bind_cpu_cores else None)
        for i in range(replicas)
    }
    try:
        return _run_sub_shards(ray, prepared, engine_settings, sampling, scheduler_settings, checkpoint_dir,
                               list(reuse_from), sub_shard_of_row, actors, resources_per_replica, max_attempts,
                               start_timeout_s, run_timeout_s)
    finally:
        for actor in actors.values():
            try:
                ray.kill(actor)
            except Exception:  # already dead: nothing to free
                pass


def _run_sub_shards(ray, prepared, engine_settings, sampling, scheduler_settings, checkpoint_dir, reuse_from,
                    sub_shard_of_row, actors, resources_per_replica, max_attempts, start_timeout_s,
                    run_timeout_s) -> RayRunResult:
    import time

    replicas = len(actors)
    actors = dict(actors)  # the live ones; the caller kills every one it started
    try:
        ray.get([a.ping.remote() for a in actors.values()], timeout=start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"{replicas} replicas asking for {resources_per_replica} each did not start within "
                           f"{start_timeout_s:g}s: the cluster may not have these resources free "
                           f"(it has {ray.available_resources()})") from None
    deadline = None if run_timeout_s is None else time.monotonic() + run_timeout_s

    reuse = ray.put(reuse_from)  # one copy in the object store for every sub-shard

    def submit(shard: int, replica: int):
        part = prepared.subset(np.flatnonzero(sub_shard_of_row == shard))
        return actors[replica].run_sub_shard.remote(shard, part, engine_settings, sampling, scheduler_settings,
                                                    checkpoint_dir=str(checkpoint_dir), reuse_from=reuse)

    pending = {submit(s, s): (s, s) for s in range(replicas) if (sub_shard_of_row == s).any()}
    attempts = {s: 1 for s, _ in pending.values()}
    done: dict[int, dict] = {}
    reassigned: list[int] = []
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        if not ready:
            raise RuntimeError(f"the shard's run on Ray exceeded its {run_timeout_s:g}s (ray_shard_timeout_s): "
                               f"{len(done)} of {len(done) + len(pending)} sub-shards done, the others still running "
                               f"(a hung engine?); their finished rows are in their checkpoints for the retry")
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
    return RayRunResult(
        outcomes={s: out["outcome"] for s, out in done.items()},
        sub_shard_of_row=sub_shard_of_row,
        replica_of_sub_shard={s: out["replica"] for s, out in done.items()},
        reassigned_sub_shards=reassigned,
    )
