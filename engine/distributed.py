"""Run a batch on a Ray cluster: one long-lived vLLM replica per GPU (or CPU slot), prefix groups
kept whole on one replica.

The driver plans the whole batch, cuts it into one shard per replica with ``assign_shards``
(weighted by each replica's speed when known), and sends each shard's rows to a replica actor.
The actor prepares and runs them with ``run_resumable``, checkpointing finished rows to the
shard's folder (a path every node can reach). A replica that dies has its shard rerun on another
live replica, which resumes from the checkpoint: nothing is lost or computed twice.

``placement="round_robin"`` spreads rows over replicas one by one, as a plain data-parallel
runner does: every replica then pays for every prefix (kept for comparison).

Ray is an optional extra (``pip install batchllm-dagster[ray]``); this module imports it lazily.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from .dataset import Columns
from .results import RowResult
from .runner import prepare_batch
from .settings import EngineSettings, SamplingSettings, SchedulerSettings
from .shards import assign_shards

log = logging.getLogger(__name__)


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

    def run_shard(self, shard: int, rows: pa.Table, engine: dict, sampling: dict, scheduler: dict,
                  columns: dict, checkpoint_dir: str) -> dict:
        from .runner import run_resumable
        from .tokenizing import load_tokenizer

        engine_settings = EngineSettings(**engine)
        sampling_settings = SamplingSettings(**{**sampling, "stop": tuple(sampling.get("stop", ()))})
        scheduler_settings = SchedulerSettings(**scheduler)
        prepared = prepare_batch(rows, load_tokenizer(engine_settings.model_path), engine_settings,
                                 sampling_settings, Columns(**columns), scheduler_settings)
        results, stats = run_resumable(prepared, engine_settings, sampling_settings, checkpoint_dir,
                                       scheduler_settings, checkpoint_every_rows=32)
        return {
            "shard": shard,
            "replica": self.replica,
            "pid": os.getpid(),
            "hardware": self.hardware,
            "results": [asdict(r) for r in results],
            "stats": stats.to_dict(),
        }


@dataclass
class RayRunResult:
    results: list[RowResult]
    shard_of_row: np.ndarray  # input row -> shard
    replica_of_shard: dict[int, int]  # shard -> replica that finished it
    stats_of_shard: dict[int, dict] = field(default_factory=dict)
    reassigned_shards: list[int] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(s["prefill_tokens"] for s in self.stats_of_shard.values())


def _shards(prepared, replicas: int, placement: str, weights: list[float] | None) -> np.ndarray:
    if placement == "groups":
        return assign_shards(prepared.plan, replicas, weights=weights).shard_of_row
    if placement == "round_robin":
        return np.arange(prepared.num_rows) % replicas
    raise ValueError(f"placement must be 'groups' or 'round_robin', not {placement!r}")


def run_on_ray(
    table: pa.Table,
    engine_settings: EngineSettings,
    sampling: SamplingSettings,
    checkpoint_root: str | Path,
    *,
    replicas: int = 2,
    address: str | None = None,
    columns: Columns = Columns(),
    scheduler: SchedulerSettings = SchedulerSettings(),
    placement: str = "groups",
    replica_weights: list[float] | None = None,
    resources_per_replica: dict | None = None,
    bind_cpu_cores: bool = False,
    actor_prefix: str = "batchllm-replica",
    max_attempts: int = 3,
) -> RayRunResult:
    """Run every row of ``table`` on ``replicas`` Ray actors; shards are whole prefix groups.

    ``resources_per_replica`` defaults to one GPU where the cluster has GPUs, else one CPU.
    """
    import ray

    from .tokenizing import load_tokenizer

    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    prepared = prepare_batch(table, load_tokenizer(engine_settings.model_path), engine_settings, sampling, columns, scheduler)
    shard_of_row = _shards(prepared, replicas, placement, replica_weights)
    if resources_per_replica is None:
        resources_per_replica = {"num_gpus": 1} if ray.cluster_resources().get("GPU", 0) >= replicas else {"num_cpus": 1}
    actor_class = ray.remote(max_restarts=0, **resources_per_replica)(ReplicaWorker)
    actors = {
        i: actor_class.options(name=f"{actor_prefix}-{i}").remote(i, i if bind_cpu_cores else None)
        for i in range(replicas)
    }
    ray.get([a.ping.remote() for a in actors.values()])

    payload = dict(engine=asdict(engine_settings), sampling={**asdict(sampling), "stop": list(sampling.stop)},
                   scheduler=asdict(scheduler), columns=asdict(columns))

    def submit(shard: int, replica: int):
        rows = table.take(pa.array(np.flatnonzero(shard_of_row == shard)))
        folder = str(Path(checkpoint_root) / f"shard-{shard:03d}")
        return actors[replica].run_shard.remote(shard, rows, checkpoint_dir=folder, **payload)

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

    results = []
    for out in done.values():
        for record in out["results"]:
            results.append(RowResult(**{**record, "shard": out["shard"]}))
    return RayRunResult(
        results=results,
        shard_of_row=shard_of_row,
        replica_of_shard={s: out["replica"] for s, out in done.items()},
        stats_of_shard={s: out["stats"] for s, out in done.items()},
        reassigned_shards=reassigned,
    )
