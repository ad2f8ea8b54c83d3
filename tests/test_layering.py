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
                      "def f():\n    from dagster_project import x\n    import engine.plan.prefix_tree\n")
    assert _imports(module) == {"typing", "dagster_project", "engine"}


# engine/ as the stages a row walks; each may import only the ones before it (the root modules,
# settings and what the machine has, are the base of all).
ENGINE_STAGES = ["table", "plan", "run", "vllm", "jobs", "bench", "cli"]


def _stage(path: Path) -> int:
    parts = path.relative_to(ROOT / "engine").parts
    return ENGINE_STAGES.index(parts[0]) + 1 if len(parts) > 1 else 0


def _engine_imports(path: Path) -> set[int]:
    """The stages (0: the root modules) a module of engine/ imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(ROOT).parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - node.level + 1]
            parts = base + (node.module.split(".") if node.module else [])
        elif node.module and node.module.split(".")[0] == "engine":
            parts = node.module.split(".")
        else:
            continue
        found.add(ENGINE_STAGES.index(parts[1]) + 1 if len(parts) > 2 and parts[1] in ENGINE_STAGES else 0)
    return found


def test_engine_stages_import_only_the_stages_before_them():
    wrong = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        stage = _stage(path)
        for imported in sorted(_engine_imports(path)):
            if imported > stage:
                wrong.append(f"{path.relative_to(ROOT)} imports engine/{ENGINE_STAGES[imported - 1]}")
    assert wrong == []


def test_the_stage_checker_resolves_relative_imports(tmp_path):
    assert _engine_imports(ROOT / "engine" / "run" / "batch_run.py") >= {0, 2}  # settings, the plan stage
    assert 4 not in _engine_imports(ROOT / "engine" / "run" / "batch_run.py")  # the run stage knows no vLLM


# A function longer than this says in its docstring why it is (a decorator's closures, an order
# that is the point); the rest are cut into steps a reader can name.
MAX_FUNCTION_LINES = 60


def _long_functions_without_a_reason(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
            and "over 60 lines" not in " ".join((ast.get_docstring(node) or "").lower().split())]


def test_no_function_is_over_60_lines_without_saying_why():
    wrong = [f"{path.relative_to(ROOT)}: {name}" for package in LAYERS + ["benchmarks"]
             for path in sorted((ROOT / package).rglob("*.py")) for name in _long_functions_without_a_reason(path)]
    assert wrong == []


def test_the_length_checker_reads_the_reason(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    module = tmp_path / "m.py"
    module.write_text(f"def long():\n{body}\ndef explained():\n    '''Over 60 lines: the order is the point.'''\n"
                      f"{body}")
    assert _long_functions_without_a_reason(module) == ["long (61 lines)"]
