"""A watch on vLLM's engine core for when this process dies without closing the engine.

With the core in its own process (a GPU's default) vLLM 0.32 leaves it running if its parent is
killed (SIGKILL, the OOM killer, a pod's hard stop): it keeps the GPU's memory, and the next shard
on the node fails to start. ``watch_core`` starts a small process that waits for this one to go,
then kills the core (whose tensor-parallel workers exit with it, on their own death pipes). When
the engine is closed normally the watch ends once the core has exited."""

from __future__ import annotations

import os
import subprocess
import sys

_WATCH = """
import os, signal, sys, time
parent, cores = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
while os.getppid() == parent and any(alive(p) for p in cores):
    time.sleep(0.5)
for pid in cores:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def core_pids(llm_engine) -> list[int]:
    """The pids of vLLM's engine core processes ([]: the core runs in this process)."""
    resources = getattr(getattr(llm_engine, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", []) if p.pid]


def watch_core(llm_engine) -> subprocess.Popen | None:
    """Start the watch of this engine's core processes, if they are processes of their own."""
    pids = core_pids(llm_engine)
    if not pids:
        return None
    return subprocess.Popen([sys.executable, "-c", _WATCH, str(os.getpid()), *map(str, pids)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
