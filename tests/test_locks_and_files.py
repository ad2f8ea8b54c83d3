"""The package's file locks and files published whole."""

import pytest


def test_a_lock_wait_past_its_timeout_fails_naming_the_holder(tmp_path):
    import threading

    from engine.locks import Busy, locked

    path = tmp_path / "plan.lock"
    with locked(path, holder="a plan being made (run abc, pid 7)"):
        with pytest.raises(Busy, match=r"waited 0.3 s for the plan lock, held by a plan being made \(run abc, pid 7\)"):
            with locked(path, shared=True, timeout_s=0.3, what="the plan lock"):
                pass
    with locked(path, shared=True, timeout_s=0.3):  # released: taken at once, and shared by readers
        with locked(path, shared=True, timeout_s=0.3):
            pass
    # A waiter gets the lock as soon as the holder lets go.
    got = threading.Event()

    def wait_for_it():
        with locked(path, timeout_s=5):
            got.set()

    with locked(path, holder="holder"):
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        assert not got.wait(0.3)
    waiter.join(5)
    assert got.is_set()


def test_a_staging_file_a_crash_left_is_removed_by_the_next_writer_of_its_target(tmp_path):
    """An hour-old ``.NAME.PID.partial`` of a process that is gone is a crash's leftover; a fresh one,
    or one of a live process, may still be written (another container on a shared volume): kept."""
    import os
    import time

    from engine.atomic import LEFTOVER_AGE_S, write_text

    target = tmp_path / "plan.parquet"
    dead = subprocess_pid_that_has_exited()
    old, fresh, alive = (tmp_path / f".plan.parquet.{pid}.partial" for pid in (dead, dead + 1, os.getppid()))
    for path in (old, fresh, alive):
        path.write_text("half a file")
    long_ago = time.time() - LEFTOVER_AGE_S - 60
    os.utime(old, (long_ago, long_ago))
    os.utime(alive, (long_ago, long_ago))
    other_target = tmp_path / ".other.parquet.1.partial"
    other_target.write_text("x")
    write_text("whole", target)
    assert target.read_text() == "whole"
    assert not old.exists() and fresh.exists() and alive.exists() and other_target.exists()


def subprocess_pid_that_has_exited() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
