"""The packages depend one way: engine <- batchllm_dagster <- assets <- dagster_project.

Every import counts, function-level ones too (a late import only hides a cycle); imports under
``if TYPE_CHECKING:`` never run and are skipped."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["engine", "batchllm_dagster", "assets", "dagster_project"]  # each may import only those before it
THIRD_PARTY_BANNED = {"engine": {"dagster", "dagster_duckdb", "dagster_dg_cli"}}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_packages_import_only_the_layers_below_them():
    wrong = []
    for rank, package in enumerate(LAYERS):
        forbidden = set(LAYERS[rank + 1:]) | THIRD_PARTY_BANNED.get(package, set())
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in sorted(_imports(path) & forbidden):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_the_checker_sees_late_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import assets\n"
                      "def f():\n    from dagster_project import x\n    import engine.plan\n")
    assert _imports(module) == {"typing", "dagster_project", "engine"}
