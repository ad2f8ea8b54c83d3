"""A reasoning model's stored answer is its final answer, never its reasoning (``engine/reasoning.py``),
on gpt-oss's harmony output as its tokenizer decodes it with its special tokens."""

import json

import pytest

from engine.model_support import reasoning_parser_of, unsupported_reason
from engine.reasoning import split_harmony

ANALYSIS = "<|channel|>analysis<|message|>The user asks for the capital of France. That is Paris.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Paris<|return|>"


def test_the_final_channel_is_the_answer_and_the_analysis_the_reasoning():
    split = split_harmony(ANALYSIS + FINAL, 30)
    assert (split.text, split.cut) == ("Paris", None)
    assert split.reasoning == "The user asks for the capital of France. That is Paris."
    # A final message with a constraint marker, and no end token kept (vLLM may drop the stop token).
    assert split_harmony(ANALYSIS + "<|start|>assistant<|channel|>final <|constrain|>json<|message|>{\"a\": 1}",
                         40).text == '{"a": 1}'


def test_a_budget_that_ends_inside_the_reasoning_is_an_error_row_never_the_reasoning_as_answer():
    split = split_harmony("<|channel|>analysis<|message|>The user asks for the capital of", 12)
    assert split.text is None and split.reasoning.startswith("The user asks")
    assert "after 12 tokens" in split.cut and "raise max_tokens" in split.cut


def test_an_answer_constrained_from_its_first_token_is_the_text_itself():
    """vLLM 0.32 constrains gpt-oss from its first output token
    (``test_vllm_constrains_gpt_oss_from_its_first_token``)."""
    assert split_harmony('{"label": "positive"}<|return|>', 8).text == '{"label": "positive"}'


def _checkpoint(tmp_path, architecture):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return str(tmp_path)


def test_choice_scoring_of_a_reasoning_model_is_refused_naming_why(tmp_path):
    gpt_oss = _checkpoint(tmp_path, "GptOssForCausalLM")
    assert reasoning_parser_of(gpt_oss) == "openai_gptoss"
    assert unsupported_reason(gpt_oss) is None  # it runs; its answers are split
    assert "remove sampling.score_choices" in unsupported_reason(gpt_oss, scores_choices=True)


def test_a_batch_run_refuses_scoring_on_a_reasoning_engine(tiny_model):
    """The engine's side of it, before a row runs (a job refused at load never gets here)."""
    import pyarrow as pa

    from engine.plan.prepared import prepare_batch
    from engine.plan.tokenizing import load_tokenizer
    from engine.response_format import ResponseFormat
    from engine.run.batch_run import BatchRun
    from engine.settings import EngineSettings, SamplingSettings

    sampling = SamplingSettings(max_tokens=4, response_format=ResponseFormat(choice=["yes", "no"]), score_choices=True)
    prepared = prepare_batch(pa.table({"id": ["a"], "prompt": ["hello"]}), load_tokenizer(tiny_model),
                             EngineSettings(model_path=tiny_model, kv_cache_blocks=64), sampling)

    class ReasoningEngine:
        reasoning_parser = "openai_gptoss"

    with pytest.raises(ValueError, match="is a reasoning model"):
        BatchRun(prepared, ReasoningEngine(), sampling)


def test_keeping_the_reasoning_is_a_switch_that_leaves_old_fingerprints_alone():
    from engine.settings import SamplingSettings

    assert "keep_reasoning" not in SamplingSettings().model_dump()
    assert SamplingSettings(keep_reasoning=True).model_dump()["keep_reasoning"] is True


@pytest.mark.slow  # imports vLLM
def test_vllm_constrains_gpt_oss_from_its_first_token():
    """Its reasoning parser reports the reasoning ended at any prompt, so vLLM's structured-output
    manager applies a response_format from the first output token (``_get_constraint_bounds``)."""
    from vllm.reasoning import ReasoningParserManager

    parser = ReasoningParserManager.get_reasoning_parser("openai_gptoss")
    assert parser.is_reasoning_end(object.__new__(parser), [1, 2, 3])


def test_the_engine_splits_a_reasoning_models_tokens_as_its_tokenizer_decodes_them(tiny_model):
    """``VLLMEngine``'s finish of a row: its token ids decoded with the special tokens (the tiny
    model's tokenizer given harmony's markers as special tokens, as gpt-oss's has them)."""
    from transformers import AutoTokenizer

    from engine.vllm.vllm_engine import VLLMEngine, _InFlight

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"]})
    engine = object.__new__(VLLMEngine)
    engine.reasoning_parser = "openai_gptoss"
    engine._engine = type("Core", (), {"get_tokenizer": lambda self: tokenizer})()
    request = _InFlight(submission=None, token_ids=tokenizer.encode(ANALYSIS + FINAL, add_special_tokens=False))
    final = engine._final_answer(request)
    assert final.text.strip() == "Paris" and "capital of France" in final.reasoning and final.cut is None
    engine.reasoning_parser = None
    assert engine._final_answer(request) is None  # any other model: its text as vLLM decoded it
