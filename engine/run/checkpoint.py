"""Row-level checkpoints: results are written while the engine runs, and a rerun reuses them.

A checkpoint is a folder of Parquet part files. Each part is written to a temporary name and
renamed, so a process killed at any point (SIGKILL included) leaves only whole parts behind. A row
is reused only when its fingerprint matches: the same id, the same prompt tokens, the same
max_tokens and response format, and the same answer settings (``settings_fingerprints``: the
model's content, the engine's build, dtype as resolved, sampling); anything else is recomputed.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..atomic import write_parquet
from ..digests import digest as new_digest
from ..machine import Platform, current_platform, vllm_version
from ..settings import EngineSettings, SamplingSettings, fingerprint
from .results import RESULT_SCHEMA_FIELDS, RowResult, results_to_table

log = logging.getLogger(__name__)

# Engine settings that can change an answer besides the model itself. Cache sizes and batching
# knobs are left out: on CPU (fp32) greedy answers were equal whatever the order and batch shape
# (the bench's answer_agreement, 1.0). That does not hold on a GPU: bf16 kernels depend on which
# rows share a step unless vLLM runs batch-invariant (VLLM_BATCH_INVARIANT=1); a row reused from an
# earlier night is then an answer the same model gave in another batch, not a stale one.
_ANSWER_SETTINGS = {"dtype", "enforce_eager", "seed", "max_model_len", "tensor_parallel_size"}


def settings_fingerprints(engine: EngineSettings, sampling: SamplingSettings, engine_build: str) -> tuple[str, str]:
    """What decides every row's answer besides the row itself, today's and the legacy fingerprint:
    the model's content (weights, config, tokenizer, chat template: the plan stamp's
    ``model_fingerprint``, hashed once, not its path, so a checkpoint re-exported in place reruns
    every row), the engine's build and version (``engine_build``: ``machine.vllm_version()``, given
    by the caller), the engine settings above (``engine`` as resolved for the platform by
    ``for_platform``: a CPU and a GPU run differ) and the sampling, response format included, but
    not ``max_tokens`` as typed: each row's budget as it runs (raised to its longest choice, say) is
    in its own fingerprint (``row_fingerprints``), so a setting that changes no row's budget reruns
    nothing. The legacy one is what answers were written with before it left out ``max_tokens`` as
    typed: an answer whose row fingerprint is made of it is as valid as one of today's (the same
    model, settings and row, the typed budget too), so a rerun still reuses it."""
    from ..plan.tokenizing import model_fingerprint

    relevant, model = engine.model_dump(include=_ANSWER_SETTINGS), model_fingerprint(engine.model_path)
    today = fingerprint(relevant, model, engine_build, sampling.model_dump(mode="json", exclude={"max_tokens"}))
    return today, fingerprint(relevant, model, engine_build, sampling)


def current_settings_fingerprint(engine: EngineSettings, sampling: SamplingSettings,
                                 platform: Platform | None = None) -> str:
    """Today's settings fingerprint of an engine of this machine's vLLM build on ``platform`` (this
    machine's where None): what a run there records, and what a plan compares with the answers."""
    return settings_fingerprints(engine.for_platform(platform or current_platform()), sampling, vllm_version())[0]


def row_fingerprints(prepared, settings_fp: str) -> list[str]:
    """One fingerprint per row: settings + the row's prompt tokens + its max_tokens."""
    out = []
    tokens, offsets = prepared.batch.tokens, prepared.batch.offsets
    for i in range(prepared.num_rows):
        digest = new_digest(settings_fp.encode())
        digest.update(tokens[offsets[i] : offsets[i + 1]].tobytes())
        digest.update(int(prepared.max_tokens[i]).to_bytes(8, "little"))
        digest.update(str(prepared.errors.get(i, "")).encode())
        if i in prepared.response_formats:  # the row's own constraint changes its answer
            digest.update(prepared.response_formats[i].to_text().encode())
        out.append(digest.hexdigest())
    return out


# Why a row was not reused, from what an earlier result of the same id recorded.
NEW_ROW = "new row"
SETTINGS_CHANGED = "model or answer settings changed"
ROW_CHANGED = "prompt, max_tokens or response format changed"
FAILED_BEFORE = "an error before"


_IDENTITY_COLUMNS = ["id", "status", "row_fingerprint", "settings_fingerprint"]  # what reuse reads first
_WHY_COLUMNS = ["id", "status", "settings_fingerprint"]


def _why_not_reused(previous: tuple[str, str | None] | None, settings_fps: set[str]) -> str:
    """``previous``: the (status, settings fingerprint) an earlier result of the id recorded;
    ``settings_fps``: the settings fingerprints of today's settings."""
    if previous is None:
        return NEW_ROW
    status, settings = previous
    if settings not in settings_fps:
        return SETTINGS_CHANGED
    return FAILED_BEFORE if status != "ok" else ROW_CHANGED


def checkpoint_parts(folder: Path) -> list[Path]:
    """A checkpoint folder's part files, oldest first (none: no folder yet); the one reader of the
    layout ``Checkpoint.flush`` writes."""
    return sorted(folder.glob("part-*.parquet")) if folder.exists() else []


def is_checkpoint_part(path: Path) -> bool:
    return path.name.startswith("part-") and path.suffix == ".parquet"


class Checkpoint:
    """Collects results and writes them as Parquet parts every ``every_rows`` rows or ``every_s`` s."""

    def __init__(self, folder: str | Path, id_type: pa.DataType, every_rows: int = 256, every_s: float = 10.0):
        self.folder = Path(folder)
        self.id_type = id_type
        self.every_rows, self.every_s = every_rows, every_s
        self._pending: list[RowResult] = []
        self._last_flush = time.monotonic()
        self.written = 0
        self.reused_from: dict = {}  # row id -> where load() found it
        self.not_reused: Counter[str] = Counter()  # why load() found no reusable result, rows per reason

    def load(self, expected: dict, also: list[Path | pa.Table] = (), settings_fp: str | None = None,
             legacy: dict | None = None, legacy_settings_fp: str | None = None) -> dict:
        """Reusable ok results by id: those whose fingerprint equals ``expected[id]`` (or
        ``legacy[id]``: the same row under the legacy settings fingerprint, ``legacy_settings_fp``).

        ``also`` names more results to reuse from (a previous run's output, another checkpoint's
        parts: files or tables);
        ``settings_fp`` (the current ``settings_fingerprint``) lets ``not_reused`` say why the
        other rows were not reused. Each source is read by its ids and fingerprints first; the
        answers' text only of the rows reused (after a night of failed writes every shard reads
        every other shard's checkpoint: the job's answers must not pass through each shard)."""
        parts = checkpoint_parts(self.folder)
        wanted_ids = pa.array(list(expected), self.id_type)
        wanted_fps = pa.array(list(expected.values()), pa.string())
        legacy_fps = pa.array([(legacy or {}).get(i) for i in expected], pa.string())
        reusable: dict = {}
        latest: dict = {}  # row id -> (status, settings fingerprint) of its last earlier result
        self.reused_from = {}
        for part in [*also, *parts]:
            source = "the output table" if isinstance(part, pa.Table) else (
                "checkpoint" if part in parts else f"the checkpoint {part.parent}"
                if is_checkpoint_part(part) else str(part))
            found = self._identities(part, wanted_ids)
            if found is None:
                continue
            rows, position, identities = found
            for row_id, status, settings in zip(*(identities.column(n).to_pylist() for n in _WHY_COLUMNS)):
                latest[row_id] = (status, settings)
            recorded = identities.column("row_fingerprint")
            fingerprint_holds = pc.or_kleene(pc.equal(recorded, pc.take(wanted_fps, position)),
                                             pc.equal(recorded, pc.take(legacy_fps, position)))
            same = pc.and_(pc.fill_null(fingerprint_holds, False), pc.equal(identities.column("status"), "ok"))
            chosen = pc.filter(rows, same)
            if not len(chosen):
                continue
            try:
                answers = self._read(part, chosen)
            except Exception as exc:  # damaged since its ids were read: recomputed, not trusted
                log.warning("ignoring unreadable checkpoint file %s: %s", part, exc)
                continue
            names = ["id"] + [n for n, _ in RESULT_SCHEMA_FIELDS if n in answers.column_names]
            for record in answers.select(names).to_pylist():
                row_id = record.pop("id")
                reusable[row_id] = RowResult(id=row_id, **record)
                self.reused_from[row_id] = source
        settings = {settings_fp} | ({legacy_settings_fp} if legacy_settings_fp else set())
        self.not_reused = Counter(_why_not_reused(latest.get(i), settings) for i in expected if i not in reusable)
        return reusable

    def _identities(self, part: Path | pa.Table, wanted_ids: pa.Array):
        """The rows of ``part`` whose id is wanted: their row numbers in it, their positions in
        ``wanted_ids``, and their ids, statuses and fingerprints (no text read). None: nothing
        wanted there, or nothing to reuse (an unreadable file is recomputed, not trusted)."""
        try:
            if isinstance(part, pa.Table):
                table = part.select([n for n in _IDENTITY_COLUMNS if n in part.column_names])
            else:
                present = pq.ParquetFile(part).schema_arrow.names
                table = pq.read_table(part, columns=[n for n in _IDENTITY_COLUMNS if n in present])
            if "row_fingerprint" not in table.column_names:
                return None
            ids = table.column("id").cast(self.id_type)
        except Exception as exc:
            log.warning("ignoring unreadable checkpoint file %s: %s", part, exc)
            return None
        position = pc.index_in(ids, value_set=wanted_ids)
        keep = pc.is_valid(position)
        if not pc.any(keep).as_py():
            return None
        rows = pc.filter(pa.array(range(table.num_rows), pa.int64()), keep)
        table = table.set_column(table.schema.get_field_index("id"), "id", ids).filter(keep)
        if "settings_fingerprint" not in table.column_names:
            table = table.append_column("settings_fingerprint", pa.nulls(table.num_rows, pa.string()))
        return rows, pc.filter(position, keep), table

    def _read(self, part: Path | pa.Table, rows: pa.Array) -> pa.Table:
        """Rows ``rows`` of ``part`` whole, text included: read one file's at a time."""
        table = part if isinstance(part, pa.Table) else pq.read_table(part)
        return table.take(rows).set_column(table.schema.get_field_index("id"), "id",
                                           table.column("id").take(rows).cast(self.id_type))

    def describe_reuse(self) -> str:
        """Where the reused rows came from, e.g. ``12 from the checkpoint, 3 from out.parquet``."""
        counts: dict[str, int] = {}
        for source in self.reused_from.values():
            counts[source] = counts.get(source, 0) + 1
        return ", ".join(f"{n} from {'the checkpoint ' + str(self.folder) if s == 'checkpoint' else s}"
                         for s, n in counts.items()) or "none"

    def restart_timer(self) -> None:
        """Count the time between parts from now (when rows start running, not from start-up)."""
        self._last_flush = time.monotonic()

    def add(self, result: RowResult) -> None:
        self._pending.append(result)
        if len(self._pending) >= self.every_rows:
            self.flush()
        else:
            self.flush_if_due()

    def flush_if_due(self) -> None:
        """Write what is pending once ``every_s`` has passed since the last part: called after every
        engine step too, so a row that finished minutes before the next one is on disk meanwhile."""
        if self._pending and time.monotonic() - self._last_flush >= self.every_s:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        table = results_to_table(self._pending, self.id_type)
        # Named by time, then by process: the sub-shards of a Ray run write to one folder.
        write_parquet(table, self.folder / f"part-{time.time_ns():020d}-{os.getpid()}.parquet")
        self.written += len(self._pending)
        self._pending.clear()
