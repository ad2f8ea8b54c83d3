"""The README's Layout table is the code's: one row per module of the packages, none of a module that
is gone, each row short enough to read."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["engine", "batchllm_dagster", "assets", "dagster_project"]


def _layout_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ")]


def test_the_layout_table_names_every_module_and_no_other():
    listed = {m.group(1) for row in _layout_rows() if (m := re.match(r"\| `([\w/]*\w)` \|", row))}
    modules = {str(path.relative_to(ROOT).with_suffix("")) for package in PACKAGES
               for path in (ROOT / package).rglob("*.py") if path.name != "__init__.py"}
    assert sorted(modules - listed) == [], "modules the README's Layout table does not list"
    assert sorted(listed - modules) == [], "modules the README's Layout table lists that are gone"


def test_the_layout_tables_rows_are_short():
    long = [row[:60] for row in _layout_rows() if len(row) >= 200]
    assert long == []
