"""The machine's NVIDIA GPUs, read from NVML (the driver's management library) without torch.

Asking torch (``torch.cuda.is_available()``, ``get_device_name``) creates a CUDA context in the
calling process; vLLM then forks its workers (tensor parallel > 1) or its engine core, and a forked
child of a process with a CUDA context dies ("Cannot re-initialize CUDA in forked subprocess").
NVML answers the same questions with no CUDA context, as vLLM's own platform detection does
(``vllm/platforms/__init__.py: cuda_platform_plugin``). No NVML (a CPU machine): no GPUs.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

NVML_LIBRARY = "libnvidia-ml.so.1"  # installed with the NVIDIA driver


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_bytes: int

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _load_nvml():
    """The NVML library, or None where there is none."""
    try:
        return ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return None


def read_gpus(nvml=None) -> list[GPU]:
    """The GPUs NVML sees (``nvml``: the library, loaded here by default); [] without NVML or a
    driver that answers."""
    nvml = nvml if nvml is not None else _load_nvml()
    if nvml is None or nvml.nvmlInit_v2() != 0:
        return []
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        gpus = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            name = ctypes.create_string_buffer(96)
            memory = _Memory()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)) != 0
                    or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0):
                continue
            gpus.append(GPU(index, name.value.decode(errors="replace"), int(memory.total)))
        return gpus
    finally:
        nvml.nvmlShutdown()


@functools.cache
def gpus() -> tuple[GPU, ...]:
    """This machine's GPUs (read once)."""
    return tuple(read_gpus())
