"""Bad nights and bad config lines in a data engineer's own dg project, through the public entry
points (`dg check defs`, `batchllm-dagster run`), on real DuckDB and real vLLM (tiny model), with
``field_order: optimize``: an empty source, an id column that changed type, damaged files of the
package's own, and config lines that would write the user's or another job's table. After each,
the answers and the user's tables are as they were, byte for byte, and the next good night reuses
every answer."""

import os
import subprocess

import duckdb
import pyarrow.parquet as pq
import pytest

from .test_own_project import BIN, DEFINITIONS, PYPROJECT

pytestmark = pytest.mark.slow  # the dg CLI and real vLLM

JOB = """type: assets.BatchJobComponent
attributes:
  name: tickets
  dataset:
    table: tickets
    database: shop.duckdb
    prompt:
      instruction: Route the support ticket.
      fields: [customer, plan, region, ticket]
      question: "Team:"
      field_order: optimize
  llm: {{model_path: {model}, kv_cache_blocks: 64}}
  sampling: {{max_tokens: 4}}
  shards: 1
  hardware: [cpu]
  output_table: {output_table}
{extra}"""

TICKETS = ("SELECT i::INTEGER AS id, 'customer ' || (i % 5) AS customer, ['basic', 'pro'][1 + i % 2] AS plan, "
           "['eu', 'us', 'apac'][1 + i % 3] AS region, 'ticket text ' || i AS ticket FROM range(24) t(i)")


class Project:
    def __init__(self, root, tiny_model):
        self.root, self.model = root, tiny_model
        self.data = root / "data"
        self.defs = root / "my_batches" / "defs"
        self.defs.mkdir(parents=True)
        self.data.mkdir()
        (root / "pyproject.toml").write_text(PYPROJECT)
        (root / "my_batches" / "__init__.py").write_text("")
        (self.defs / "__init__.py").write_text("")
        (root / "my_batches" / "definitions.py").write_text(DEFINITIONS)
        (root / "home").mkdir()
        self.env = {**os.environ, "PYTHONPATH": str(root), "DAGSTER_HOME": str(root / "home"),
                    "BATCHLLM_DATA_DIR": str(self.data)}
        with duckdb.connect(str(self.shop)) as con:
            con.execute(f"CREATE TABLE tickets AS {TICKETS}")
            con.execute("CREATE TABLE orders AS SELECT i AS id, i * 10 AS amount FROM range(4) t(i)")
        self.write_job("tickets", output_table="ticket_teams")

    @property
    def shop(self):
        return self.data / "shop.duckdb"

    @property
    def job_dir(self):
        return self.data / "jobs" / "tickets"

    def write_job(self, folder: str, extra: str = "", **fields) -> None:
        (self.defs / folder).mkdir(exist_ok=True)
        (self.defs / folder / "defs.yaml").write_text(JOB.format(model=self.model, extra=extra, **fields))

    def run(self, *command, ok=True) -> subprocess.CompletedProcess:
        done = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=self.root, env=self.env,
                              capture_output=True, text=True, timeout=600)
        assert (done.returncode == 0) == ok, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    def answers(self) -> list:
        with duckdb.connect(str(self.data / "jobs" / "answers.duckdb"), read_only=True) as con:
            return con.execute("SELECT id, status, text, computed_at FROM ticket_teams ORDER BY id").fetchall()

    def users_tables(self) -> dict:
        with duckdb.connect(str(self.shop), read_only=True) as con:
            return {name: con.execute(f"SELECT * FROM {name} ORDER BY ALL").fetchall() for name in ("orders",)}

    def state(self) -> dict:
        """What a refused night must leave as it was."""
        return {"answers": self.answers(), "users": self.users_tables(),
                "snapshot": (self.job_dir / "prompts.parquet").read_bytes(),
                "field_order": (self.job_dir / "field_order.parquet").read_bytes(),
                "plan": (self.job_dir / "plan.parquet").read_bytes()}

    def prompts(self) -> dict:
        snapshot = pq.read_table(self.job_dir / "prompts.parquet", columns=["id", "prompt"])
        return dict(zip(snapshot.column("id").to_pylist(), snapshot.column("prompt").to_pylist()))


def one_line_error(said: str, *expected: str) -> str:
    """The command's error: one line holding every ``expected`` text, no traceback."""
    lines = [line for line in said.splitlines() if line.startswith("error in ")]
    assert len(lines) == 1 and all(text in lines[0] for text in expected), said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    return lines[0]


def test_bad_nights_and_bad_config_lines_cost_no_answer(tmp_path, tiny_model):
    project = Project(tmp_path / "project", tiny_model)
    assert "All definitions loaded successfully" in project.run("dg", "check", "defs").stdout
    project.run("batchllm-dagster", "run", "tickets")
    first = project.state()
    prompts = project.prompts()
    assert len(first["answers"]) == 24 and all(status == "ok" for _, status, _, _ in first["answers"])

    # An empty night: refused in one line before anything lands, the kept field order included.
    with duckdb.connect(str(project.shop)) as con:
        con.execute("CREATE TABLE tickets_saved AS SELECT * FROM tickets")
        con.execute("DELETE FROM tickets")
    said = project.run("batchllm-dagster", "run", "tickets", ok=False).stderr
    one_line_error(said, "tickets: refused to plan", "24 of the 24 answered rows", "max_removed_share")
    assert len(said.strip().splitlines()) <= 3, said
    assert project.state() | {"users": None} == first | {"users": None}

    # The id column changes type: refused naming it, both types and the two ways out.
    with duckdb.connect(str(project.shop)) as con:
        con.execute("INSERT INTO tickets SELECT * FROM tickets_saved")
        con.execute("ALTER TABLE tickets ALTER id TYPE VARCHAR")
    said = project.run("batchllm-dagster", "run", "tickets", ok=False).stderr
    one_line_error(said, "the id column 'id' is string now, and INTEGER in the output table 'ticket_teams'",
                   "cast it back in the dataset SQL", "start the job over")
    assert project.state() | {"users": None} == first | {"users": None}

    # Files the package can rebuild, damaged outside it: named, set aside, rebuilt; the source back as
    # it was gives the same prompts byte for byte and every answer is reused.
    with duckdb.connect(str(project.shop)) as con:
        con.execute("ALTER TABLE tickets ALTER id TYPE INTEGER")
    part = next((project.job_dir / "token_cache").glob("*/part-*.arrow"))
    part.write_bytes(part.read_bytes()[:100])
    plan = project.job_dir / "plan.parquet"
    plan.write_bytes(plan.read_bytes()[:200])
    said = project.run("batchllm-dagster", "run", "tickets").stderr
    assert "warning: the token cache part" in said and "warning: the previous plan" in said, said[-3000:]
    assert project.prompts() == prompts
    assert project.answers() == first["answers"]
    assert list(part.parent.glob("part-*.arrow.damaged-*")) and list(project.job_dir.glob("plan.parquet.damaged-*"))

    # Config lines that would write a table the job does not own: `dg check defs` names each.
    for output_table, expected in [("tickets", "answers written there would replace the prompts"),
                                   ("orders", "which this job did not make")]:
        project.write_job("tickets", output_table=output_table, extra="  output_database: shop.duckdb\n")
        said = project.run("dg", "check", "defs", ok=False)
        assert expected in said.stdout + said.stderr, (said.stdout + said.stderr)[-3000:]
    project.write_job("tickets", output_table="ticket_teams")
    project.write_job("tickets_again", output_table="ticket_teams")  # a second job (its own name) on the table
    text = (project.defs / "tickets_again" / "defs.yaml").read_text().replace("name: tickets", "name: tickets_again")
    (project.defs / "tickets_again" / "defs.yaml").write_text(text)
    said = project.run("dg", "check", "defs", ok=False)
    assert "jobs 'tickets' and 'tickets_again' both name output table 'ticket_teams'" in said.stdout + said.stderr
    # A misspelled nested key: named with its file and line. (dg validates one defs.yaml per component
    # type, dagster_dg_core's check_yaml keys them by type: the job is alone here.)
    (project.defs / "tickets_again" / "defs.yaml").unlink()
    project.write_job("tickets", output_table="ticket_teams")
    yaml_path = project.defs / "tickets" / "defs.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("{max_tokens: 4}", "{max_tokens: 4, score_choice: true}"))
    said = project.run("dg", "check", "defs", ok=False)
    assert "attributes.sampling.score_choice" in said.stdout and "'score_choice' was unexpected" in said.stdout, \
        said.stdout[-3000:]
    said = project.run("batchllm-dagster", "run", "tickets", ok=False)  # the same mistake, one line
    (line,) = said.stderr.strip().splitlines()[-1:]
    assert line.startswith("batchllm-dagster: the definitions did not load: ValidationError: ") and \
        "score_choice" in line and "Traceback" not in said.stderr and said.returncode == 2, said.stderr[-3000:]
    assert project.users_tables() == first["users"] and project.answers() == first["answers"]
