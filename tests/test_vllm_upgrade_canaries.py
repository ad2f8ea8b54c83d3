"""Upgrade canaries: what the engine assumes of vLLM 0.32, read from vLLM's own source text and
tables. A vLLM upgrade that changes one fails here first, naming the assumption (each test's
docstring says which engine code rests on it); the rest of the suite tests the behaviour.
"""

import ast
import inspect
from pathlib import Path

import pytest

from engine.model_support import STATE_CACHE_ARCHITECTURES
from engine.reasoning import REASONING_PARSERS
from engine.settings import Platform


@pytest.mark.slow
def test_vllms_own_block_size_is_the_one_vllm_sets_on_each_platform():
    """What the bench's by-hand recipe at vLLM's defaults runs with: read from vLLM 0.32 itself."""
    import inspect

    from vllm.config.cache import CacheConfig
    from vllm.platforms.cpu import CpuPlatform

    from engine.vllm.vllm_env import VLLM_DEFAULT_BLOCK_SIZE

    assert VLLM_DEFAULT_BLOCK_SIZE[Platform.CUDA] == CacheConfig.DEFAULT_BLOCK_SIZE
    source = inspect.getsource(CpuPlatform.check_and_update_config)
    assert "not cache_config.user_specified_block_size:\n            cache_config.block_size = 128" in source
    assert VLLM_DEFAULT_BLOCK_SIZE[Platform.CPU] == 128


@pytest.mark.slow  # imports vLLM
def test_choice_reads_are_what_both_of_vllms_model_runners_read():
    """A scored choice row's read (engine/vllm/choice_reads.py) is vLLM's ``logprob_token_ids``, with
    ``logprobs`` unset. The CPU (and a GPU without Triton) runs vLLM's V1 model runner, whose sampler
    gathers them (run end to end by tests/test_choice_scoring.py); CUDA with Triton runs the V2
    runner by default, which cannot run here: its sampler takes each request's tokens into
    ``LogprobTokenIdsState`` and reads them where a request sets no ``logprobs`` (0 top tokens)."""
    import inspect

    from vllm.sampling_params import MAX_LOGPROB_TOKEN_IDS
    from vllm.v1.sample.sampler import Sampler as V1Sampler
    from vllm.v1.worker.gpu.sample.logprob import LogprobTokenIdsState
    from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler

    from engine.choice_scoring import MAX_BRANCHES
    from engine.vllm.choice_reads import ChoiceReads

    assert MAX_BRANCHES == MAX_LOGPROB_TOKEN_IDS
    assert "logprob_token_ids" in inspect.getsource(V1Sampler.forward)
    assert "self.logprob_token_ids_state.add_request(req_idx, sampling_params)" in inspect.getsource(
        V2Sampler.add_request)
    assert "sampling_params.logprob_token_ids" in inspect.getsource(LogprobTokenIdsState.add_request)
    assert "num_logprobs = max_num_logprobs if max_num_logprobs != NO_LOGPROBS else 0" in inspect.getsource(
        V2Sampler.get_logprobs_dims)
    params = ChoiceReads(tokenizer=None)._read_params((7, 8, 9))
    assert (params.max_tokens, params.logprobs, params.logprob_token_ids) == (1, None, [7, 8, 9])
    assert params.num_logprobs == 3  # what vLLM's output processor returns for it


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


@pytest.mark.slow  # imports vLLM's model configs
def test_the_reasoning_architectures_are_those_vllm_gives_a_parser_itself():
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    given = {}
    for architecture, config in MODELS_CONFIG_MAP.items():
        source = inspect.getsource(config)
        if "reasoning_parser = " in source:
            given[architecture] = source.split("reasoning_parser = ")[1].split('"')[1]
    assert given == REASONING_PARSERS
