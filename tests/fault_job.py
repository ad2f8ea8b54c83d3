"""A Dagster batch job run in a child process, so a test can SIGKILL it mid-partition.

    python -m tests.fault_job CONFIG.json      (DAGSTER_HOME must be set)
"""

import json
import sys

import dagster as dg

from assets import build_batch_defs
from batchllm_dagster import BatchJobConfig


def completions_and_plan(config: BatchJobConfig):
    defs = build_batch_defs(config)
    graph = defs.resolve_asset_graph()
    assets = [
        graph.assets_def_for_key(dg.AssetKey([config.name, n])) for n in ("prompts", "prefix_groups", "completions")
    ]
    return assets


def main(path: str) -> None:
    config = BatchJobConfig(**json.loads(open(path).read()))
    assets = completions_and_plan(config)
    instance = dg.DagsterInstance.get()
    assert dg.materialize(assets[:2], instance=instance).success
    (partition,) = instance.get_dynamic_partitions(config.names.partitions_name)
    print(f"partition {partition}", flush=True)
    dg.materialize([assets[2]], partition_key=partition, instance=instance)


if __name__ == "__main__":
    main(sys.argv[1])
