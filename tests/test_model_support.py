"""Models whose layers keep a recurrent state are refused from their config.json, before vLLM starts:
at load, by doctor, and by the engine (they used to fail after the start's minutes, on every attempt)."""

import json

import pytest

from engine.model_support import UnsupportedModel, unsupported_reason
from engine.settings import EngineSettings


def checkpoint(tmp_path, architecture: str) -> str:
    path = tmp_path / architecture
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": "x",
                                                  "max_position_embeddings": 4096}))
    return str(path)


def test_a_hybrid_is_named_with_the_reason_and_an_attention_model_passes(tmp_path):
    why = unsupported_reason(checkpoint(tmp_path, "Qwen3NextForCausalLM"))
    assert "is a Qwen3NextForCausalLM" in why and "not supported yet" in why
    assert unsupported_reason(checkpoint(tmp_path, "JambaForCausalLM"))
    assert unsupported_reason(checkpoint(tmp_path, "LlamaForCausalLM")) is None
    assert unsupported_reason(str(tmp_path / "absent")) is None  # nothing known: the start says the rest


def test_the_engine_refuses_a_hybrid_before_vllm_starts(tmp_path):
    from engine.vllm.vllm_engine import EngineStartError, VLLMEngine

    with pytest.raises(EngineStartError, match="JambaForCausalLM.*not supported yet"):
        VLLMEngine(EngineSettings(model_path=checkpoint(tmp_path, "JambaForCausalLM")))


def test_doctor_says_it_without_starting_vllm(tmp_path):
    from engine.cli.doctor import check

    report = check(EngineSettings(model_path=checkpoint(tmp_path, "NemotronHForCausalLM")))
    assert any("NemotronHForCausalLM" in p for p in report.problems) and "engine" not in report.facts


def test_a_job_of_a_hybrid_is_refused_at_load(tmp_path):
    from assets.factory import build_batch_defs
    from batchllm_dagster.config import BatchJobConfig, DatasetSpec

    config = BatchJobConfig(name="hybrid", dataset=DatasetSpec(parquet=str(tmp_path / "p.parquet")),
                            llm=EngineSettings(model_path=checkpoint(tmp_path, "Qwen3NextForCausalLM")),
                            output_database=str(tmp_path / "o.duckdb"), storage_dir=str(tmp_path / "jobs"))
    with pytest.raises(UnsupportedModel, match="Qwen3NextForCausalLM"):
        build_batch_defs(config)
