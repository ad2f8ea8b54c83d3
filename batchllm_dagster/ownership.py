"""Which objects of an output database a job may write: the ones it owns, and no other.

A job writes three objects there: its output table, the table ``<output_table>_prefix_groups`` and
the view ``<output_table>_with_prompts``. The first write records the owner in the object's DuckDB
comment (``batchllm-dagster job <name>``). Before any read or write of them a job refuses

* an object whose comment names another job (two jobs in one table replace each other's answers);
* an object that is not of its kind (a user's table that happens to have the name: its rows would
  be deleted); one an older version made, with no comment, is adopted when its columns are the kind's;
* from the configuration alone: an object in the dataset's own database that the dataset reads
  (the source table itself: its prompts would be replaced by answers).

The checks run when the definitions load (``dg check defs``, a code location's start) and again in
every transaction that touches the objects, so a table made after load is still never written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OWNER_PREFIX = "batchllm-dagster job "


class NotOwned(ValueError):
    """The job would write an object it does not own; the message names both and the fix."""


@dataclass(frozen=True)
class JobObject:
    name: str
    kind: str  # "answers", "groups" or "view"

    @property
    def what(self) -> str:
        return {"answers": "output table", "groups": "prefix groups table", "view": "view"}[self.kind]


# The columns that make an object made by an older version (no comment) recognizably the kind's.
_KIND_COLUMNS = {"answers": {"id", "status", "text", "partition_key"},
                 "groups": {"group", "shard", "partition_key", "prefix_tokens"}}


def job_objects(output_table: str) -> list[JobObject]:
    return [JobObject(output_table, "answers"), JobObject(f"{output_table}_prefix_groups", "groups"),
            JobObject(f"{output_table}_with_prompts", "view")]


def owner_comment(job: str) -> str:
    return f"{OWNER_PREFIX}{job}"


def _fix(job: str, output_table: str) -> str:
    return f"set output_table to a name no table of that database has (e.g. {job}_{output_table})"


def refuse_foreign_objects(con, job: str, output_table: str, database: str) -> None:
    """Raise ``NotOwned`` where one of the job's objects exists in ``con``'s database and is not the
    job's (see the module doc)."""
    for obj in job_objects(output_table):
        found = _existing(con, obj.name)
        if found is None:
            continue
        is_view, comment, columns, sql = found
        owner = comment[len(OWNER_PREFIX):] if comment and comment.startswith(OWNER_PREFIX) else None
        where = f"{'view' if is_view else 'table'} {obj.name!r} of {database}"
        if owner is not None and owner != job:
            raise NotOwned(
                f"job {job!r}: its {obj.what} would be {where}, which job {owner!r} owns: two jobs in one table "
                f"replace each other's answers; {_fix(job, output_table)}")
        if owner is None and not _of_kind(obj.kind, is_view, columns, sql):
            raise NotOwned(
                f"job {job!r}: its {obj.what} would be {where}, which this job did not make (a table of yours? "
                f"{_kind_missing(obj.kind, is_view, columns)}): writing it would replace its rows; "
                f"{_fix(job, output_table)}")


def claim(con, job: str, name: str, view: bool = False) -> None:
    """Record ``job`` as the owner of ``name`` (after ``refuse_foreign_objects`` let it through)."""
    from engine.sql import quote_identifier, quote_literal

    kind = "VIEW" if view else "TABLE"
    con.execute(f"COMMENT ON {kind} {quote_identifier(name)} IS {quote_literal(owner_comment(job))}")


def renamed_from(con, job: str, output_table: str) -> str | None:
    """The output table ``job`` owned before its ``output_table`` was renamed (one whose comment names
    the job, under another name, of the answers' kind), if the database holds one."""
    owned = [row[0] for row in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE comment = ? AND schema_name = current_schema() "
        "AND database_name = current_database()", [owner_comment(job)]).fetchall()]
    for name in owned:
        if name.lower() == output_table.lower() or f"{name}_prefix_groups".lower() == output_table.lower():
            continue
        found = _existing(con, name)
        if found is not None and _of_kind("answers", found[0], found[2], found[3]):
            return name
    return None


def _existing(con, name: str) -> tuple[bool, str | None, set[str], str | None] | None:
    """(is a view, its comment, its columns, a view's SQL) of ``name`` in the current schema, or None."""
    table = con.execute(
        "SELECT comment FROM duckdb_tables() WHERE lower(table_name) = lower(?) AND schema_name = current_schema() "
        "AND database_name = current_database()", [name]).fetchall()
    view = con.execute(
        "SELECT comment, sql FROM duckdb_views() WHERE lower(view_name) = lower(?) AND NOT internal "
        "AND schema_name = current_schema() AND database_name = current_database()", [name]).fetchall()
    if not table and not view:
        return None
    columns = {row[0].lower() for row in con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE lower(table_name) = lower(?) AND schema_name = "
        "current_schema() AND database_name = current_database()", [name]).fetchall()}
    if view:
        return True, view[0][0] or None, columns, view[0][1]
    return False, table[0][0] or None, columns, None


def _of_kind(kind: str, is_view: bool, columns: set[str], sql: str | None) -> bool:
    if kind == "view":
        return is_view and "prompt_current" in (sql or "")
    return not is_view and _KIND_COLUMNS[kind] <= columns


def _kind_missing(kind: str, is_view: bool, columns: set[str]) -> str:
    if kind == "view":
        return "it is a table" if not is_view else "it does not read this job's answers"
    if is_view:
        return "it is a view"
    return f"it lacks the columns {', '.join(sorted(_KIND_COLUMNS[kind] - columns))}"


def refuse_reading_own_output(job: str, output_table: str, output_database: str, source_database: str | None,
                              source_tables: Callable[[], set[str]]) -> None:
    """From the configuration alone: the job's objects are not tables its dataset reads in the same
    database (``table: reviews`` with ``output_table: reviews`` would replace the prompts by answers).
    ``source_tables`` is asked (the SQL parsed) only where the two databases are one file."""
    if not source_database or not _same_file(source_database, output_database):
        return
    read = {name.split(".")[-1].lower() for name in source_tables()}
    for obj in job_objects(output_table):
        if obj.name.lower() in read:
            raise NotOwned(
                f"job {job!r}: its {obj.what} {obj.name!r} is a table its dataset reads in {output_database}: "
                f"answers written there would replace the prompts; {_fix(job, output_table)}, or write the answers "
                "to a database of their own (output_database)")


def _same_file(a: str, b: str) -> bool:
    if ":memory:" in (a, b) or "://" in a or "://" in b:
        return False
    return Path(a).resolve() == Path(b).resolve()


def check_existing_objects(job: str, output_table: str, output_database: str) -> None:
    """``refuse_foreign_objects`` on the output database as it is now, read-only, where it exists
    and can be opened (a database another process is writing is checked by that write instead)."""
    import duckdb

    if ":memory:" in output_database or "://" in output_database or not Path(output_database).is_file():
        return
    try:
        con = duckdb.connect(output_database, read_only=True)
    except duckdb.Error:  # held by a writer, or opened in this process already: each write checks
        return
    try:
        refuse_foreign_objects(con, job, output_table, output_database)
    finally:
        con.close()


def owns_answers_in(job: str, output_table: str, database: str) -> bool | None:
    """Whether ``database`` holds this job's answers (owned by it, or an older version's table of
    the kind): where an older version's default put them. None: it cannot be opened now (another
    process writes it), so nobody can tell."""
    import duckdb

    try:
        con = duckdb.connect(database, read_only=True)
    except duckdb.Error:
        return None
    try:
        if _existing(con, output_table) is None:
            return False
        refuse_foreign_objects(con, job, output_table, database)
        return True
    except NotOwned:
        return False
    finally:
        con.close()


_JOB_OF_TABLE: dict[tuple[str, str], str] = {}  # (output database, table) -> the job that loaded with it


def register_in_process(job: str, output_table: str, output_database: str) -> None:
    """Two jobs of one code location (one process) that name one output table are refused when the
    second loads, before either has written (the comments catch jobs of different locations)."""
    if ":memory:" in output_database or "://" in output_database:
        return
    key = (str(Path(output_database).resolve()), output_table.lower())
    other = _JOB_OF_TABLE.setdefault(key, job)
    if other != job:
        raise NotOwned(f"jobs {other!r} and {job!r} both name output table {output_table!r} of {output_database}: "
                       f"two jobs in one table replace each other's answers; give job {job!r} its own output_table "
                       f"(e.g. {job}_answers)")


def refuse_at_load(job: str, output_table: str, output_database: str) -> None:
    """What can be known when the definitions load: an output table another job of this process
    names, or one in the database that another job or the user owns."""
    register_in_process(job, output_table, output_database)
    check_existing_objects(job, output_table, output_database)
