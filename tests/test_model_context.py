"""A model's own context length as vLLM 0.32 derives it, on the published configs of the models users run
(fields as their checkpoints' config.json give them; no weights are needed to read a context)."""

import json

import pytest

from engine.machine import Platform
from engine.model_context import VLLM_FALLBACK_LEN, model_context
from engine.settings import CPU_MAX_MODEL_LEN, EngineSettings

# config.json of each, from its published checkpoint (the fields a context is derived from, and enough
# for transformers to build its config class).
PUBLISHED = {
    # google/gemma-3-12b-it: multimodal; text_config names no max_position_embeddings (its class: 131,072)
    "gemma3": ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                                "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
                "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                  "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                  "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}, 131072),
    # meta-llama/Llama-3.1-8B-Instruct: llama3 RoPE, whose length is already the scaled one
    "llama31": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                 "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
                 "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_theta": 500000.0, "vocab_size": 128256,
                 "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}}, 131072),
    # Qwen/Qwen2.5-7B-Instruct
    "qwen25": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
                "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
                "vocab_size": 152064, "rope_scaling": None}, 32768),
    # openai/gpt-oss-20b: yarn RoPE (already scaled), alternating sliding and full attention
    "gptoss": ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
                "intermediate_size": 2880, "head_dim": 64, "initial_context_length": 4096,
                "max_position_embeddings": 131072, "num_attention_heads": 64, "num_hidden_layers": 24,
                "num_key_value_heads": 8, "num_local_experts": 32, "experts_per_token": 4,
                "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                 "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
                "rope_theta": 150000, "sliding_window": 128, "vocab_size": 201088,
                "layer_types": ["sliding_attention", "full_attention"] * 12}, 131072),
    # mistralai/Mistral-7B-Instruct-v0.3
    "mistral": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                 "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
                 "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_theta": 1000000.0,
                 "sliding_window": None, "vocab_size": 32768}, 32768),
}

SCALED = {**PUBLISHED["mistral"][0], "rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def checkpoint(tmp_path, name: str, config: dict, tokenizer_max: int | None = None) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer_max is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": tokenizer_max}))
    return str(path)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_published_model_gets_its_own_context_on_a_gpu(tmp_path, name):
    config, expected = PUBLISHED[name]
    path = checkpoint(tmp_path, name, config)
    own = model_context(path)
    assert (own.tokens, own.assumed) == (expected, False)
    settings = EngineSettings(model_path=path)
    assert settings.for_platform(Platform.CUDA).max_model_len == expected
    assert settings.context(Platform.CUDA).tokens == expected
    assert settings.context(Platform.CPU).tokens == CPU_MAX_MODEL_LEN  # the CPU's bound, said as such
    assert "the CPU's bound" in settings.context(Platform.CPU).source


def test_gemma3s_context_says_it_is_transformers_default(tmp_path):
    """Read from the raw file, Gemma 3 had no length at all and fell to 2,048."""
    own = model_context(checkpoint(tmp_path, "gemma3", PUBLISHED["gemma3"][0]))
    assert own.source == "max_position_embeddings 131,072 (transformers' default for gemma3_text)"


def test_a_config_naming_no_length_is_vllms_fallback_said_loudly(tmp_path):
    path = checkpoint(tmp_path, "bare", {"model_type": "mystery", "hidden_size": 64})
    own = model_context(path)
    assert own.tokens == VLLM_FALLBACK_LEN and own.assumed and "set llm.max_model_len" in own.source
    assert EngineSettings(model_path=path).context(Platform.CUDA).assumed
    assert not EngineSettings(model_path=path, max_model_len=8192).context(Platform.CUDA).assumed


def test_linear_rope_scales_the_length_and_the_tokenizers_limit_does_not_enter(tmp_path):
    """vLLM multiplies a linear RoPE factor in; it reads the tokenizer's model_max_length only for
    pooling models, so neither does the engine."""
    own = model_context(checkpoint(tmp_path, "scaled", SCALED, tokenizer_max=4096))
    assert own.tokens == 65536 and own.source.endswith("x RoPE scaling factor 2")


def test_the_jobs_own_length_and_a_capped_cache_say_so(tmp_path):
    path = checkpoint(tmp_path, "llama31", PUBLISHED["llama31"][0])
    assert EngineSettings(model_path=path, max_model_len=4096).context(Platform.CUDA).source == "llm.max_model_len"
    capped = EngineSettings(model_path=path, kv_cache_blocks=65, block_size=16).context(Platform.CUDA)
    assert capped.tokens == 1024 and capped.source.endswith("capped by llm.kv_cache_blocks")


@pytest.mark.slow  # imports vLLM
@pytest.mark.parametrize("name", [*sorted(PUBLISHED), "scaled"])
def test_the_context_is_the_one_vllm_derives(tmp_path, name):
    """vLLM's own derivation on its own config objects (``get_config``, its architecture convertor,
    ``_get_and_verify_max_len``): the part of ``ModelConfig`` that decides the length, without the
    architecture inspection a multimodal Gemma 3 cannot pass on this CPU install (no torchvision)."""
    from vllm.config.model import _get_and_verify_max_len
    from vllm.transformers_utils.config import get_config, get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    path = checkpoint(tmp_path, name, PUBLISHED[name][0] if name in PUBLISHED else SCALED, tokenizer_max=4096)
    hf_config = get_config(path, trust_remote_code=False)
    text = get_hf_text_config(hf_config)
    arch = MODEL_ARCH_CONFIG_CONVERTORS.get(hf_config.model_type, ModelArchConfigConvertorBase)(hf_config, text)
    derived = _get_and_verify_max_len(hf_config=text, model_arch_config=arch.convert(), tokenizer_config=None,
                                      max_model_len=None, disable_sliding_window=False, sliding_window=None)
    assert model_context(path).tokens == derived
