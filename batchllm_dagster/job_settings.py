"""What a job's declared settings resolve to where a step runs: the model's checkpoint, the KV block
size and context length its plan counts in, the settings a shard runs at, the stamp a shard compares
with its plan's, and the refusal of a shard on another platform than the one its plan counted for.
``BatchJobConfig`` declares; this resolves (it reads the model's files and asks the machine)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.machine import Platform, current_platform
from engine.models import resolve_model
from engine.plan.plan_stamp import job_stamp
from engine.settings import EngineSettings

from .config import Backend, BatchJobConfig


@dataclass(frozen=True)
class JobSettings:
    """``JobSettings(config)``: the job's settings, resolved on this machine."""

    config: BatchJobConfig

    @property
    def counts_for(self) -> Platform:
        """The platform whose defaults the plan counts in where the job sets none: the one its hardware
        partitions declare, else the plan step's machine's."""
        return self.config.plan_platform or current_platform()

    def plan(self) -> EngineSettings:
        """What the job's plan counts in: ``llm`` with its model resolved and the KV block size and
        context length the job sets, else those of the platform it counts for (``counts_for``): never
        the plan step's own machine where the shards declare another (a plan made on a CPU pod for GPU
        shards counts in the GPU's 16 and the model's own length)."""
        llm = self._model_resolved()
        resolved = llm.for_platform(self.counts_for)
        return llm.model_copy(update={"block_size": resolved.block_size, "max_model_len": resolved.max_model_len})

    def plan_context(self):
        """The context length the plan counts in and where it comes from (``EngineSettings.context``)."""
        return self._model_resolved().context(self.counts_for)

    def engine(self, planned: dict[str, int] | None = None) -> EngineSettings:
        """``llm`` with its model (a built-in name or a path) resolved to a checkpoint directory and
        its KV block size set: the job's, else the plan's, else this platform's default. ``planned``:
        what the plan counts in (``plan_table.PlanFile.counts``): a shard runs at its block size and
        context length where the job sets none, whatever machine made the plan."""
        llm = self._model_resolved()
        unset = {name: value for name, value in (planned or {}).items() if getattr(llm, name) is None}
        return llm.model_copy(update=unset).with_block_size()

    def stamp(self, settings: EngineSettings) -> dict[str, str]:
        """The job's plan stamp as it is now (``settings``: the job's, model resolved): the model's
        content, the prompt snapshot, and the settings that shape a plan (``plan_stamp.job_stamp``)."""
        config = self.config
        return job_stamp(config.files.prompts_path, settings, config.sampling, config.scheduler,
                         config.dataset.columns)

    def check_plan_runs_here(self, counted_for: str | None) -> None:
        """Refuse a shard on a platform other than the one whose defaults its plan counted in (a CPU
        pod's plan of a partition that names no platform, run on a GPU, would give every row the CPU's
        blocks and 2,048 tokens). None: a plan from before it was recorded. A Ray job's engines run on
        its replicas' nodes, which its hardware's ``platform`` places (``wants_gpus``): not checked here."""
        config, here = self.config, current_platform()
        if counted_for in (None, here.value) or config.backend is Backend.RAY or (
                config.llm.block_size is not None and config.llm.max_model_len is not None):
            return  # on Ray the engines run on the cluster's nodes, not on this driver's
        undeclared = [h.name for h in config.hardware if h.platform is None]
        fix = (f"add `platform: {here.value}` to hardware partition {', '.join(map(repr, undeclared))}" if undeclared
               else f"declare the platform its hardware partitions run on ({here.value} here)")
        raise ValueError(f"the plan of {config.name!r} counted in {counted_for}'s KV blocks and context length, but "
                         f"this shard runs on {here.value}: {fix} in the job's YAML (or set llm.block_size and "
                         "llm.max_model_len), then materialize prefix_groups again")

    def _model_resolved(self) -> EngineSettings:
        return self.config.llm.model_copy(update={"model_path": resolve_model(self.config.llm.model_path)})
