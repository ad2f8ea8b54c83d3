"""The machine's NVIDIA GPUs, read from NVML (the driver's management library) without torch.

Asking torch (``torch.cuda.is_available()``, ``get_device_name``) creates a CUDA context in the
calling process; vLLM then forks its workers (tensor parallel > 1) or its engine core, and a forked
child of a process with a CUDA context dies ("Cannot re-initialize CUDA in forked subprocess").
NVML answers the same questions with no CUDA context, as vLLM's own platform detection does
(``vllm/platforms/__init__.py: cuda_platform_plugin``). No NVML (a CPU machine): no GPUs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass

NVML_LIBRARY = "libnvidia-ml.so.1"  # installed with the NVIDIA driver


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_bytes: int  # 0 where NVML does not report it (a MIG-enabled parent)
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


@contextlib.contextmanager
def _nvml_session(nvml=None):
    """The NVML library initialized for the block (``nvml``: loaded here by default), or None
    without NVML or a driver that answers."""
    nvml = nvml if nvml is not None else _load_nvml()
    if nvml is None or nvml.nvmlInit_v2() != 0:
        yield None
        return
    try:
        yield nvml
    finally:
        nvml.nvmlShutdown()


def _devices(nvml):
    """(index, handle, memory) of each GPU NVML sees; memory None where NVML will not report it (a
    MIG-enabled parent does not: the GPU is there all the same, and the node is a GPU node)."""
    count = ctypes.c_uint(0)
    if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return
    for index in range(count.value):
        handle, memory = ctypes.c_void_p(), _Memory()
        if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            continue
        yield index, handle, memory if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0 else None


def read_gpus(nvml=None) -> list[GPU]:
    """The GPUs NVML sees (``nvml``: the library, loaded here by default); [] without NVML or a
    driver that answers."""
    with _nvml_session(nvml) as session:
        if session is None:
            return []
        gpus = []
        for index, handle, memory in _devices(session):
            name = ctypes.create_string_buffer(96)
            if session.nvmlDeviceGetName(handle, name, ctypes.c_uint(96)) != 0:
                continue
            uuid = ctypes.create_string_buffer(96)
            uuid_read = getattr(session, "nvmlDeviceGetUUID", None)
            if uuid_read is None or uuid_read(handle, uuid, ctypes.c_uint(96)) != 0:
                uuid.value = b""
            gpus.append(GPU(index, name.value.decode(errors="replace"), int(memory.total) if memory else 0,
                            uuid.value.decode(errors="replace")))
        return gpus


def free_memory(nvml=None) -> dict[int, int]:
    """Each GPU's free memory now, in bytes (another process's share is not free)."""
    with _nvml_session(nvml) as session:
        return {} if session is None else {index: int(memory.free) for index, _, memory in _devices(session)
                                           if memory is not None}


def nvml_cuda_driver_version(nvml=None) -> tuple[int, int] | None:
    """The newest CUDA version the installed driver runs (NVML: 12040 is 12.4); None without one."""
    with _nvml_session(nvml) as session:
        version = ctypes.c_int(0)
        read = getattr(session, "nvmlSystemGetCudaDriverVersion_v2", None) if session is not None else None
        if read is None or read(ctypes.byref(version)) != 0 or version.value <= 0:
            return None
        return version.value // 1000, version.value % 1000 // 10


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
        if entry.startswith("MIG-"):  # a MIG slice of a GPU: one device to CUDA (NVML lists its parent)
            chosen.append(GPU(-1, f"MIG slice {entry}", 0, entry))
            continue
        match = ([g for g in all_gpus if str(g.index) == entry] if entry.isdigit() else
                 [g for g in all_gpus if g.uuid and entry.startswith("GPU-") and g.uuid.startswith(entry)])
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return tuple(chosen)


def visible_gpus() -> tuple[GPU, ...]:
    """The GPUs this process's ``CUDA_VISIBLE_DEVICES`` leaves it (a Ray actor's, a pod's share)."""
    import os

    return visible(gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
