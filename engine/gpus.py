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
    uuid: str = ""  # "GPU-8c2f...", how CUDA_VISIBLE_DEVICES may name it

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
            uuid = ctypes.create_string_buffer(96)
            uuid_read = getattr(nvml, "nvmlDeviceGetUUID", None)
            if uuid_read is None or uuid_read(handle, uuid, ctypes.c_uint(96)) != 0:
                uuid.value = b""
            gpus.append(GPU(index, name.value.decode(errors="replace"), int(memory.total),
                            uuid.value.decode(errors="replace")))
        return gpus
    finally:
        nvml.nvmlShutdown()


@functools.cache
def gpus() -> tuple[GPU, ...]:
    """This machine's GPUs (read once)."""
    return tuple(read_gpus())


def visible(all_gpus: tuple[GPU, ...], cuda_visible_devices: str | None) -> tuple[GPU, ...]:
    """The GPUs a process started with ``CUDA_VISIBLE_DEVICES`` may use, in its order (unset: all).
    Entries are indices or UUID prefixes, as CUDA reads them: the list ends at the first that names
    no GPU ("" or "-1": none)."""
    if cuda_visible_devices is None:
        return all_gpus
    chosen: list[GPU] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        match = ([g for g in all_gpus if str(g.index) == entry] if entry.isdigit() else
                 [g for g in all_gpus if g.uuid and entry.startswith(("GPU-", "MIG-")) and g.uuid.startswith(entry)])
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return tuple(chosen)


def visible_gpus() -> tuple[GPU, ...]:
    """The GPUs this process's ``CUDA_VISIBLE_DEVICES`` leaves it (a Ray actor's, a pod's share)."""
    import os

    return visible(gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
