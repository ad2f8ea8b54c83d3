"""A row's answer key: what decides its answer, as one value a plan can compare with the stored answer
without the row's token ids.

An answer is the same answer tonight when the settings fingerprint (the model's content, tokenizer and
chat template included, the engine's build, the answer settings: ``checkpoint.settings_fingerprints``)
and the row as planned (its content key, which names its token ids under that tokenizer; its budget;
its own response format; its plan error, if any) are the same. The shard that writes an answer records
the key (``keys_of``); the plan step computes the same key of every row in its database (``key_sql``)
and so knows, before any shard runs, which rows are answered and which need a run. Both are one text
(``_TEXT``) hashed by sha256, in Python and in DuckDB alike: the test holds them equal.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

from ..table.prompt_snapshot import CONTENT_KEY

ANSWER_KEY = "answer_key"  # the output table's column


def answer_key(settings_fp: str, content_key: bytes, max_tokens: int, response_format: str | None,
               error: str | None) -> str:
    text = "\x1f".join([settings_fp, content_key.hex(), str(int(max_tokens)), response_format or "", error or ""])
    return hashlib.sha256(text.encode()).hexdigest()


def keys_of(settings_fp: str, identity: pa.Table, errors: dict[int, str]) -> list[str]:
    """The answer key of each row of a shard's ``identity`` (``plan_table.answer_identity``: id,
    content key, max_tokens, response format), ``errors`` its plan errors by row."""
    keys, budgets = identity.column(CONTENT_KEY).to_pylist(), identity.column("max_tokens").to_pylist()
    formats = identity.column("response_format").to_pylist()
    return [answer_key(settings_fp, key, budget, fmt, errors.get(i))
            for i, (key, budget, fmt) in enumerate(zip(keys, budgets, formats))]


def key_sql(settings_fp: str, content_key: str, max_tokens: str, response_format: str, error: str) -> str:
    """``answer_key`` as a DuckDB expression over columns (a BLOB content key, a BIGINT budget, two
    VARCHARs that may be NULL); ``settings_fp`` a literal (hex: nothing to quote)."""
    if not all(c in "0123456789abcdef" for c in settings_fp):
        raise ValueError(f"not a settings fingerprint: {settings_fp!r}")
    return (f"sha256(concat_ws(chr(31), '{settings_fp}', lower(hex({content_key})), {max_tokens}::VARCHAR, "
            f"coalesce({response_format}, ''), coalesce({error}, '')))")
