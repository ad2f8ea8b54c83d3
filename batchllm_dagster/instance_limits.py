"""What a Dagster instance adds to a batch job: queueing. Correctness never rests on it (the
package's own locks hold one run per partition key and one plan per job in any instance), but
without these limits a second plan or a second shard of one GPU fails or waits instead of
queueing, and two shards of one GPU may start together. A run on an instance without them says
so once, with the lines to add."""

from __future__ import annotations

from .layout import PLAN_TAG, POOL_TAG

RUN_TAGS = (POOL_TAG, PLAN_TAG)

DAGSTER_YAML = """concurrency:
  pools:
    default_limit: 1                  # one inference step per op pool (per GPU)
  runs:
    tag_concurrency_limits:
      - {key: batchllm/pool, value: {applyLimitPerUniqueValue: true}, limit: 1}
      - {key: batchllm/plan, value: {applyLimitPerUniqueValue: true}, limit: 1}"""


def missing_limits(instance) -> list[str]:
    """The limits of ``DAGSTER_YAML`` the instance lacks, in words (empty: it has them all)."""
    config = instance.get_concurrency_config()
    limits = config.run_queue_config.tag_concurrency_limits if config.run_queue_config else []
    limited = {limit.get("key") for limit in limits if limit.get("limit") == 1}
    missing = [f"a run-tag limit of 1 per value of {tag}" for tag in RUN_TAGS if tag not in limited]
    if config.pool_config.default_pool_limit != 1:
        missing.append("a default op pool limit of 1")
    return missing


def warn_if_unlimited(context) -> None:
    """Log, once per run, what the instance lacks and the ``dagster.yaml`` lines that add it."""
    missing = missing_limits(context.instance)
    if missing:
        context.log.warning(
            f"this Dagster instance lacks {' and '.join(missing)}: runs of one GPU or one plan are not queued "
            f"(the package's locks still allow one run per partition and one plan per job). Add to its "
            f"dagster.yaml:\n{DAGSTER_YAML}")
