"""`make test-fast` stays fast by rule: an unmarked test over the limit fails there, a marked one does not."""
from pathlib import Path

pytest_plugins = ["pytester"]

SLOW_AND_UNMARKED = """
import time
import pytest

def test_unmarked():
    time.sleep(0.2)

@pytest.mark.slow
def test_marked():
    time.sleep(0.2)

def test_quick():
    pass
"""


def test_an_unmarked_test_over_the_limit_fails_the_fast_suite_and_names_the_mark(pytester, monkeypatch):
    monkeypatch.setenv("BATCHLLM_FAST_TEST_LIMIT_S", "0.1")
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers = slow: slow\n")
    pytester.makepyfile(test_timing=SLOW_AND_UNMARKED)
    fast = pytester.runpytest_inprocess("-m", "not slow")
    fast.assert_outcomes(passed=1, failed=1, deselected=1)
    fast.stdout.fnmatch_lines(["*test_unmarked took * s without the `slow` mark*"])
    everything = pytester.runpytest_inprocess()  # the full suite does not time its tests
    everything.assert_outcomes(passed=3)
