"""Engines side by side on one node each run on GPUs of their own (``engine/gpu_claims.py``), on a
described node: the claim is kernel file locks, the same code a GPU node runs."""

import os
import subprocess
import sys

import pytest

from engine.gpu_claims import GPUClaims, GPUsBusy, by_free_memory, cuda_visible_devices
from engine.gpus import GPU

NODE = tuple(GPU(i, "NVIDIA H100 80GB HBM3", 80 << 30, f"GPU-{i:04d}") for i in range(8))


def test_runs_side_by_side_get_gpus_of_their_own_the_freest_first(tmp_path):
    free = {i: (80 << 30) - i * (1 << 30) for i in range(8)}
    free[0] = 1 << 30  # another team's process holds GPU 0 (no claim, but no memory either)
    order = by_free_memory(NODE, free)
    assert [g.index for g in order] == [1, 2, 3, 4, 5, 6, 7, 0]
    first, second, third = (GPUClaims(tmp_path) for _ in range(3))  # as three runs' processes
    assert [g.index for g in first.claim(1, order, "run a")] == [1]
    assert [g.index for g in second.claim(1, order, "run b")] == [2]
    assert [g.index for g in third.claim(2, order, "run c")] == [3, 4]  # tensor parallel: two of its own
    assert cuda_visible_devices(third.held) == "GPU-0003,GPU-0004"  # UUIDs: the same GPU in any numbering
    assert third.claim(2, order, "run c") == third.held  # a second engine of the process keeps them
    with pytest.raises(GPUsBusy, match="a second engine asks for 1"):
        third.claim(1, order, "run c")


def test_a_start_waits_for_a_held_gpu_then_fails_naming_who_holds_it(tmp_path):
    node = NODE[:2]
    holder = GPUClaims(tmp_path)
    holder.claim(2, node, "run 1234 (pid 7)")
    now = [0.0]
    waiting = GPUClaims(tmp_path, wait_s=30, poll_s=10, clock=lambda: now[0],
                        sleep=lambda s: now.__setitem__(0, now[0] + s))
    with pytest.raises(GPUsBusy, match=r"waited 30 s for 1 of this node's 2 GPUs.*run 1234 \(pid 7\).*at most 2 on"):
        waiting.claim(1, node, "run 5678")
    assert now[0] >= 30


def test_a_gpu_is_free_again_when_the_process_holding_it_dies(tmp_path):
    holder = subprocess.run([sys.executable, "-c", (
        "import sys; from pathlib import Path; from engine.gpu_claims import GPUClaims; from engine.gpus import GPU; "
        f"GPUClaims(Path({str(tmp_path)!r})).claim(1, [GPU(0, 'h', 1, 'GPU-0000')], 'dead run'); sys.exit(9)")],
        cwd=os.path.dirname(os.path.dirname(__file__)), capture_output=True, text=True)
    assert holder.returncode == 9, holder.stderr
    assert [g.index for g in GPUClaims(tmp_path, wait_s=0).claim(1, NODE[:1], "next run")] == [0]


def test_more_gpus_than_the_process_may_use_is_said_at_once(tmp_path):
    with pytest.raises(GPUsBusy, match="tensor_parallel_size 4 needs 4 GPUs; this process may use 2"):
        GPUClaims(tmp_path).claim(4, NODE[:2], "run")


def test_an_engine_start_shows_vllm_only_its_claimed_gpus(monkeypatch, tmp_path):
    import engine.gpu_claims as gpu_claims
    import engine.gpus as gpus

    monkeypatch.setattr(gpus, "visible_gpus", lambda: NODE)
    monkeypatch.setattr(gpus, "free_memory", lambda: {i: 80 << 30 for i in range(8)})
    monkeypatch.setattr(gpu_claims, "PROCESS_CLAIMS", GPUClaims(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    another = GPUClaims(tmp_path)
    another.claim(1, NODE, "another run")  # holds GPU 0 while this engine starts
    claimed = gpu_claims.claim_for_engine(2)
    assert [g.index for g in claimed] == [1, 2] and os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-0001,GPU-0002"
    assert gpus.visible(NODE, os.environ["CUDA_VISIBLE_DEVICES"]) == claimed  # what vLLM's processes see
