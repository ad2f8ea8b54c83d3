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
