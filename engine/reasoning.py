"""Reasoning models: the answer stored is the final one, never the model's reasoning.

vLLM 0.32 gives gpt-oss a reasoning parser itself (``GptOssForCausalLMConfig.verify_and_update_config``:
``openai_gptoss``). gpt-oss writes in OpenAI's harmony format: its reasoning in an ``analysis``
channel, then its answer in a ``final`` one::

    <|channel|>analysis<|message|>The user asks ...<|end|><|start|>assistant<|channel|>final<|message|>Paris<|return|>

Decoded without special tokens, as vLLM's offline output is, that is ``analysisThe user asks
...assistantfinalParis``: the reasoning stored as the answer. The engine decodes such a row's
tokens with the markers and keeps the final channel's text; a row whose budget ended inside the
reasoning has no answer and is an error row, saying to raise ``max_tokens`` (one budget covers
reasoning and answer, as vLLM counts every token generated). With a ``response_format``, vLLM 0.32
constrains gpt-oss from its first token (its parser reports the reasoning ended at the prompt), so
such an answer is the constrained text itself."""

from __future__ import annotations

from dataclasses import dataclass

# Architectures vLLM 0.32 gives a reasoning parser without being asked, and which (its
# ``MODELS_CONFIG_MAP``; ``tests/test_reasoning.py`` reads them from vLLM).
REASONING_PARSERS = {"GptOssForCausalLM": "openai_gptoss"}

_CHANNEL, _MESSAGE = "<|channel|>", "<|message|>"
_ENDS = ("<|return|>", "<|end|>", "<|call|>")


@dataclass(frozen=True)
class FinalAnswer:
    """A reasoning model's output, split: its final answer (None: it never reached one), its
    reasoning, and why it is no answer (None: it is one)."""

    text: str | None
    reasoning: str | None
    cut: str | None = None


def split_harmony(decoded: str, output_tokens: int) -> FinalAnswer:
    """A gpt-oss output decoded with its special tokens, split into final answer and reasoning."""
    if not decoded.startswith(_CHANNEL):  # constrained from its first token: the text is the answer
        return FinalAnswer(_until_end(decoded), None)
    messages = [_message(part) for part in decoded.split(_CHANNEL)[1:]]
    reasoning = "\n".join(text for channel, text in messages if channel != "final") or None
    finals = [text for channel, text in messages if channel == "final"]
    if not finals:
        return FinalAnswer(None, reasoning, f"the budget ended inside the model's reasoning after {output_tokens} "
                                            "tokens, before its final answer: raise max_tokens (it covers reasoning "
                                            "and answer)")
    return FinalAnswer(finals[-1], reasoning)


def _message(part: str) -> tuple[str, str]:
    """One harmony message after its ``<|channel|>``: its channel name and its text."""
    channel, _, text = part.partition(_MESSAGE)
    return channel.split()[0] if channel.split() else "", _until_end(text)


def _until_end(text: str) -> str:
    """The text before a harmony end marker (and before a next ``<|start|>``)."""
    cut = min([i for i in (text.find(marker) for marker in (*_ENDS, "<|start|>")) if i >= 0], default=len(text))
    return text[:cut]
