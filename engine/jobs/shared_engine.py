"""One vLLM engine for several shards run one after another (a run that materializes a range of
partitions): started when the first shard that needs it asks, kept open between shards, shut down
once by its owner. Start-up (minutes on a GPU's first night: loading, compiling, graph capture) is
then paid once per run, not once per shard."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager

from ..settings import EngineSettings
from ..vllm.vllm_engine import VLLMEngine


class SharedEngine:
    """``with SharedEngine(opener) as shared:`` pass ``shared.open`` as each shard's ``engine_opener``;
    leaving the block stops vLLM (``stop_s`` says how long that took)."""

    def __init__(self, opener: Callable[[EngineSettings], ContextManager[VLLMEngine]]):
        self._opener = opener
        self._owned = contextlib.ExitStack()
        self._settings: EngineSettings | None = None
        self.engine: VLLMEngine | None = None
        self.stop_s = 0.0

    @contextlib.contextmanager
    def open(self, settings: EngineSettings) -> Iterator[VLLMEngine]:
        """The engine, started on first use; leaving this context keeps it running."""
        if self.engine is None:
            self.engine = self._owned.enter_context(self._opener(settings))
            self._settings = settings
        elif settings != self._settings:  # one engine runs one configuration: never another job's settings
            raise ValueError("a shared engine was asked for other settings than it was started with")
        yield self.engine

    def __enter__(self) -> SharedEngine:
        return self

    def __exit__(self, *exc) -> None:
        stopping = time.perf_counter()
        self._owned.close()
        self.stop_s = time.perf_counter() - stopping if self.engine is not None else 0.0
