"""Quoting names and text into DuckDB SQL: the one place the project does it.

Column, table and file names come from users' configuration; quoted here, a name with a quote in
it is still that name and never SQL.
"""


def quote_identifier(name: str) -> str:
    """A column or table name as one identifier, its double quotes doubled."""
    return '"' + name.replace('"', '""') + '"'


def quote_qualified(name: str) -> str:
    """A possibly qualified table name (``schema.table``, ``db.schema.table``), each part quoted."""
    return ".".join(quote_identifier(part) for part in name.split("."))


def quote_literal(text: str) -> str:
    """A string literal, its single quotes doubled."""
    return "'" + text.replace("'", "''") + "'"


def tables_read(sql: str) -> set[str]:
    """The tables (and CTE names) a query reads, from DuckDB's parse tree: nothing is bound or run,
    so it needs no database. Unparsable SQL reads nothing here (running it names the error)."""
    import json

    import duckdb

    with duckdb.connect() as con:
        tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0])
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if node.get("type") == "BASE_TABLE" and node.get("table_name"):
                found.add(".".join(part for part in (node.get("schema_name"), node["table_name"]) if part))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    if not tree.get("error"):
        walk(tree.get("statements", []))
    return found
