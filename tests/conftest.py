import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("BATCHLLM_CACHE_DIR", str(ROOT / ".cache"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from engine.models import resolve_model

    return resolve_model("tiny")


def make_prompt_table(seed: int = 0, documents: int = 6, questions: int = 4, singles: int = 6) -> pa.Table:
    """Plain and chat rows with nested shared prefixes, in a shuffled order."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. Answer in one short sentence. " * 6
    ids, prompts, messages = [], [], []
    for d in range(documents):
        document = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"]) for _ in range(60))
        for q in range(questions):
            ids.append(f"doc{d}-q{q}")
            prompts.append(f"{system}\nDocument {d}: {document}\nQuestion {q}: what is word {q * 3 + d}?")
            messages.append(None)
    for s in range(singles):
        ids.append(f"chat{s}")
        prompts.append(None)
        messages.append(json.dumps([{"role": "system", "content": system},
                                    {"role": "user", "content": f"Say something about number {s}."}]))
    order = list(range(len(ids)))
    rng.shuffle(order)
    return pa.table({"id": [ids[i] for i in order], "prompt": [prompts[i] for i in order],
                     "messages": [messages[i] for i in order]})


@pytest.fixture
def prompt_parquet(tmp_path) -> Path:
    path = tmp_path / "prompts.parquet"
    pq.write_table(make_prompt_table(), path)
    return path


def group_rows(plan, group: int):
    """The rows of one group of a ``PrefixPlan``, in run order."""
    starts = plan.group_starts()
    return plan.order[starts[group] : starts[group + 1]]


@pytest.fixture
def nightly(tmp_path, tiny_model):
    """A job of two shards on two hardware partitions over a DuckDB table of ``make_prompt_table``."""
    import shutil

    import duckdb

    from batchllm_dagster import BatchJobConfig, DatasetSpec, EngineSettings, SamplingSettings

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    database = tmp_path / "warehouse.duckdb"
    with duckdb.connect(str(database)) as con:
        con.register("incoming", make_prompt_table())
        con.execute("CREATE TABLE prompt_rows AS SELECT * FROM incoming")
    return BatchJobConfig(
        name="nightly",
        dataset=DatasetSpec(table="prompt_rows", database=str(database)),
        llm=EngineSettings(model_path=str(model), kv_cache_blocks=64),
        sampling=SamplingSettings(max_tokens=6),
        shards=2,
        hardware=["pool-a", "pool-b"],  # shard 0 runs on one, shard 1 on the other
        output_database=str(database),
        output_table="answers",
        storage_dir=str(tmp_path / "jobs"),
    )


# `make test-fast` stays fast by rule, not by hope: there a test without the `slow` mark that runs
# longer than this fails, naming the mark. Only where slow tests are left out (`-m "not slow"`): the
# full suite's timing on a machine twice as slow is not a fault of the test.
FAST_TEST_LIMIT_S = float(os.environ.get("BATCHLLM_FAST_TEST_LIMIT_S", "5"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.passed or item.get_closest_marker("slow"):
        return
    if "not slow" in (item.config.option.markexpr or "") and report.duration > FAST_TEST_LIMIT_S:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {report.duration:.1f} s without the `slow` mark: mark it "
                           f"@pytest.mark.slow or make it faster (make test-fast allows {FAST_TEST_LIMIT_S:g} s "
                           "a test)")


def prepared_of(rows: list[list[int]], order, groups, prefix):
    """A prepared batch of token rows (row 1 an error row), for tests that need one without a plan."""
    import numpy as np

    from engine.plan.prepared import PreparedBatch
    from engine.plan.tokenizing import TokenizedBatch

    batch = TokenizedBatch.from_rows(rows)
    return PreparedBatch(ids=[f"r{i}" for i in range(len(rows))], id_type=pa.string(), batch=batch,
                         max_tokens=np.full(len(rows), 4), errors={1: "bad"}, order=np.asarray(order),
                         group_of_row=np.asarray(groups), prefix_tokens_of_row=np.asarray(prefix), block_size=2)
