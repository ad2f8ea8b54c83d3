"""The node checks on a real GPU node, against CUDA's own answers: what ``batchllm doctor`` reads of
a node (NVML through ctypes, package metadata, no torch, no CUDA context) beside what torch, in a
fresh process per setting, sees. Needs only the standard library and, for the comparison, torch:
it runs on a node where vLLM is not installed.

    PYTHONPATH=. python benchmarks/node_probe.py [OUT.json]

For each ``CUDA_VISIBLE_DEVICES`` (unset, an index, a whole UUID, a UUID prefix, none, one that
names no GPU, a list ending at one that names none) it compares the GPUs ``engine.gpus.visible``
leaves with ``torch.cuda.device_count()`` in a process started with that value; it reports the
driver's CUDA version against the one torch was built for (read from ``torch/version.py`` here,
``torch.version.cuda`` there), the platform detected, the node's problems as doctor names them,
and whether reading all that loaded torch or opened a CUDA context in this process. Then it holds
24 GiB of GPU 0 in another process (torch) and reads the node's problems again: doctor must name
the memory another process holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def torch_sees(cuda_visible_devices: str | None) -> dict:
    """What torch sees in a fresh process started with that ``CUDA_VISIBLE_DEVICES``."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    code = ("import json, torch; n = torch.cuda.device_count(); "
            "print(json.dumps({'count': n, 'cuda': torch.version.cuda, "
            "'names': [torch.cuda.get_device_name(i) for i in range(n)]}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def problems_while_another_process_holds(gib: int) -> list[str]:
    """The node's problems while a torch process holds ``gib`` GiB of GPU 0."""
    from engine.node_checks import problems, read_node

    code = (f"import sys, torch; x = torch.empty({gib} << 30, dtype=torch.uint8, device='cuda'); "
            "torch.cuda.synchronize(); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "held":
            return ["the holder did not start"]
        return problems(read_node())
    finally:
        holder.kill()
        holder.wait()


def compute_processes_of_this_process() -> list | str:
    """The GPUs on which this process holds a compute context, as NVML lists them (pynvml, where installed)."""
    try:
        import pynvml
    except ImportError:
        return "pynvml not installed"
    pynvml.nvmlInit()
    try:
        held = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            if os.getpid() in pids:
                held.append(index)
        return held
    finally:
        pynvml.nvmlShutdown()


def main() -> dict:
    from engine.gpus import free_memory, gpus, nvml_cuda_driver_version, visible
    from engine.machine import current_platform, platform_detection
    from engine.node_checks import _torch_cuda, problems, read_node

    node_gpus = gpus()
    report = {
        "gpus": [{"index": g.index, "name": g.name, "memory_gib": round(g.memory_gib, 1), "uuid": g.uuid}
                 for g in node_gpus],
        "driver_cuda": nvml_cuda_driver_version(),
        "torch_cuda_from_version_py": _torch_cuda(),
        "free_gib": {i: round(b / 2**30, 1) for i, b in free_memory().items()},
        "platform": current_platform().value,
        "platform_detection": platform_detection(),
        "problems": problems(read_node()),
        "problems_at_0.99": problems(read_node(), gpu_memory_utilization=0.99),
    }
    report["torch_imported_by_the_checks"] = "torch" in sys.modules
    report["cuda_context_of_the_checks"] = compute_processes_of_this_process()
    uuid = node_gpus[0].uuid if node_gpus else ""
    settings = [None, "0", uuid, uuid[:12], "", "-1", "GPU-00000000", "0,7", "7,0"]
    rows = []
    for value in settings:
        ours = visible(node_gpus, value)
        theirs = torch_sees(value)
        rows.append({"CUDA_VISIBLE_DEVICES": value, "ours": len(ours), "torch": theirs.get("count"),
                     "agree": len(ours) == theirs.get("count"), "torch_detail": theirs})
    report["visible"] = rows
    report["all_agree"] = all(r["agree"] for r in rows)
    if node_gpus:
        report["problems_while_24_gib_are_held"] = problems_while_another_process_holds(24)
    return report


if __name__ == "__main__":
    result = main()
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            out.write(text + "\n")
