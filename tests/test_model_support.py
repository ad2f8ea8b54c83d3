"""Models whose layers keep a recurrent state are refused from their config.json, before vLLM starts:
at load, by doctor, and by the engine (they used to fail after the start's minutes, on every attempt)."""

import ast
import json
from pathlib import Path

import pytest

from engine.model_support import STATE_CACHE_ARCHITECTURES, UnsupportedModel, unsupported_reason
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


@pytest.mark.slow  # imports vLLM's model registry
def test_the_architectures_are_vllms_own_that_keep_a_state_or_have_no_attention():
    """vLLM 0.32's registered architectures whose model class is (through its bases) ``IsHybrid``,
    ``HasInnerState`` or ``IsAttentionFree``, read from vLLM's source without importing the models."""
    import vllm
    from vllm.model_executor.models.registry import _VLLM_MODELS

    root = Path(vllm.__file__).parent
    bases: dict[str, set[str]] = {}
    for source in [*(root / "model_executor" / "models").glob("*.py"), *(root / "models").rglob("*.py")]:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(
                    b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute)))

    def keeps_state(name: str, seen: frozenset = frozenset()) -> bool:
        if name in {"IsHybrid", "HasInnerState", "IsAttentionFree"}:
            return True
        return name not in seen and any(keeps_state(b, seen | {name}) for b in bases.get(name, ()))

    assert {arch for arch, (_, cls) in _VLLM_MODELS.items() if keeps_state(cls)} == STATE_CACHE_ARCHITECTURES
