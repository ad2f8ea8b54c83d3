"""A plan's stamp: what it was made from (the model's content, the prompt snapshot, the settings
that shape a plan), recorded in the plan table's metadata; a plan whose stamp no longer equals the
job's as it is now is stale, and its shards refuse to run."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from ..response_format import ResponseFormat
from ..settings import EngineSettings, SamplingSettings, SchedulerSettings, fingerprint
from ..table.dataset import Columns
from ..table.prompt_snapshot import snapshot_digest
from .tokenizing import model_fingerprint

MODEL, SNAPSHOT, SETTINGS = "batchllm.model", "batchllm.snapshot", "batchllm.settings"  # the stamp's keys
# What of the stamp decides a row's answer: not the snapshot, which changes with any row of the table.
ANSWER_STAMP_KEYS = [MODEL.encode(), SETTINGS.encode()]


@dataclass(frozen=True)
class PlanShaping:
    """The settings that shape a plan, the one list of them: a change to any makes the plan on
    disk stale (its stamp records their fingerprint), and Dagster's code version of the plan asset
    is made from them. ``context_len`` and ``block_size`` are resolved (the model's and the
    platform's), so None where not known yet (a code version, at definitions load)."""

    block_size: int | None  # where shared prefixes end (whole blocks) and the blocks each row needs
    context_len: int | None  # rows longer than this are error rows in the plan
    max_tokens: int  # each row's answer budget (its decode length in the plan)
    min_group_rows: int  # rows a prefix needs to become a group
    columns: Columns  # which columns the plan reads
    response_format: ResponseFormat | None = None  # the job's: a choice raises the budgets of its rows
    score_choices: bool | None = None  # choice rows scored: a budget of one token (None: off)

    @classmethod
    def of(cls, llm: EngineSettings, sampling: SamplingSettings, scheduler: SchedulerSettings, columns: Columns,
           resolved: bool = True) -> "PlanShaping":
        if resolved:  # the block size this machine plans in where the job sets none
            llm = llm.with_block_size()
        return cls(llm.block_size, llm.context_len if resolved else None, sampling.max_tokens,
                   scheduler.min_group_rows, columns, sampling.response_format, sampling.score_choices or None)

    def fingerprint(self) -> str:
        # In field order, values pinned; a setting that is None is left out, so that the plans made
        # before it was one keep their stamp.
        return fingerprint(*(v for f in fields(self) if (v := getattr(self, f.name)) is not None))

    @classmethod
    def described(cls) -> str:
        return "the job's " + ", ".join(f.name for f in fields(cls))


_STAMP_WHAT = {MODEL: "the model, tokenizer or chat template", SNAPSHOT: "the prompt snapshot",
               SETTINGS: PlanShaping.described()}


def plan_stamp(model_path: str, snapshot_digest: str, shaping: PlanShaping) -> dict[str, str]:
    """What a plan is made from, as it is now: the model's content (weights, config, tokenizer,
    chat template), the prompt snapshot's digest, and the settings that shape a plan."""
    assert shaping.context_len is not None, "a stamp needs the resolved context length"
    return {MODEL: model_fingerprint(model_path), SNAPSHOT: snapshot_digest, SETTINGS: shaping.fingerprint()}


def job_stamp(snapshot: Path, settings: EngineSettings, sampling: SamplingSettings, scheduler: SchedulerSettings,
              columns: Columns) -> dict[str, str]:
    """A job's plan stamp as it is now: its prompt snapshot's and the job's settings (``settings``:
    the model resolved, the block size and context length its shards run at)."""
    return plan_stamp(settings.model_path, snapshot_digest(snapshot),
                      PlanShaping.of(settings, sampling, scheduler, columns))


def stale_reasons(plan_metadata: dict[bytes, bytes] | None, stamp: dict[str, str]) -> list[str]:
    """What changed since the plan was made (empty: the plan still holds)."""
    recorded = {k.decode(): v.decode() for k, v in (plan_metadata or {}).items()}
    return [_STAMP_WHAT[k] for k, v in stamp.items() if recorded.get(k) != v]
