"""A model's own context length, derived as vLLM 0.32 derives it when a job sets none, and where it came from.

vLLM reads the transformers config object, not the raw ``config.json``: a multimodal model's
``text_config`` with transformers' defaults filled in (Gemma 3's names no ``max_position_embeddings``;
its config class says 131,072), then RoPE scaling. Reading the raw file instead gave Gemma 3 vLLM's
2,048 fallback and made every longer row an error row. ``tests/test_model_context.py`` holds this
equal to vLLM's own derivation on the published configs of the models users run."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

log = logging.getLogger(__name__)

# vLLM's fallback where a config names no length (``_get_and_verify_max_len``, with a warning).
VLLM_FALLBACK_LEN = 2048

# The keys vLLM 0.32 reads a model's own length from (``derive_max_model_len_and_key``): the smallest
# present wins, except ``model_max_length`` (Command-R), which wins whenever it is set.
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose length in the config is already the scaled one (vLLM does not multiply by their factor).
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


@dataclass(frozen=True)
class ModelContext:
    """A model's own context length in tokens, and what it was read from (said in doctor, the plan's
    log and metadata, and the engine's start line). ``assumed``: the config names none and vLLM's
    fallback stands in; a job should set ``llm.max_model_len``."""

    tokens: int
    source: str
    assumed: bool = False


def model_context(model_path: str) -> ModelContext:
    """The context vLLM gives this checkpoint when the job sets no ``max_model_len`` (before the KV
    memory check of its start, which refuses a context the cache cannot hold, naming the one it can)."""
    try:
        changed = (Path(model_path) / "config.json").stat().st_mtime_ns
    except OSError:
        changed = None
    return _derived(model_path, changed)


@functools.lru_cache(maxsize=32)
def _derived(model_path: str, config_changed: int | None) -> ModelContext:
    """``model_context``, read once per version of the config file (a code server lives for days)."""
    raw = _raw_config(model_path)
    text, raw_text = _text_config(model_path, raw)
    found = [(key, getattr(text, key)) for key in _LENGTH_KEYS if isinstance(getattr(text, key, None), (int, float))]
    if not found:
        return ModelContext(VLLM_FALLBACK_LEN, f"vLLM's fallback: {model_path}/config.json names no context length "
                            "(set llm.max_model_len to the model's)", assumed=True)
    key, length = min(found, key=lambda item: item[1])
    if getattr(text, "model_max_length", None):
        key, length = "model_max_length", text.model_max_length
    where = "config.json" if key in raw_text else f"transformers' default for {getattr(text, 'model_type', '?')}"
    source = f"{key} {int(length):,} ({where})"
    rope = _rope_parameters(text)
    if any(p.get("rope_type") == "longrope" for p in rope):
        original = getattr(text, "original_max_position_embeddings", None)
        if original:
            return ModelContext(int(original), f"original_max_position_embeddings {int(original):,} (longrope)")
    factor = _rope_factor(text, rope)
    if factor != 1.0:
        return ModelContext(int(length * factor), f"{source} x RoPE scaling factor {factor:g}")
    return ModelContext(int(length), source)


def _raw_config(model_path: str) -> dict:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _text_config(model_path: str, raw: dict):
    """The language model's config as vLLM reads it, and the raw dict it came from: the file's own
    fields where they name a length (transformers' class would give the same, and importing it costs
    a plan seconds: it brings torch); else transformers' class, whose defaults fill in what the file
    leaves out (Gemma 3), where transformers knows the model type."""
    raw_text = raw.get("text_config") or raw
    if any(isinstance(raw_text.get(key), (int, float)) for key in _LENGTH_KEYS):
        return SimpleNamespace(**raw_text), raw_text
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    except Exception:  # a model type transformers lacks (remote code): nothing more to read
        return SimpleNamespace(**raw_text), raw_text
    return config.get_text_config(), raw_text


def _rope_parameters(text) -> list[dict]:
    """One dict per layer type where RoPE is nested (Gemma 3), else the one (``iter_rope_parameters``)."""
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if not isinstance(params, dict) or not params:
        return []
    nested = [p for p in params.values() if isinstance(p, dict)]
    return [p for p in nested if p] if nested else [params]


def _rope_factor(text, rope: list[dict]) -> float:
    """vLLM's scaling of the length by RoPE: Gemma 3's 128K is already scaled, and so are the listed types."""
    if not rope or "gemma3" in str(getattr(text, "model_type", "")):
        return 1.0
    factor = 1.0
    for params in rope:
        if params.get("rope_type", params.get("type")) not in _PRESCALED_ROPE:
            factor = params.get("factor", factor)
    return float(factor or 1.0)
