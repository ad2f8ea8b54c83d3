"""The libraries' own lines (torch's missing Triton, vLLM's start-up) go to the run's log file, not the console."""
import subprocess
import sys

import pytest

ROUTED_RUN = """
import sys
from pathlib import Path
from engine.vllm.library_output import import_torch, library_output_routed

with library_output_routed(Path(sys.argv[1])):
    import_torch()
    from torch._library.triton import get_inner_triton_kernels
    get_inner_triton_kernels(lambda: None)  # warns on a machine without Triton, as vLLM's start does here
print("done")
"""


@pytest.mark.slow  # imports torch in a fresh process
def test_torchs_missing_triton_line_goes_to_the_log_file_not_the_console(tmp_path):
    log = tmp_path / "run.log"
    done = subprocess.run([sys.executable, "-c", ROUTED_RUN, str(log)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "done"
    assert "Triton" not in done.stderr, done.stderr
    assert "torch._library.triton: Triton not available" in log.read_text()
