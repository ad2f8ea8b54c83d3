"""What a Ray replica asks for on a GPU cluster: whole replicas on one node, or a refusal with the numbers."""

import pytest

from engine.jobs.distributed import replica_resources


def test_a_gpu_cluster_gives_each_replica_its_tensor_parallel_gpus():
    assert replica_resources([8.0, 8.0], replicas=2, tensor_parallel_size=8) == {"num_gpus": 8}
    assert replica_resources([4.0, 4.0], replicas=4, tensor_parallel_size=2) == {"num_gpus": 2}
    assert replica_resources([0.0, 0.0], replicas=2, tensor_parallel_size=1) == {"num_cpus": 1}  # a CPU cluster


def test_too_few_gpus_are_refused_with_the_numbers_never_cpu_actors():
    with pytest.raises(RuntimeError, match=r"has 4 GPUs; 2 replicas x tensor_parallel_size 4 need 8"):
        replica_resources([4.0], replicas=2, tensor_parallel_size=4)


def test_a_replicas_gpus_must_be_on_one_node():
    with pytest.raises(RuntimeError, match=r"a replica's 8 GPUs must be on one node; the nodes have \[4, 4\] GPUs"):
        replica_resources([4.0, 4.0], replicas=1, tensor_parallel_size=8)


def test_a_gpu_job_waits_for_a_gpu_node_then_refuses_with_the_numbers_never_cpu_actors():
    from engine.jobs.distributed import wait_for_gpu_nodes

    cpu_node, gpu_node = {"Alive": True, "Resources": {"CPU": 8.0}}, {"Alive": True, "Resources": {"GPU": 8.0}}
    naps = []
    joined = iter([[cpu_node], [cpu_node], [cpu_node, gpu_node]])  # an autoscaler brings a GPU node
    assert wait_for_gpu_nodes(lambda: next(joined), True, 60, sleep=naps.append) == [0.0, 8.0] and len(naps) == 2
    with pytest.raises(RuntimeError, match=r"no GPU node joined the Ray cluster within 0s \(1 live nodes, 0 GPUs\)"):
        wait_for_gpu_nodes(lambda: [cpu_node], True, 0, sleep=naps.append)
    assert wait_for_gpu_nodes(lambda: [cpu_node], False, 0) == [0.0]  # the CPU build: CPU actors are the plan
