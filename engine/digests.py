"""Which hash serves which purpose, said once. Changing one re-keys everything it names (answers
rerun, partitions renamed), so each stays what it is:

* ``row_key``: a row's identity by content (its prompt text or messages, its token ids): blake2b,
  128 bits, since a collision would merge two rows' answers.
* ``digest``: a running digest of files and records (a tokenizer's or model's files, a snapshot's
  rows, a row's fingerprint): blake2b, 96 bits, hex.
* ``text_fingerprint``: settings and source versions, as canonical text (``settings.fingerprint``):
  sha256, 64 bits of hex.
* ``short_digest``: the part of a partition key that names its rows: sha1, 32 bits of hex, short for
  the UI (a key also holds its hardware and shard number).

* DuckDB's ``hash()``: a source's version, the sum of its rows' 64-bit hashes with the row count
  (``assets.prompts.source_version``): computed inside DuckDB over the source without reading it
  out; it only decides whether the source sensor asks for a plan, never whose answer a row gets.

KV block hashes are vLLM-compatible chains of their own (``plan.block_hashes``); Python's ``hash``
is never used for anything that outlives a process.
"""

from __future__ import annotations

import hashlib


def row_key(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def digest(seed: bytes = b""):
    """A blake2b of 12 bytes to ``update``; ``hexdigest()`` when done."""
    return hashlib.blake2b(seed, digest_size=12)


def text_fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def short_digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:8]
