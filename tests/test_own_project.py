"""A data engineer's own Dagster project, set up as the README's "In your own project" says: a dg
project folder, a job scaffolded and filled in, `dg check defs`, `dg launch` of its plan, and
`batchllm-dagster run` for every shard; no demo file, no dagster.yaml."""

import os
import subprocess
from pathlib import Path

import duckdb
import pytest

from .conftest import ROOT

pytestmark = pytest.mark.slow  # the dg CLI and real vLLM

BIN = ROOT / ".venv" / "bin"


def readme_file(marker: str) -> str:
    """A file the README's "In your own project" writes with ``cat > FILE <<'MARKER'``: the test
    builds the project from the README's own text, so the two cannot drift apart."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## In your own project"):]
    start = section.index(f"<<'{marker}'\n") + len(f"<<'{marker}'\n")
    return section[start:section.index(f"\n{marker}\n", start) + 1]


PYPROJECT = readme_file("TOML")
DEFINITIONS = readme_file("PY")


def test_a_project_of_ones_own_set_up_from_the_readme_answers_every_row(tmp_path, tiny_model):
    project = tmp_path / "my_project"
    (project / "my_batches" / "defs").mkdir(parents=True)
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "my_batches" / "__init__.py").write_text("")
    (project / "my_batches" / "defs" / "__init__.py").write_text("")
    (project / "my_batches" / "definitions.py").write_text(DEFINITIONS)
    env = {**os.environ, "PYTHONPATH": str(project), "DAGSTER_HOME": str(tmp_path / "home"),
           "BATCHLLM_DATA_DIR": str(project / "data")}
    (tmp_path / "home").mkdir()

    def run(*command):
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    run(str(BIN / "dg"), "scaffold", "defs", "assets.BatchJobComponent", "nightly")
    job = project / "my_batches" / "defs" / "nightly"
    # Before the database exists, `dg check defs` names it (and the way out for one made later).
    early = subprocess.run([str(BIN / "dg"), "check", "defs"], cwd=project, env=env, capture_output=True, text=True,
                           timeout=600)
    assert early.returncode != 0
    assert "dataset.database 'my_warehouse.duckdb' does not exist" in early.stdout + early.stderr
    # Filled in as the template says: the database, the SQL, the model.
    (project / "data").mkdir()
    with duckdb.connect(str(project / "data" / "my_warehouse.duckdb")) as con:
        con.execute("CREATE TABLE my_prompt_table AS SELECT i AS id, 'Question ' || i || ': what is ' || i || "
                    "' plus one?' AS prompt FROM range(12) t(i)")
    text = (job / "defs.yaml").read_text().replace("max_tokens: 32", "max_tokens: 4")
    (job / "defs.yaml").write_text(text.replace("model_path: smollm2",
                                                f"model_path: {tiny_model}\n    kv_cache_blocks: 64"))
    assert "All definitions loaded successfully" in run(str(BIN / "dg"), "check", "defs")
    run(str(BIN / "dg"), "launch", "--job", "nightly_plan")
    said = run(str(BIN / "batchllm-dagster"), "run", "nightly", "--shards-only")
    assert "nightly: 2 shards landed in 1 run, 1 succeeded" in said  # one run, one vLLM start
    # A line per shard and a total, from each partition's metadata.
    shard_lines = [line for line in said.splitlines() if line.startswith("  cpu-")]
    assert len(shard_lines) == 2 and all(" computed, 0 reused, 0 errors), " in line and " rows/s, " in line
                                         and "wall " in line for line in shard_lines), said
    assert "  total: 12 rows (12 computed, 0 reused, 0 errors), " in said
    # The run's console is the job's: vLLM's and the other libraries' own lines are in its log file.
    # Not our shard lines, nor the night's (``night_log``: "HH:MM:SS shard ...: ...", which name vLLM's start and KV).
    night = [line for line in said.splitlines() if line[:2].isdigit() and line[2:3] == ":"]
    assert any(line.endswith("starting") for line in night) and any(": done, " in line for line in night), said
    libraries = "\n".join(line for line in said.splitlines() if not line.startswith("  ") and line not in night)
    assert " vllm" not in libraries.lower().replace("vllm replicas", "") and "ResourceWarning" not in said
    logs = sorted((Path(os.environ["BATCHLLM_CACHE_DIR"]) / "logs").glob("nightly-*.log"), key=os.path.getmtime)
    assert "vllm" in logs[-1].read_text().lower()
    with duckdb.connect(str(project / "data" / "jobs" / "answers.duckdb"), read_only=True) as con:  # the default
        answers = con.execute("SELECT count(*), count(DISTINCT id), count(*) FILTER (WHERE status = 'ok') "
                              "FROM nightly_completions").fetchall()[0]
    assert answers == (12, 12, 12)
    # Nothing left to run: a second call asks for no shard.
    assert "nightly: 0 runs" in run(str(BIN / "batchllm-dagster"), "run", "nightly", "--shards-only")
