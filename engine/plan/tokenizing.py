"""Tokenize a whole batch with the model's tokenizer, in batches (the Rust tokenizer is parallel).

Chat rows are rendered with the model's chat template first. A row that cannot be tokenized gets
an error reason instead of tokens, and the batch goes on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..atomic import write_text
from ..digests import digest as new_digest
from .block_hashes import RowBlocks

_BATCH = 4096


@dataclass
class TokenizedBatch:
    tokens: np.ndarray  # int32, all rows one after the other
    offsets: np.ndarray  # int64, row i is tokens[offsets[i]:offsets[i + 1]]
    errors: dict[int, str] = field(default_factory=dict)  # row index -> reason (those rows are empty)
    seconds: float = 0.0

    @classmethod
    def from_rows(cls, rows: list, errors: dict[int, str] | None = None, seconds: float = 0.0) -> "TokenizedBatch":
        """One flat batch from per-row token id arrays (or lists)."""
        arrays = [np.asarray(r, dtype=np.int32) for r in rows]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
        return cls(
            tokens=tokens, offsets=np.concatenate([[0], np.cumsum(lengths)]), errors=errors or {}, seconds=seconds
        )

    def row(self, i: int) -> list[int]:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]].tolist()

    def tokens_of(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row_blocks(self, block_size: int) -> RowBlocks:
        """What the planner needs of these rows: lengths and chained block hashes."""
        return RowBlocks.of_tokens(self.tokens, self.offsets, block_size)


def load_tokenizer(model_path: str):
    """The tokenizer ``AutoTokenizer`` picks for ``model_path``. Importing ``AutoTokenizer`` costs
    about 6 s (torch and every model's configuration), more than a nightly rerun spends tokenizing
    its few changed rows, so the class it picked for these files (and this transformers version)
    is remembered, and loaded directly the next time."""
    memo = _class_memo(model_path)
    if memo is not None and memo.is_file():
        module, _, name = memo.read_text().strip().partition(":")
        try:
            return getattr(importlib.import_module(module), name).from_pretrained(model_path)
        except (ImportError, AttributeError):  # the class moved: ask AutoTokenizer again
            pass
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if memo is not None:
        write_text(f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}", memo)
    return tokenizer


def _class_memo(model_path: str) -> Path | None:
    """Where the tokenizer class of a local model is remembered (None for a hub name), keyed by
    the files AutoTokenizer decides from and the transformers version."""
    root = Path(model_path)
    if not root.is_dir():
        return None
    from ..machine import CACHE_ROOT

    digest = new_digest(importlib.metadata.version("transformers").encode())
    _hash_files(root, _TOKENIZER_FILES + _CONFIG_FILES, digest)
    return CACHE_ROOT / "tokenizer_classes" / digest.hexdigest()


class LazyTokenizer:
    """The model's tokenizer, loaded on first use: a rerun whose rows are all cached never loads it."""

    def __init__(self, model_path: str):
        self.model_path, self._tokenizer = model_path, None

    def __getattr__(self, name):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_path)
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self.__getattr__("__call__")(*args, **kwargs)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _render_chat(tokenizer, messages: str) -> str:
    conversation = json.loads(messages) if isinstance(messages, str) else messages
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("messages must be a non-empty JSON list of {role, content} objects")
    for k, message in enumerate(conversation):
        if (
            not isinstance(message, dict)
            or message.get("role") not in CHAT_ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(f"message {k} must be an object with a role in {CHAT_ROLES} and text content, "
                             f"not {str(message)[:80]!r}")
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def tokenize_rows(tokenizer, prompts: list[str | None], messages: list[str | None] | None = None) -> TokenizedBatch:
    """Token ids per row: ``messages`` (chat) when present, else ``prompt`` (plain text)."""
    started = time.perf_counter()
    n = len(prompts)
    messages = messages or [None] * n
    errors: dict[int, str] = {}
    texts: list[str] = [""] * n
    is_chat = np.zeros(n, dtype=bool)
    for i, (prompt, chat) in enumerate(zip(prompts, messages)):
        if chat is not None:
            try:
                texts[i] = _render_chat(tokenizer, chat)
                is_chat[i] = True
            except Exception as exc:  # a bad row must not fail the batch
                errors[i] = f"chat template failed: {exc}"
        elif prompt is None or not str(prompt).strip():
            errors[i] = "empty prompt"
        else:
            texts[i] = str(prompt)

    empty = np.zeros(0, dtype=np.int32)
    rows: list[np.ndarray] = [empty] * n
    for chat_rows in (True, False):
        # A rendered chat template already holds its special tokens.
        todo = [i for i in range(n) if is_chat[i] == chat_rows and i not in errors]
        for lo in range(0, len(todo), _BATCH):
            chunk = todo[lo : lo + _BATCH]
            encoded = tokenizer([texts[i] for i in chunk], add_special_tokens=not chat_rows,
                                return_attention_mask=False)["input_ids"]  # a mask is a Python list per row
            for i, row_ids in zip(chunk, encoded):
                rows[i] = np.asarray(row_ids, dtype=np.int32)
    for i in range(n):
        if i not in errors and not rows[i].size:
            errors[i] = "prompt has no tokens"
    return TokenizedBatch.from_rows(rows, errors, seconds=time.perf_counter() - started)


# Files whose content decides the token ids and the chat rendering; hashed whole (they are small).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
_CONFIG_FILES = ("config.json", "generation_config.json")


def _hash_files(root, names, digest) -> None:
    for name in names:
        path = root / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())


def tokenizer_fingerprint(model_path: str) -> str:
    """A short hash of what decides a row's token ids: the tokenizer and chat-template files."""
    digest = new_digest()
    _hash_files(Path(model_path), _TOKENIZER_FILES, digest)
    return digest.hexdigest()


def model_fingerprint(model_path: str) -> str:
    """A short hash of the model, its tokenizer and its chat template: the content of the tokenizer
    and config files, and the name, size and modification time of every weight file (hashing a
    70B model's weights would take minutes)."""
    root = Path(model_path)
    digest = new_digest()
    _hash_files(root, _TOKENIZER_FILES + _CONFIG_FILES, digest)
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")) + sorted(root.glob("*.gguf")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()
