"""What Dagster is told of a job's three assets, in one place (as dagster-sling's translator does for
its tables): key, upstream, group, description, kinds, pool, resources and code version. The asset
modules add what is theirs alone (partitions, checks, op tags)."""

from __future__ import annotations

from .config import BatchJobConfig

_UPSTREAM = {"prompts": None, "prefix_groups": "prompts", "completions": "prefix_groups"}


def asset_args(config: BatchJobConfig, asset: str, code_version: str) -> dict:
    """``dg.asset``'s arguments for ``asset`` (``prompts``, ``prefix_groups`` or ``completions``) of
    ``config``; ``code_version``: the fingerprint of the settings that asset uses (``BatchJobConfig``'s
    ``<asset>_code_version``), passed by the asset so that each reads only its own."""
    names = config.names
    upstream = _UPSTREAM[asset]
    if asset == "prompts":
        description = f"Prompt rows of batch job {config.name!r} ({config.dataset.describe()}), snapshotted to Parquet."
        kinds, pool = {"duckdb", "parquet"}, None
    elif asset == "prefix_groups":
        description = "Prefix groups found over the whole batch, and the shard (partition) each belongs to."
        kinds, pool = {"duckdb"}, names.plan_pool
    else:
        description = (f"One answer per prompt row, in DuckDB table {config.output_table!r} (and one Parquet file "
                       "per shard under the job's completions/ folder); a partition per shard.")
        kinds, pool = {"vllm", "duckdb"}, config.inference_pool
    return {
        "key": names.asset_key(asset),
        **({"deps": [names.asset_key(upstream)]} if upstream else {}),
        "group_name": config.name,
        "description": description,
        "kinds": kinds,
        **({"pool": pool} if pool else {}),
        # every asset reads or writes the output database; completions also runs the model
        "required_resource_keys": {names.warehouse_key, *(["llm"] if asset == "completions" else [])},
        "code_version": code_version,
    }


def warehouse(config: BatchJobConfig, context):
    """The job's output database in a step (``<name>_warehouse``: dagster-duckdb's resource, or
    whatever a deployment binds to that key)."""
    return getattr(context.resources, config.names.warehouse_key)
