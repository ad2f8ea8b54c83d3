"""The lines an on-call engineer reads while a night runs: the plan's forecast, each shard's start and
end, its progress every few seconds. Said in the Dagster run's log (``context.log``) and on the Python
logger ``batchllm.night``, which ``batchllm-dagster run`` prints as they come (its runs are in its own
process); a run the daemon launched has them in its log alone."""

from __future__ import annotations

import logging

NIGHT = logging.getLogger("batchllm.night")
NIGHT.propagate = False  # printed only where a command asks for them: the run's log has them already
NIGHT.addHandler(logging.NullHandler())


def say(log, line: str) -> None:
    """``line`` in the run's log (``log``: a step's ``context.log``) and on ``batchllm.night``."""
    log.info(line)
    NIGHT.info(line)
