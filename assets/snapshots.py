"""Files an asset hands to the next: the prompt snapshot and the plan, written atomically.

The plan is the contract between ``prefix_groups`` and ``completions``: one row per prompt row
with its group, shard, run position (``PreparedBatch.to_table``) and the content key that names
its token ids in the token cache, stamped with what it was made from (the model, tokenizer and
chat template; the prompt snapshot; the settings that shape a plan). A partition runs exactly those rows and refuses a plan whose stamp no longer holds.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm_dagster.config import BatchJobConfig
from engine.settings import EngineSettings, fingerprint
from engine.token_cache import CONTENT_KEY, TokenCache
from engine.tokenizing import model_fingerprint


PLAN_TOKEN_CACHE = "batchllm.token_cache"  # Parquet metadata of a plan: the token cache folder its keys point into
PLAN_RUN = "batchllm.plan_run"  # Parquet metadata of a plan: the Dagster run that made it
PLAN_RUN_TAG = "batchllm/plan_run"  # tag of a shard's run: the plan run whose shards it was queued for


def plan_run_of(plan_path: Path) -> str | None:
    """The run that made the plan on disk (None: no plan, or one made before runs were recorded)."""
    if not plan_path.exists():
        return None
    value = (pq.ParquetFile(plan_path).schema_arrow.metadata or {}).get(PLAN_RUN.encode())
    return value.decode() if value else None


def plan_content_keys(plan_path: Path) -> pa.Array | None:
    """The content keys the plan on disk names in the token cache (its partitions may be running)."""
    if not plan_path.exists() or CONTENT_KEY not in pq.ParquetFile(plan_path).schema_arrow.names:
        return None
    return pq.read_table(plan_path, columns=[CONTENT_KEY]).column(CONTENT_KEY).combine_chunks()


def plan_naming_token_cache(plan: pa.Table, content_keys: pa.ChunkedArray, token_cache_folder: Path) -> pa.Table:
    """A plan table (``PreparedBatch.to_table`` of a batch planned from the cache, without token
    ids) whose rows name their token ids by content key in the token cache: writing and reading
    2 GB of ids per million rows every night would cost more than planning."""
    table = plan.append_column(CONTENT_KEY, content_keys)
    return table.replace_schema_metadata({**(plan.schema.metadata or {}),
                                          PLAN_TOKEN_CACHE: str(token_cache_folder)})


def with_token_ids(plan_rows: pa.Table) -> pa.Table:
    """Rows of a plan with their token ids from the cache it names (error rows have none)."""
    folder = (plan_rows.schema.metadata or {}).get(PLAN_TOKEN_CACHE.encode())
    if folder is None:
        raise ValueError("not a plan written by prefix_groups: it names no token cache")
    tokens, offsets, _ = TokenCache.at(folder.decode()).lookup(plan_rows.column(CONTENT_KEY).combine_chunks())
    token_ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(tokens))
    empty = pa.scalar([], pa.large_list(pa.int32()))
    token_ids = pc.if_else(pc.is_null(plan_rows.column("error")), token_ids, empty)
    return plan_rows.append_column("token_ids", token_ids)


def read_parquet(path: Path, what: str, filters=None, columns: list[str] | None = None) -> pa.Table:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found at {path}: materialize the upstream asset first")
    return pq.read_table(path, filters=filters, columns=columns)


def snapshot_columns(path: Path, columns) -> list[str] | None:
    """The snapshot's columns a plan needs: all but the prompt text (None: the file is missing)."""
    if not path.exists():
        return None
    text = {columns.prompt, columns.messages}
    return [name for name in pq.ParquetFile(path).schema_arrow.names if name not in text]


SNAPSHOT_DIGEST = "batchllm.snapshot_digest"  # Parquet metadata of a prompt snapshot, written by prompts


def snapshot_digest(path: Path) -> str:
    """What identifies a prompt snapshot's rows: the digest ``prompts`` wrote into it (reading a
    big snapshot whole in every partition would cost seconds), else the file's."""
    recorded = (pq.ParquetFile(path).metadata.metadata or {}).get(SNAPSHOT_DIGEST.encode())
    return recorded.decode() if recorded else file_digest(path)


def file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=12)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def plan_stamp(config: BatchJobConfig, settings: EngineSettings) -> dict[str, str]:
    """What a plan is made from, as it is now (``settings``: the job's, model resolved)."""
    shaping = fingerprint(settings.block_size, settings.context_len, config.sampling.max_tokens,
                          config.scheduler.min_group_rows, config.dataset.columns)
    return {
        "batchllm.model": model_fingerprint(settings.model_path),
        "batchllm.snapshot": snapshot_digest(config.prompts_path),
        "batchllm.settings": shaping,
    }


_STAMP_WHAT = {"batchllm.model": "the model, tokenizer or chat template", "batchllm.snapshot": "the prompt snapshot",
               "batchllm.settings": "the job's block size, context, max_tokens or columns"}


def stale_plan_reasons(plan_metadata: dict[bytes, bytes] | None, stamp: dict[str, str]) -> list[str]:
    """What changed since the plan was made (empty: the plan still holds)."""
    recorded = {k.decode(): v.decode() for k, v in (plan_metadata or {}).items()}
    return [_STAMP_WHAT[k] for k, v in stamp.items() if recorded.get(k) != v]
