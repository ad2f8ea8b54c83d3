"""Tokenizing a night's new rows where the cores are: Ray tasks over batches of rows.

Tokenizing is nearly all of a first night's plan step (94-97% of it: docs/scale.md). With
``tokenize_workers: N`` above 1, batches of new rows go to N Ray tasks at a time (a local Ray of N CPUs,
or the job's ``ray_address`` cluster), each loading the tokenizer once per worker process, tokenizing
and hashing its batch with one thread (N workers, not N times the tokenizer's own thread pool) and
writing its entries as a part of the token cache itself (the cache's folder must be one the workers
reach: a shared volume on a cluster); what comes back, in the batches' order with at most 2 x N batches
in flight, is the task's result (its counts). A night with fewer new rows than ``min_rows`` (a rerun's
few changed rows) is tokenized in the process: starting Ray costs seconds. """

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class TokenizeWorkers:
    count: int = 1
    ray_address: str | None = None  # None: a local Ray of ``count`` CPUs
    min_rows: int = 32_768  # fewer new rows than this: tokenized in the calling process

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"tokenize_workers must be at least 1 (got {self.count})")

    def check_reachable(self) -> None:
        """Fail at once where workers would wait on a cluster nobody answers for (``ray_address``)."""
        if self.count > 1:
            from ..ray_address import check_reachable

            check_reachable(self.ray_address, f"tokenize_workers: {self.count}")

    def used_for(self, rows: int) -> int:
        """How many workers tokenize ``rows`` new rows (1: this process)."""
        return self.count if self.count > 1 and rows >= self.min_rows else 1

    def map(self, batches: Iterator[pa.Table], model_path: str, work: Callable, *args) -> Iterator:
        """``work(batch, tokenizer, *args)`` of every batch, in the batches' order, on Ray tasks
        (``token_cache.written_by_worker``: the entries written where the worker runs)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=self.ray_address, num_cpus=self.count if self.ray_address is None else None,
                     ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
        task = ray.remote(num_cpus=1)(_in_worker)
        in_flight: deque = deque()
        for batch in batches:
            if len(in_flight) >= 2 * self.count:
                yield ray.get(in_flight.popleft())
            in_flight.append(task.remote(batch, model_path, work, *args))
        while in_flight:
            yield ray.get(in_flight.popleft())


def _in_worker(batch: pa.Table, model_path: str, work: Callable, *args):
    return work(batch, _worker_tokenizer(model_path), *args)


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(model_path: str):
    """The tokenizer, once per worker process; one thread each: the workers are the parallelism."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from .tokenizing import load_tokenizer

    return load_tokenizer(model_path)
