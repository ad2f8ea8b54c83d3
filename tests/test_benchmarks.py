"""The one-off scripts of ``benchmarks/`` keep working as the code moves: every name one imports from
the packages exists, and every stage ``plan_memory.py`` counts its peak under is a name that runs."""

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"engine", "batchllm_dagster", "assets", "dagster_project"}
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def _imports(script: Path) -> list[tuple[str, str | None]]:
    """(module, name) of each import of the packages in ``script``, function-level ones too."""
    found = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in PACKAGES:
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] in PACKAGES]
    return found


def test_every_name_a_benchmark_imports_from_the_packages_exists():
    missing = []
    for script in SCRIPTS:
        for module_name, name in _imports(script):
            module = importlib.import_module(module_name)
            if name is not None and not hasattr(module, name) and importlib.util.find_spec(
                    f"{module_name}.{name}") is None:
                missing.append(f"{script.name}: {module_name}.{name}")
    assert missing == []


def test_every_stage_plan_memory_counts_is_a_name_that_runs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        plan_memory = importlib.import_module("plan_memory")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    gone = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in
            plan_memory.plan_stages() + plan_memory.prompts_stages() if not hasattr(owner, name)]
    assert gone == []
