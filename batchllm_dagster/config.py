"""The declaration of one batch job: dataset, model, sampling, shards, hardware, output.

Plain pydantic models, shared by the Python factory and the YAML Component.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.machine import Platform
from engine.plan.plan_stamp import PlanShaping
from engine.settings import EngineSettings, Policy, SamplingSettings, SchedulerSettings, fingerprint
from engine.table.dataset_spec import DatasetSpec, default_data_dir  # noqa: F401 (the package's names)
from engine.table.fields import PromptFields  # noqa: F401 (a job's prompt from fields, imported from here)

from .layout import HARDWARE_TAG, POOL_TAG, JobFiles, JobNames
from .shard_sizing import FIRST_NIGHT_ROWS_PER_SHARD

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_PARTITIONS = 100_000  # Dagster's guidance: at most this many partitions per asset


class Backend(Policy):
    """Where a shard's rows run."""

    LOCAL = "local"  # one vLLM engine in the step's process
    RAY = "ray"  # vLLM replicas on a Ray cluster, whole prefix groups each


# Words that name a GPU in a hardware partition's name or run tags (its GPU must then be declared).
_GPU_WORDS = {"cuda", "nvidia", "h100", "h200", "h20", "a100", "a10", "a10g", "l4", "l40", "l40s", "b200", "gb200",
              "v100", "t4", "a6000", "rtx", "mi300", "mi300x"}


class HardwarePartition(BaseModel):
    """A kind of machine the shards run on. Every run of its shards carries ``run_tags`` (what the
    deployment places runs by: dagster-k8s node selectors and GPU limits, say) and the tag
    ``batchllm/pool`` = ``pool``, which dagster.yaml's run queue limits to one run at a time."""

    model_config = ConfigDict(extra="forbid")  # a mistyped key is named, never ignored

    name: str = Field(description="letters, digits, '.', '_' or '-'; it starts the shard partition keys")
    pool: str | None = Field(None, description="runs of this hardware queue in this pool (default: inference_<name>)")
    run_tags: dict[str, str] = Field(default_factory=dict, description="tags every run of its shards carries")
    price_per_hour: float | None = Field(
        None, description="what an hour of one of its devices (a GPU; the machine on a CPU partition) costs: the "
        "plan's forecast then gives the night's cost")
    platform: Platform | None = Field(
        None, description="what its machines run vLLM on, 'cuda' or 'cpu': a plan for its shards counts in that "
        "platform's KV block size and context length wherever the plan step runs (unset: the plan step's machine's; "
        "a GPU's partition must set it, refused at load where a GPU is in sight)")

    @model_validator(mode="after")
    def _valid(self) -> "HardwarePartition":
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise ValueError(f"hardware name {self.name!r} must be letters, digits, '.', '_' or '-'")
        return self

    def gpu_named(self) -> str | None:
        """The word of its name, pool or run tags that names a GPU (``h100``, ``nvidia.com/gpu``), if any."""
        text = " ".join([self.name, self.pool or "", *self.run_tags, *self.run_tags.values()]).lower()
        return next((word for word in re.split(r"[^a-z0-9]+", text) if word in _GPU_WORDS or "gpu" in word), None)

    @property
    def is_gpu(self) -> bool:
        """Whether the partition's machines are GPUs (Ray then places replicas on GPU nodes only)."""
        return self.platform is Platform.CUDA

    @property
    def slug(self) -> str:
        """Its name in Dagster's names (jobs, pools), which take letters, digits and '_' only."""
        return re.sub(r"[^a-z0-9_]+", "_", self.name.lower()).strip("_")

    @property
    def key_prefix(self) -> str:
        """How its shards' partition keys begin (``<key_prefix>-<shard>-<digest>``; keys keep '.' and '-')."""
        return re.sub(r"[^a-z0-9_.]+", "-", self.name.lower()).strip("-") or "hw"

    @property
    def run_pool(self) -> str:
        return self.pool or f"inference_{self.slug}"

    def tags(self) -> dict[str, str]:
        return {**self.run_tags, HARDWARE_TAG: self.name, POOL_TAG: self.run_pool}


def described(text: str) -> tuple:
    """A field's description for pydantic and for Dagster's YAML schema alike (Dagster rebuilds a
    Component's top-level fields and keeps only a Resolver's description):
    ``name: Annotated[int, *described("...")] = 2``."""
    import dagster as dg

    return Field(description=text), dg.Resolver.default(description=text)


class JobSpec(BaseModel):
    """What a batch job declares, in Python (``BatchJobConfig``) and in YAML (``BatchJobComponent``)
    alike. Ranges are checked by a validator, not ``Field(ge=...)``: Dagster's YAML resolution takes
    plain fields only."""

    model_config = ConfigDict(extra="forbid")  # a mistyped key is named, never ignored

    name: Annotated[str, *described("asset key prefix and partition set name (letters, digits, _)")]
    dataset: Annotated[DatasetSpec, *described("where the prompts come from")]
    llm: Annotated[EngineSettings, *described("the model and how vLLM runs it")] = EngineSettings()
    sampling: Annotated[SamplingSettings, *described("how rows are answered")] = SamplingSettings()
    scheduler: Annotated[SchedulerSettings, *described("BatchLLM admission knobs")] = SchedulerSettings()
    shards: Annotated[int | None, *described(
        "partitions of completions (>= 1); unset: one per rows_per_shard rows, at least one per hardware "
        f"partition, at most {MAX_PARTITIONS:,} (Dagster's guidance for one asset)")] = None
    rows_per_shard: Annotated[int | None, *described(
        "rows a shard gets when shards is unset: a partition is one run, one vLLM start-up (>= 1); unset: sized "
        "from the last nights' partitions so start-up and orchestration stay at most 5% of one (first night: "
        "10,000)")] = None
    partitions_per_run: Annotated[int | None, *described(
        "at most this many shard partitions in one run, one after another on one vLLM start (>= 1); unset: every "
        "shard a night runs on a hardware partition in one run (the shard sensor's, batchllm-dagster run's, a "
        "backfill's), one vLLM start per hardware partition and night. Each partition is written and checked "
        "on its own. 1: a run, and a vLLM start, per partition")] = None
    # A name alone (`hardware: [cpu]`) is short for {name: cpu}; after validation every entry is a
    # HardwarePartition (the union is for the YAML schema, which must accept both).
    hardware: Annotated[list[str | HardwarePartition], *described(
        "hardware partitions, shards cycle over them: names ([cpu]) or {name, platform, pool, run_tags}")] = [
        HardwarePartition(name="cpu")]
    output_table: Annotated[str, *described("DuckDB table of the answers")] = "completions"
    backend: Annotated[Backend, *described(
        "'local' (vLLM in the step's process) or 'ray' (replicas on a Ray cluster)")] = Backend.LOCAL
    ray_address: Annotated[str | None, *described(
        "Ray cluster address for backend 'ray' and for tokenize_workers (None: start or join a local one)")] = None
    tokenize_workers: Annotated[int, *described(
        "Ray tasks tokenizing a night's new rows at once (>= 1): above 1, the plan step sends batches of "
        "16,384 new rows to that many workers (a local Ray of that many CPUs, or ray_address's cluster); a "
        "night of fewer than 32,768 new rows is tokenized in the step. 1: in the step's process")] = 1
    shard_attempts: Annotated[int, *described(
        "runs the shard sensor asks for one shard (or range) of a plan before it stops asking (>= 1): a run "
        "that failed (its key still held by another run, the plan changed under it, an engine error) or "
        "landed nothing is asked again on a later tick")] = 3
    ray_replicas: Annotated[
        int, *described("vLLM replicas a shard is spread over, whole prefix groups each (>= 1)")
    ] = 1
    ray_shard_timeout_s: Annotated[float | None, *described(
        "backend 'ray': fail a shard's run not done within this many seconds (None: 4 x what its hardware "
        "partition's last partitions measured for as many rows, at least 600 s; no limit before anything was "
        "measured)")] = None
    ray_gpu_wait_s: Annotated[float, *described(
        "backend 'ray' with vLLM's GPU build: how long to wait for a GPU node to join before refusing")] = 600.0
    pool: Annotated[str | None, *described(
        "Dagster pool of the inference steps (default: the hardware partition's pool when the job has one, "
        "none when several: their runs queue per hardware pool instead); dagster.yaml limits each to one")] = None
    keep_deleted_answers: Annotated[bool, *described(
        "keep the answers of prompt rows deleted at the source (history); by default they leave the output "
        "table and the shard Parquet files when the next plan no longer has their ids")] = False
    max_removed_share: Annotated[float, *described(
        "a plan that would remove the answers of more than this share of the answered rows (their ids gone from "
        "the source: an empty or truncated source, a wrong WHERE) is refused, nothing removed; removing every "
        "answer needs 1.0 (0..1)")] = 0.2
    max_error_share: Annotated[float, *described(
        "a partition whose error rows (rows that cannot run, rows vLLM refused or ended, answers cut off) are "
        "more than this share of its rows fails its error_rows_within_bound check; its ok rows are written "
        "either way (0..1)")] = 0.05
    lock_timeout_s: Annotated[float, *described(
        "how long a plan, a prompt snapshot or a shard's write waits for the job's plan lock (held while a plan "
        "is made) before failing with the holder's name (> 0)")] = 3600.0
    max_gpu_hours: Annotated[float | None, *described(
        "refuse a night whose forecast (the plan's, from the last nights' throughput) holds more device-hours "
        "than this, before any shard runs; nothing is written (None: no budget)")] = None
    review_below: Annotated[float | None, *described(
        "with sampling.score_choices: a scored answer whose probability is under this is marked in the output's "
        "needs_review column and counted in the partition's rows_for_review (0..1; None: none marked)")] = None
    min_saving_vs_ideal: Annotated[float, *described("prefix_saving check warns below this share of the ideal")] = 0.9
    schedule: Annotated[str | None, *described("cron of the nightly run (None: no schedule)")] = "0 2 * * *"

    @field_validator("hardware", mode="after")
    @classmethod
    def _partitions(cls, value: list) -> list[HardwarePartition]:
        return [HardwarePartition(name=h) if isinstance(h, str) else h for h in value]

    @model_validator(mode="after")
    def _names(self) -> "JobSpec":
        for label, value in (("name", self.name), ("output_table", self.output_table)):
            if not _IDENTIFIER.match(value):
                raise ValueError(f"{label} {value!r} must be a plain identifier (letters, digits, _)")
        if not self.hardware:
            raise ValueError("hardware needs at least one partition name")
        names = [h.name for h in self.hardware]
        if len(set(names)) != len(names):
            raise ValueError(f"hardware partition names must differ: {names}")
        platforms = {h.platform for h in self.hardware if h.platform is not None}
        if len(platforms) > 1 and (self.llm.block_size is None or self.llm.max_model_len is None):
            raise ValueError(f"hardware partitions on different platforms ({', '.join(sorted(platforms))}) share one "
                             "plan, which counts in one KV block size and context length: set llm.block_size (one "
                             "both run, e.g. 32) and llm.max_model_len")
        self._gpu_partitions_declared()
        at_least_one = (self.rows_per_shard, self.partitions_per_run)  # where set
        if (self.shards is not None and not 1 <= self.shards <= MAX_PARTITIONS) or self.ray_replicas < 1 \
                or any(value is not None and value < 1 for value in at_least_one):
            raise ValueError(f"shards must be in 1..{MAX_PARTITIONS:,}, ray_replicas, rows_per_shard and "
                             "partitions_per_run at least 1 (got "
                             f"{self.shards}, {self.ray_replicas}, {self.rows_per_shard}, {self.partitions_per_run})")
        if self.tokenize_workers < 1:
            raise ValueError(f"tokenize_workers must be at least 1 (got {self.tokenize_workers})")
        if self.shard_attempts < 1:
            raise ValueError(f"shard_attempts must be at least 1 (got {self.shard_attempts})")
        if self.lock_timeout_s <= 0:
            raise ValueError(f"lock_timeout_s must be > 0 (got {self.lock_timeout_s})")
        if self.review_below is not None and not self.sampling.scores_choice:
            raise ValueError(f"review_below: {self.review_below} marks scored answers whose probability is under it, "
                             "and this job scores none: set sampling.score_choices: true with a sampling."
                             "response_format choice, or remove review_below")
        if self.max_gpu_hours is not None and self.max_gpu_hours <= 0:
            raise ValueError(f"max_gpu_hours must be > 0 (got {self.max_gpu_hours})")
        for label in ("max_error_share", "max_removed_share", "review_below"):
            if getattr(self, label) is not None and not 0 <= getattr(self, label) <= 1:
                raise ValueError(f"{label} must be between 0 and 1 (got {getattr(self, label)})")
        return self

    def _gpu_partitions_declared(self) -> None:
        """Refuse a hardware partition that names no platform where the job says it is a GPU's: a plan
        step on a machine without one would count its rows in the CPU's 32-token blocks and 2,048
        tokens, and the GPU would run them so. Where the job sets both, the platform changes nothing.
        The machine loading the definitions is no sign (one GPU machine making the plan and running
        its shards is right as it is); a shard on another platform than its plan's is refused where
        it runs (``JobSettings.check_plan_runs_here``)."""
        if self.llm.block_size is not None and self.llm.max_model_len is not None:
            return
        for partition in (h for h in self.hardware if h.platform is None):
            why = (f"its name or run tags name a GPU ({partition.gpu_named()!r})" if partition.gpu_named()
                   else f"llm sets tensor_parallel_size {self.llm.tensor_parallel_size}"
                   if self.llm.tensor_parallel_size > 1
                   else "llm sets gpu_memory_utilization" if self.llm.gpu_memory_utilization is not None else None)
            if why:
                raise ValueError(
                    f"hardware partition {partition.name!r} names no platform, and {why}: a plan step on a machine "
                    "without a GPU would count its rows in the CPU's 32-token blocks and 2,048 tokens, and its GPU "
                    f"would run them so. Add `platform: cuda` to it (hardware: [{{name: {partition.name}, platform: "
                    "cuda}]), or `platform: cpu` where its machines have no GPU")

    @property
    def sets_shard_size(self) -> bool:
        """Whether the job sets its shards' size (``shards`` or ``rows_per_shard``): else the plan
        takes the size the last nights measured (``shard_sizing``)."""
        return self.shards is not None or self.rows_per_shard is not None

    def shard_count(self, rows: int, measured_rows_per_shard: int = FIRST_NIGHT_ROWS_PER_SHARD) -> int:
        """``shards`` when set, else derived from the batch: ~rows_per_shard rows each (the job's, else
        ``measured_rows_per_shard``: see ``shard_sizing``), every hardware partition used, never more
        partitions than Dagster's guidance for one asset."""
        if self.shards is not None:
            return self.shards
        per_shard = self.rows_per_shard or measured_rows_per_shard
        return max(len(self.hardware), min(-(-rows // per_shard), MAX_PARTITIONS))


class BatchJobConfig(JobSpec):
    """One batch job: ``{name}/prompts`` -> ``{name}/prefix_groups`` -> ``{name}/completions``."""

    output_database: str = Field(description="DuckDB database the answers go to")
    storage_dir: str = Field(description="where prompt snapshots and plans are kept")

    @model_validator(mode="after")
    def _not_the_source(self) -> "BatchJobConfig":
        from .ownership import refuse_reading_own_output

        refuse_reading_own_output(self.name, self.output_table, self.output_database, self.dataset.database,
                                  self.dataset.tables_read)
        return self

    @property
    def files(self) -> JobFiles:
        """Where the job's files and locks live (under ``storage_dir``)."""
        return JobFiles(self.name, self.storage_dir, self.lock_timeout_s)

    @property
    def names(self) -> JobNames:
        """The job's names in Dagster: asset keys, partitions, jobs, sensors, pools, resource keys."""
        return JobNames(self.name)

    @property
    def inference_pool(self) -> str | None:
        """The op-level pool: one step at a time, for runs and UI backfills alike. With several
        hardware partitions there is none (it would serialize them); their runs queue per pool."""
        if self.pool:
            return self.pool
        return self.hardware[0].run_pool if len(self.hardware) == 1 else None

    @property
    def plan_platform(self) -> Platform | None:
        """The platform the job's hardware partitions declare (None: none declares one)."""
        return next((h.platform for h in self.hardware if h.platform is not None), None)

    def runs_for(self, shards: int) -> int:
        """The runs (each one vLLM start) that ``shards`` shards of one hardware partition take in a night."""
        if not shards:
            return 0
        return 1 if self.partitions_per_run is None else -(-shards // self.partitions_per_run)

    def devices_per_engine(self, hardware: HardwarePartition) -> int:
        """The devices a run on ``hardware`` holds: its GPUs (``tensor_parallel_size`` per replica, times
        ``ray_replicas`` on Ray), or its one machine on a CPU partition."""
        if not hardware.is_gpu:
            return self.ray_replicas if self.backend is Backend.RAY else 1
        return self.llm.tensor_parallel_size * (self.ray_replicas if self.backend is Backend.RAY else 1)

    def hardware_of_shard(self, shard: int) -> HardwarePartition:
        """Shards are bound to hardware partitions round-robin."""
        return self.hardware[shard % len(self.hardware)]

    # Code versions: where each asset's settings live, so that Dagster marks what is downstream of a
    # changed setting stale in the UI (with the data versions prompts and prefix_groups report).
    def prompts_code_version(self) -> str:
        sql_file = Path(self.dataset.sql_file) if self.dataset.sql_file else None
        sql_text = sql_file.read_text() if sql_file is not None and sql_file.is_file() else None
        # Whether the database is made after load cannot change a prompt: not in the version.
        return fingerprint(self.dataset.model_dump(mode="json", exclude={"database_built_later"}), sql_text)

    def plan_shaping(self, settings: EngineSettings | None = None) -> PlanShaping:
        """The settings that shape this job's plan: with ``settings`` (the job's, model resolved) as
        its stamp records them, else as declared (the model's context length not yet known)."""
        return PlanShaping.of(settings or self.llm, self.sampling, self.scheduler, self.dataset.columns,
                              resolved=settings is not None)

    def plan_code_version(self) -> str:
        # The model settings whole (their context length is resolved only with the model), what
        # shapes the plan, and the shards.
        return fingerprint(self.llm, self.plan_shaping().fingerprint(), self.shards, self.rows_per_shard,
                           self.hardware)

    def completions_code_version(self) -> str:
        # review_below only where set: versions made before it existed still hold.
        return fingerprint(self.llm, self.sampling, self.scheduler, self.backend, self.ray_replicas,
                           self.keep_deleted_answers, *([self.review_below] if self.review_below is not None else []))
