"""How vLLM is started on this platform: its process environment and its engine arguments.

Pure functions of the settings and the platform (no vLLM import), so that a test can check what a
GPU machine gets without a GPU. Environment values are defaults only: what the user exported wins.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..machine import CACHE_ROOT
from ..settings import EngineSettings, Platform

# The vLLM release whose internals the engine drives (``renderer.render_cmpl``, the V1 stat logger);
# the ``cpu`` and ``gpu`` extras of pyproject.toml pin it (a test checks they agree).
VLLM_SERIES = "0.32"


# vLLM's own KV block size where none is given: its CPU platform sets 128
# (``CpuPlatform.check_and_update_config``), every other platform takes ``CacheConfig.DEFAULT_BLOCK_SIZE``.
VLLM_DEFAULT_BLOCK_SIZE = {Platform.CPU: 128, Platform.CUDA: 16}


SOCKET_PATH_LIMIT = 107  # bytes of a Unix socket path (sun_path is 108 with the NUL)


def socket_paths_fit(base: str | Path) -> bool:
    """Whether vLLM's IPC sockets under ``base`` (``ipc://<base>/<uuid4>``) fit the Unix limit."""
    return len(f"ipc://{base}/") + 36 <= SOCKET_PATH_LIMIT


def rpc_base_path(cache_root: Path) -> Path:
    """Where vLLM puts its IPC sockets: under the cache when they fit the Unix socket path limit,
    else a short folder of the user's in the temporary directory (a deep pod mount would make
    every socket path too long)."""
    import tempfile

    under_cache = cache_root / "rpc"
    if socket_paths_fit(under_cache):
        return under_cache
    return Path(tempfile.gettempdir()) / f"batchllm-rpc-{os.getuid()}"


# What a GPU run needs of vLLM's environment, and why (``process_env`` sets it; ``doctor`` names a
# user's value that overrides it). The engine core in its own process: its scheduling, input
# preparation and detokenizing overlap the GPU's work and ours. Started by spawn, never fork: a
# forked child of a process that touched CUDA cannot use it.
REQUIRED_ON_CUDA = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": ("1", "runs vLLM's engine core in this process, beside the scheduler, "
                                            "instead of its own"),
    "VLLM_WORKER_MULTIPROC_METHOD": ("spawn", "forks workers, which cannot use CUDA once the parent touched it"),
}


def process_env(settings: EngineSettings, platform: Platform, cores: int | None = None) -> dict[str, str]:
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # Compiled code (torch.compile's and Inductor's: vLLM points TORCHINDUCTOR_CACHE_DIR inside it
        # itself); CUDA graphs are captured again at every start. Keep it on a persistent volume.
        "VLLM_CACHE_ROOT": str(CACHE_ROOT / "vllm"),
        "VLLM_RPC_BASE_PATH": str(rpc_base_path(CACHE_ROOT)),
        "TOKENIZERS_PARALLELISM": "true",
        # vLLM logs to stdout by default; keep stdout for results (``--json``).
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    }
    if platform is Platform.CUDA:
        env.update({name: value for name, (value, _) in REQUIRED_ON_CUDA.items()})
    if platform is Platform.CPU:
        # One process: the engine starts in seconds, and ran faster (README, Configuration notes).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        cores = cores or os.cpu_count() or 1
        # vLLM's default leaves a core to the frontend, which in one process idles (README, Configuration notes).
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{cores - 1}" if cores > 1 else "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kv_cache_gib)
    return env


def configure(settings: EngineSettings, platform: Platform) -> None:
    for key, value in process_env(settings, platform).items():
        os.environ.setdefault(key, value)
    Path(os.environ["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True, mode=0o700)


def bind_cpu_threads(cores: str) -> None:
    """Bind the CPU build's threads of the engines this process starts to ``cores`` (``"3"``,
    ``"0-7"``): replicas on one CPU machine must not bind the same ones (``configure`` keeps it)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores


def run_batch_invariant() -> None:
    """The engines this process starts run vLLM's batch-invariant kernels (CUDA's Triton kernels):
    an answer then does not depend on the rows it shared a step with."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"


def engine_args(
    settings: EngineSettings, platform: Platform, *, enable_prefix_caching: bool = True, max_num_seqs: int | None = None
) -> dict:
    """Keyword arguments of ``vllm.EngineArgs`` for these settings on this platform."""
    settings.check_runs_on(platform)
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
    if platform is Platform.CUDA and not resolved.enforce_eager and args["max_num_seqs"]:
        # vLLM captures decode graphs up to 512 rows on an H100/H200 (``_set_cudagraph_sizes``), while
        # its offline batch is 1,024: every decode step of 513-1,024 rows would run eager. Capture
        # what the engine runs, one fixed size per job and node (the compile hash stays one).
        args["compilation_config"] = {"max_cudagraph_capture_size": args["max_num_seqs"]}
    if platform is Platform.CPU:  # the small CPU models load in a second: no loading bar between ours
        args["use_tqdm_on_load"] = False
    return args


def check_vllm_version(installed: str) -> None:
    """Refuse a vLLM whose internals differ from the ones the engine was written against."""
    series = ".".join(installed.split("+")[0].split(".")[:2])
    if series != VLLM_SERIES:
        raise RuntimeError(
            f"batchllm drives vLLM {VLLM_SERIES}.x internals, but vLLM {installed} is installed: install "
            f"batchllm-dagster[gpu] (GPU) or batchllm-dagster[cpu] (CPU), which pin vLLM {VLLM_SERIES}")


def offline_max_num_seqs(tensor_parallel_size: int) -> int:
    """vLLM's own ``max_num_seqs`` for an offline batch on this node's GPUs (``get_batch_defaults``:
    1,024 on an H100/H200, 256 on smaller ones; device memory from NVML, as vLLM reads it)."""
    from vllm import EngineArgs

    _, max_num_seqs = EngineArgs.get_batch_defaults(world_size=tensor_parallel_size)
    return max_num_seqs[offline_usage_context()]


def offline_usage_context():
    """vLLM's usage context of an offline batch (``LLM``'s): its offline batch defaults apply
    (``EngineArgs.get_batch_defaults``: 1,024 sequences and 16,384 batched tokens on an H100/H200),
    not the 128 / 2,048 ``LLMEngine.from_engine_args`` takes without one."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.LLM_CLASS
