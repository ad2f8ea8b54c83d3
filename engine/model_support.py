"""Which checkpoints the engine can schedule, known from their config.json before vLLM starts.

The engine counts a row's KV blocks in full-attention and sliding-window groups (``read_kv_groups``).
A model that keeps a recurrent state (Mamba, linear attention: Qwen3-Next, Jamba, Nemotron-H) or
has no attention has a cache it cannot count; vLLM's start used to find that out after loading the
weights and compiling (minutes on a GPU node, on every shard attempt). Its architecture name says
it at once: the set below is vLLM 0.32's own (its model classes marked ``IsHybrid``,
``HasInnerState`` or ``IsAttentionFree``; ``tests/test_model_support.py`` reads them from vLLM's
source)."""

from __future__ import annotations

import json
from pathlib import Path

STATE_CACHE_ARCHITECTURES = frozenset({
    'BailingMoeV2_5ForCausalLM', 'BailingMoeV3ForCausalLM', 'BailingMoeV3VLForConditionalGeneration',
    'ColBERTLfm2Model', 'ColQwen3_5', 'FalconH1ForCausalLM', 'FalconMambaForCausalLM', 'Glm5NextForCausalLM',
    'Glm5NextForConditionalGeneration', 'GraniteMoeHybridForCausalLM', 'InternS2MobiusForConditionalGeneration',
    'InternS2PreviewForConditionalGeneration', 'JambaForCausalLM', 'JambaForSequenceClassification',
    'KimiK3ForConditionalGeneration', 'KimiLinearForCausalLM', 'Lfm2ForCausalLM', 'Lfm2MoeForCausalLM',
    'Lfm2VlForConditionalGeneration', 'Mamba2ForCausalLM', 'MambaForCausalLM', 'MiniCPMV4_6ForConditionalGeneration',
    'MiniCPMV4_7ForConditionalGeneration', 'NemotronHForCausalLM', 'NemotronHPuzzleForCausalLM',
    'NemotronH_Nano_Omni_Reasoning_V3', 'NemotronH_Nano_VL_V2', 'NemotronH_Omni_Reasoning_V3',
    'NemotronH_Super_Omni_Reasoning_V3', 'OlmoHybridForCausalLM', 'Qwen3NextForCausalLM', 'Qwen3_5ForCausalLM',
    'Qwen3_5ForConditionalGeneration', 'Qwen3_5MoeForCausalLM', 'Qwen3_5MoeForConditionalGeneration',
    'Qwen4ExpForCausalLM', 'Qwen4ExpForConditionalGeneration', 'Terratorch', 'Zamba2ForCausalLM',
})


class UnsupportedModel(ValueError):
    """A checkpoint the engine cannot schedule: refused before vLLM starts."""


def architectures(model_path: str) -> list[str]:
    """The architectures a checkpoint's config.json names (none: unreadable or not named)."""
    try:
        named = json.loads((Path(model_path) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return []
    return [a for a in named if isinstance(a, str)] if isinstance(named, list) else []


def reasoning_parser_of(model_path: str) -> str | None:
    """The reasoning parser vLLM gives this checkpoint itself (``engine/reasoning.py``), if any."""
    from .reasoning import REASONING_PARSERS

    return next((REASONING_PARSERS[a] for a in architectures(model_path) if a in REASONING_PARSERS), None)


def scoring_refused(model: str, parser: str) -> str:
    """Why choice rows of a reasoning model are not scored."""
    return (f"{model} is a reasoning model (vLLM gives it the {parser!r} parser): it writes its reasoning before its "
            "answer, so the probabilities of a choice's first token, which score_choices reads right after the "
            "prompt, would not be those of its answer; remove sampling.score_choices (its choice rows are then "
            "decoded under the grammar)")


def unsupported_reason(model_path: str, scores_choices: bool = False) -> str | None:
    """Why the engine cannot run this checkpoint (``scores_choices``: with choice rows scored); None:
    nothing known against it."""
    if scores_choices and reasoning_parser_of(model_path):
        return scoring_refused(model_path, reasoning_parser_of(model_path))
    stateful = [a for a in architectures(model_path) if a in STATE_CACHE_ARCHITECTURES]
    if not stateful:
        return None
    return (f"{model_path} is a {stateful[0]}, whose layers keep a recurrent state (Mamba or linear attention) or "
            "no attention: the engine schedules rows by the KV blocks of full-attention and sliding-window layers "
            "and cannot count that state, so such models are not supported yet; use a model with attention layers "
            "only (Llama, Qwen2.5, Qwen3, Gemma 3, Mistral, gpt-oss)")


def refuse_unsupported(model_path: str, scores_choices: bool = False) -> None:
    why = unsupported_reason(model_path, scores_choices)
    if why:
        raise UnsupportedModel(why)
