"""Command-line options that become settings (``EngineSettings``, a ``ResponseFormat``): declared once
for ``run`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from pydantic import ValidationError

from ..response_format import ResponseFormat
from ..setting_text import one_line
from ..settings import BLOCK_SIZES, EngineSettings, SamplingSettings
from ..table.fields import FieldOrder, PromptFields

DEFAULT_MODEL = "smollm2"  # the built-in model runs use unless --model says otherwise


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return value


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """vLLM's settings; an option left out takes the platform's default (see ``EngineSettings``)."""
    fields = EngineSettings.model_fields
    group = parser.add_argument_group("engine (vLLM)")
    group.add_argument("--model", help="built-in model name (smollm2, tiny) or checkpoint path (default: smollm2; "
                       "the tiny model for bench --scale)")
    group.add_argument("--block-size", type=int, choices=BLOCK_SIZES,
                       help=fields["block_size"].description)
    group.add_argument("--max-model-len", type=at_least_one, default=fields["max_model_len"].default,
                       help=fields["max_model_len"].description)
    for name, kind in (("dtype", str), ("kv_cache_blocks", int), ("max_num_seqs", at_least_one),
                       ("max_num_batched_tokens", at_least_one), ("tensor_parallel_size", at_least_one),
                       ("gpu_memory_utilization", float), ("cpu_kv_cache_gib", at_least_one)):
        group.add_argument("--" + name.replace("_", "-"), type=kind, help=fields[name].description)
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                       help=fields["enforce_eager"].description)


def engine_settings_from(args: argparse.Namespace, model_path: str) -> EngineSettings:
    """The settings the options give, for an already resolved ``model_path``, with the KV block size
    a plan made on this machine counts in (the platform's default unless ``--block-size``)."""
    given = {name: getattr(args, name) for name in EngineSettings.model_fields
             if name != "model_path" and getattr(args, name, None) is not None}
    try:
        return EngineSettings(model_path=model_path, **given).with_block_size()
    except ValidationError as exc:
        raise ValueError(f"engine settings: {one_line(exc)}") from None


def add_response_format_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("constrained answers (one kind; a row's response_format column overrides)")
    group.add_argument("--choice", action="append", help="an allowed answer (repeat for each)")
    group.add_argument("--json-schema", metavar="FILE", help="answers are JSON valid against this schema file")
    group.add_argument("--regex", metavar="PATTERN", help="answers match this regular expression")
    group.add_argument("--score-choices", action="store_true",
                       help=SamplingSettings.model_fields["score_choices"].description)


def response_format_from(args: argparse.Namespace) -> ResponseFormat | None:
    """``--choice``/``--json-schema``/``--regex`` (one kind), checked before any work."""
    given = {"choice": getattr(args, "choice", None), "regex": getattr(args, "regex", None)}
    if given["choice"] and len(given["choice"]) == 1 and "," in given["choice"][0]:
        spelled = " ".join(f"--choice {shlex.quote(c.strip())}" for c in given["choice"][0].split(","))
        raise ValueError(f"--choice {given['choice'][0]!r} is one choice holding commas: give each its own "
                         f"--choice ({spelled})")
    if getattr(args, "json_schema", None):
        try:
            given["json_schema"] = json.loads(Path(args.json_schema).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--json-schema {args.json_schema}: {exc}") from None
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    try:
        return ResponseFormat(**given)
    except ValidationError as exc:
        raise ValueError(f"response format: {one_line(exc)}") from None


def add_prompt_fields_options(parser: argparse.ArgumentParser) -> None:
    """A prompt built from a table's fields instead of its prompt column (``engine.table.fields``)."""
    group = parser.add_argument_group("prompt from fields (instead of a prompt column)")
    group.add_argument("--instruction", help=PromptFields.model_fields["instruction"].description)
    group.add_argument("--fields", help="comma-separated columns rendered as 'name: value' lines")
    group.add_argument("--question", help=PromptFields.model_fields["question"].description)
    group.add_argument("--field-order", choices=[o.value for o in FieldOrder], default=FieldOrder.as_declared.value,
                       help="the fields in the declared order, or each row's order that shares most")
    group.add_argument("--choose-field-order-again", action="store_true",
                       help=PromptFields.model_fields["choose_order_again"].description + " (run: the order is "
                       "otherwise kept beside --output, so a rerun of a grown table keeps every old row's prompt)")


def prompt_fields_from(args) -> PromptFields | None:
    if not getattr(args, "fields", None):
        if getattr(args, "instruction", None) or getattr(args, "question", None):
            raise SystemExit("--instruction and --question need --fields")
        return None
    try:
        return PromptFields(
            instruction=args.instruction or "",
            fields=[f.strip() for f in args.fields.split(",") if f.strip()],
            question=args.question,
            field_order=args.field_order,
            choose_order_again=getattr(args, "choose_field_order_again", False),
        )
    except ValidationError as exc:
        raise SystemExit(f"--fields: {one_line(exc)}") from None
