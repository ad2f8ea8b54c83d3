"""The GPUs an engine of this process runs on: claimed on the node, for the life of the process.

vLLM runs on the first ``tensor_parallel_size`` GPUs its process sees. Two runs side by side on an
8-GPU node (a pool that lets several runs of a hardware partition go at once) both started on GPU 0,
and the second failed vLLM's free-memory check while seven GPUs idled. Each engine start now claims
GPUs no other process on the node holds (a kernel file lock per GPU, named by its UUID, released
when the process dies however it dies), the ones with the most free memory first, and shows vLLM
only those (``CUDA_VISIBLE_DEVICES``). A Ray actor or a pod sees only its own GPUs already: it
claims those, uncontended."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .gpus import GPU
from .locks import Busy, held_alone

log = logging.getLogger(__name__)

CLAIMS_DIR_ENV = "BATCHLLM_GPU_CLAIMS_DIR"  # node-local; the default is under the system's temp folder
CLAIM_WAIT_S = 600.0  # how long a start waits for GPUs other runs hold before it fails


class GPUsBusy(RuntimeError):
    """Fewer GPUs than the engine needs are free of other runs' claims; the message names them."""


class GPUClaims:
    """This process's claimed GPUs (one claim per process: a second engine start reuses it, as the
    engine's processes were spawned seeing those GPUs)."""

    def __init__(self, folder: Path | None = None, wait_s: float = CLAIM_WAIT_S, poll_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.folder = folder or Path(os.environ.get(CLAIMS_DIR_ENV) or Path(tempfile.gettempdir()) / "batchllm-gpus")
        self.wait_s, self.poll_s, self._clock, self._sleep = wait_s, poll_s, clock, sleep
        self.held: tuple[GPU, ...] = ()
        self._locks = contextlib.ExitStack()

    def claim(self, count: int, candidates: Sequence[GPU], holder: str) -> tuple[GPU, ...]:
        """``count`` of ``candidates`` (in order of preference) that no other process holds, held
        until this process ends; waits up to ``wait_s`` while other runs hold them."""
        if self.held:
            if len(self.held) != count:
                raise GPUsBusy(f"this process holds {len(self.held)} GPU(s) for its engine, and a second engine asks "
                               f"for {count}: run engines of another tensor_parallel_size in their own process")
            return self.held
        if len(candidates) < count:
            raise GPUsBusy(f"tensor_parallel_size {count} needs {count} GPUs; this process may use "
                           f"{len(candidates)}: lower it or give the process more")
        deadline, said = self._clock() + self.wait_s, False
        while not (got := self._try(count, candidates, holder)):
            if self._clock() >= deadline:
                raise GPUsBusy(f"waited {self.wait_s:g} s for {count} of this node's {len(candidates)} GPUs, all held "
                               f"by other runs ({self._holders(candidates)}): let fewer runs of this pool go at once "
                               f"(at most {len(candidates) // count} on this node)")
            if not said:
                log.info("waiting for %d GPU(s): every one this process may use is held by another run (%s)", count,
                         self._holders(candidates))
                said = True
            self._sleep(self.poll_s)
        self.held = got
        return got

    def _try(self, count: int, candidates: Sequence[GPU], holder: str) -> tuple[GPU, ...]:
        taken, locks = [], contextlib.ExitStack()
        for gpu in candidates:
            try:
                locks.enter_context(held_alone(self._path(gpu), holder, f"GPU {_name(gpu)}"))
            except Busy:
                continue
            taken.append(gpu)
            if len(taken) == count:
                self._locks.enter_context(locks.pop_all())
                return tuple(taken)
        locks.close()
        return ()

    def _path(self, gpu: GPU) -> Path:
        return self.folder / f"{_name(gpu)}.lock"

    def _holders(self, candidates: Sequence[GPU]) -> str:
        texts = []
        for gpu in candidates:
            try:
                texts.append(f"{_name(gpu)}: {self._path(gpu).read_text().strip() or '?'}")
            except OSError:
                texts.append(f"{_name(gpu)}: ?")
        return "; ".join(texts)


def _name(gpu: GPU) -> str:
    """How the GPU is named in its claim and in ``CUDA_VISIBLE_DEVICES``: its UUID (one physical GPU
    whatever a process's own numbering), else its index."""
    return gpu.uuid or str(gpu.index)


def cuda_visible_devices(claimed: Sequence[GPU]) -> str:
    return ",".join(_name(gpu) for gpu in claimed)


def by_free_memory(visible: Sequence[GPU], free_bytes: dict[int, int]) -> list[GPU]:
    """The GPUs in order of preference: the most free memory first (another team's process on a GPU
    holds no claim, but its memory is not free), then by index."""
    return sorted(visible, key=lambda gpu: (-free_bytes.get(gpu.index, gpu.memory_bytes), gpu.index))


PROCESS_CLAIMS = GPUClaims()


def claim_for_engine(count: int) -> tuple[GPU, ...]:
    """Claim ``count`` GPUs for this process's engine and show vLLM only those (``CUDA_VISIBLE_DEVICES``,
    read by the processes it spawns)."""
    from .gpus import free_memory, visible_gpus

    visible = visible_gpus()
    claimed = PROCESS_CLAIMS.claim(count, by_free_memory(visible, free_memory()), holder=f"pid {os.getpid()}")
    os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(claimed)
    log.info("GPUs claimed for this engine: %s (of %d this process may use)",
             ", ".join(f"{gpu.index} {gpu.name}" for gpu in claimed), len(visible))
    return claimed
