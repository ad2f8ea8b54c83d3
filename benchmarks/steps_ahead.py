"""Preemptions on the stand-in when the engine runs steps ahead of the reports read (vLLM's core in
its own process), with the scheduler counting them from the engine's queue and ignoring them.

    PYTHONPATH=. python benchmarks/steps_ahead.py

The nested shape of ``tests/test_scheduler.py`` (8 documents of 6 rows, answers of 9 tokens) on a
cache of 40 blocks of 4 tokens; the scheduler is told of no step ahead at its start.
"""

import numpy as np

from engine.run.drive import StepTotals, drive
from engine.run.scheduler import GroupScheduler
from engine.run.stand_in import BlockAccountingEngine
from engine.settings import SamplingSettings, SchedulerSettings
from tests.test_scheduler import BLOCK, nested_batch


class QueueIgnored(BlockAccountingEngine):
    """The same engine, its queue not read."""

    def step(self):
        report = super().step()
        report.queued_steps = 0
        return report


def run(engine_class, ahead: int) -> tuple[int, int]:
    batch, groups = nested_batch(documents=8, rows_per_document=6, system_blocks=2, document_blocks=2, own_tokens=4)
    engine = engine_class(40, BLOCK, steps_ahead=ahead, says_queued=True)
    scheduler = GroupScheduler(batch, np.full(len(batch.lengths), 9), groups, SchedulerSettings(), BLOCK, 40)
    list(drive(scheduler, engine, SamplingSettings(), StepTotals()))
    return engine.preemptions, engine.step_count


if __name__ == "__main__":
    for ahead in (0, 1, 2, 3):
        print(f"{ahead} steps ahead: counted from the queue (preemptions, steps) {run(BlockAccountingEngine, ahead)}, "
              f"ignored {run(QueueIgnored, ahead)}")
