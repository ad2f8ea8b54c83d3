"""A job's dataset as its declaration names it (a ``defs.yaml``'s ``dataset:``, the factory's
``DatasetSpec``), where its relative paths point, and the project and data folder they resolve in.
The engine reads a job's declaration with it too (``batchllm plan --job``), so it lives here, not in
the Dagster package."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .dataset import Columns, source_sql
from .fields import PromptFields


class DatasetSpec(BaseModel):
    """Where the prompts come from: exactly one of ``sql``, ``sql_file``, ``table``, ``parquet``."""

    model_config = ConfigDict(extra="forbid")  # a mistyped key is named, never ignored

    sql: str | None = None
    sql_file: str | None = None
    table: str | None = None
    parquet: str | None = None
    database: str | None = Field(None, description="DuckDB database the SQL or table reads (opened read-only)")
    database_built_later: bool = Field(
        False, description="the database is made after the definitions load (by another asset, job or script): "
        "a YAML job does not require it to exist when they load")
    allowed_paths: list[str] = Field(
        default_factory=list,
        description="more folders the dataset SQL may read (the database's folder and a Parquet source's are allowed)")
    id_column: str = "id"
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    max_tokens_column: str = "max_tokens"
    response_format_column: str = Field(
        "response_format",
        description='optional JSON text per row, e.g. {"choice": ["yes", "no"]}; overrides the job\'s',
    )
    prompt: PromptFields | None = Field(
        None, description="build each row's prompt from an instruction, fields (columns) and a question instead of "
                          "reading a prompt column; field_order: optimize chooses the order that shares most")

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetSpec":
        given = [k for k in ("sql", "sql_file", "table", "parquet") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"a dataset needs exactly one of sql, sql_file, table, parquet (got {given or 'none'})")
        if (self.sql or self.table) and not self.database:
            raise ValueError("a dataset given as sql or table needs a database")
        return self

    @property
    def columns(self) -> Columns:
        return Columns(self.id_column, self.prompt_column, self.messages_column, self.max_tokens_column,
                       self.response_format_column)

    def tables_read(self) -> set[str]:
        """The database tables the dataset reads (none for Parquet; an unreadable SQL file: none yet)."""
        from ..sql import tables_read

        if self.table:
            return {self.table}
        sql = self.sql
        if self.sql_file and Path(self.sql_file).is_file():
            sql = Path(self.sql_file).read_text()
        return tables_read(sql) if sql else set()

    def resolved(self, job: str, folder: Path, data: Path) -> "DatasetSpec":
        """The dataset of a job declared in ``folder`` (a ``defs.yaml``'s), its relative paths resolved:
        the SQL file against that folder, the rest against the data directory ``data``
        (``default_data_dir``). Known without running, so ``dg check defs`` names it: a SQL file that is
        not there, and a database unless it is made after the definitions load."""
        if self.sql_file and not (folder / self.sql_file).is_file():
            raise ValueError(f"job {job!r}: dataset.sql_file {self.sql_file!r} does not exist in {folder} (the folder "
                             "of its defs.yaml)")
        if self.database and not self.database_built_later and not (data / self.database).is_file():
            raise ValueError(f"job {job!r}: dataset.database {self.database!r} does not exist in {data} "
                             "(BATCHLLM_DATA_DIR, else the project's data folder); if another asset or job makes it "
                             "after the definitions load, add database_built_later: true under dataset")
        return self.model_copy(update={
            "sql_file": str(folder / self.sql_file) if self.sql_file else None,
            "parquet": str(data / self.parquet) if self.parquet else None,
            "database": str(data / self.database) if self.database else None,
            "allowed_paths": [str(data / path) for path in self.allowed_paths],
        })

    def query(self) -> tuple[str, str | None, list[str]]:
        """The dataset as one SQL query, the database it runs on and the folders it may read."""
        if self.sql:
            sql, database, allowed = self.sql, self.database, []
        else:
            sql, database, allowed = source_sql(str(self.sql_file or self.table or self.parquet), self.database)
        return sql, database, [*allowed, *self.allowed_paths]

    def describe(self) -> str:
        if self.sql_file:
            return f"sql file {self.sql_file} on {self.database or 'an in-memory DuckDB'}"
        if self.sql:
            return f"sql on {self.database}"
        if self.table:
            return f"table {self.table} of {self.database}"
        return f"parquet {self.parquet}"


def default_data_dir(project_root: Path | None = None) -> Path:
    """Where a component's databases and job files live: ``BATCHLLM_DATA_DIR`` (a relative one against
    the project), else the project's ``data`` folder (``project_root``; the working directory where no
    project is known)."""
    root = project_root or Path.cwd()
    return root / os.environ.get("BATCHLLM_DATA_DIR", "data")


def project_root(start: Path | None = None) -> tuple[Path, dict]:
    """The dg project this folder is in (its own or its nearest parent's ``pyproject.toml`` with a
    ``[tool.dg.project]``), and that table; this folder and {} where there is none."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            project = tomllib.loads(pyproject.read_text()).get("tool", {}).get("dg", {}).get("project")
            if project is not None:
                return folder, project
    return here, {}
