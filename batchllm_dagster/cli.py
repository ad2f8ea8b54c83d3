"""``batchllm-dagster run JOB``: a job's plan and every shard of it from the command line, in the
instance of ``DAGSTER_HOME``, without copying partition keys out of a log: what the schedule and the
``<JOB>_run_shards`` sensor do, run here and now, one run per shard (or per ``partitions_per_run``
range) on its hardware partition's job, each recorded in the instance as the UI's are.

    batchllm-dagster run reviews                  # prompts + prefix_groups, then every shard
    batchllm-dagster run reviews --dry-run        # the plan and its forecast, no shard run
    batchllm-dagster run reviews --shards-only    # the current plan's shards that have not landed
    batchllm-dagster run reviews --definitions my_project.definitions

It prints the plan's forecast, each shard's start and end and its progress every few seconds as they
come (the ``batchllm.night`` lines the runs' logs hold too).

The definitions module is the project's (``[tool.dg.project] code_location_target_module`` of the
``pyproject.toml`` in this folder) unless given. A failed shard does not stop the others; the exit
status is 1 when one failed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from pathlib import Path

import dagster as dg

from engine.table.dataset_spec import project_root

from .layout import SHARDS_TAG, JobNames
from .partitions import run_keys


def run_planned_shards(instance: dg.DagsterInstance, defs: dg.Definitions, name: str, run_config: dict | None = None,
                       check: bool = True) -> list:
    """The runs job ``name``'s shard sensor asks for now (every shard of the current plan that has
    not landed and has no run in flight), run here one after another; with ``check``, a failed one
    raises once all have run."""
    results = []
    for request in _requests(instance, defs, name):
        results.append(defs.resolve_job_def(request.job_name).execute_in_process(
            partition_key=request.partition_key, instance=instance, run_config=run_config, tags=request.tags,
            raise_on_error=False))
    failed = [r.dagster_run.tags.get(SHARDS_TAG) for r in results if not r.success]
    if check and failed:
        raise RuntimeError(f"{name}: the runs of {failed} failed (see their logs in the instance)")
    return results


def _requests(instance: dg.DagsterInstance, defs: dg.Definitions, name: str) -> list[dg.RunRequest]:
    sensor = defs.resolve_sensor_def(JobNames(name).run_shards_sensor_name)
    with dg.partition_loading_context(dynamic_partitions_store=instance):  # the shard keys live in the instance
        result = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs))
    return list(result.run_requests or [])


def load_definitions(module: str | None = None) -> dg.Definitions:
    """The code location's definitions: ``module``'s, else those of the dg project this folder is in
    (from any of its subfolders)."""
    root, project = project_root()
    if module is None:
        module = project.get("code_location_target_module") or (
            f"{project['root_module']}.definitions" if "root_module" in project else None)
        if module is None:
            raise SystemExit("batchllm-dagster: no --definitions given and no [tool.dg.project] in a pyproject.toml "
                             "of this folder or a parent")
    if project:  # a command from a subfolder uses the project's model cache, not a second one there
        os.environ.setdefault("BATCHLLM_CACHE_DIR", str(root / ".cache"))
    sys.path.insert(0, str(root))  # the project, installed or not, from any of its folders
    sys.path.insert(0, str(Path.cwd()))  # a module of this folder (--definitions)
    loaded = importlib.import_module(module)
    found = [value for value in vars(loaded).values()
             if isinstance(value, dg.Definitions) or callable(getattr(value, "__dagster_definitions", None))]
    defs = getattr(loaded, "defs", found[0] if found else None)
    if defs is None:
        raise SystemExit(f"batchllm-dagster: {module} defines no Definitions")
    return defs() if callable(defs) and not isinstance(defs, dg.Definitions) else defs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchllm-dagster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="plan a batch job and run every shard of the plan")
    run.add_argument("job", help="the job's name (its assets are JOB/prompts, JOB/prefix_groups, JOB/completions)")
    run.add_argument("--shards-only", action="store_true", help="run the current plan's shards, do not plan")
    run.add_argument("--dry-run", action="store_true",
                     help="plan only and print the forecast: no shard runs here (the plan is the job's current one, "
                          "as the schedule's plan run makes it: a shard sensor that is on runs it)")
    run.add_argument("--definitions", help="the definitions module (default: this dg project's)")
    run.add_argument("--log-level", default="WARNING", help="Dagster's console log level (every event is in "
                                                            "the instance either way; default WARNING)")
    args = parser.parse_args(argv)
    # Dagster's console prints a failure's trace twice; at WARNING and above this command says each
    # warning and the failure in one line instead (``_said``), the whole trace staying in the run's log.
    level = args.log_level.upper()
    quiet = {"loggers": {"console": {"config": {"log_level": "CRITICAL" if _at_least_warning(level) else level}}}}
    try:
        defs = load_definitions(args.definitions)
    except Exception as exc:  # a config mistake: the line that names it, not Dagster's component tree
        print(f"batchllm-dagster: the definitions did not load: {load_error(exc)}", file=sys.stderr)
        return 2
    instance = dg.DagsterInstance.get()
    print_night_lines()
    said: set[str] = set()
    if not args.shards_only:
        planned = defs.resolve_job_def(JobNames(args.job).plan_job_name).execute_in_process(
            instance=instance, run_config=quiet, raise_on_error=False)
        _say(instance, planned, said)
        if not planned.success:
            print(f"batchllm-dagster: the plan of {args.job!r} failed (run {planned.run_id}; its log in the "
                  "instance holds the whole trace)", file=sys.stderr)
            return 1
        if args.dry_run:
            return 0
    results = run_planned_shards(instance, defs, args.job, run_config=quiet, check=False)
    shards = []
    for result in results:
        _say(instance, result, said)
        landed = result.asset_materializations_for_node(f"{args.job}__completions")
        shards += [(m.partition, m.metadata) for m in landed]
    for line in shard_lines(shards):
        print(line)
    failed = [r for r in results if not r.success]
    elsewhere = landed_by_another_run(instance, defs, args.job, failed)
    failed = [r for r in failed if r not in elsewhere]
    if not results:
        print(f"{args.job}: 0 runs: every shard of the plan with rows to answer has landed")
    else:
        runs = f"{len(results)} run" + ("" if len(results) == 1 else "s")
        print(f"{args.job}: {len(shards)} shards landed in {runs}, {len(results) - len(failed)} succeeded"
              + (f", {len(failed)} failed: {[r.run_id for r in failed]}" if failed else ""))
    return 1 if failed else 0


HELD_ELSEWHERE = "is already running ("  # a shard run that found its partition's lock held (``held_partitions``)
WAIT_FOR_OTHER_RUN_S = 3600.0


def landed_by_another_run(instance: dg.DagsterInstance, defs: dg.Definitions, name: str, failed: list,
                          wait_s: float = WAIT_FOR_OTHER_RUN_S, poll_s: float = 2.0) -> list:
    """Of the ``failed`` runs, those that stopped because another run of the same night held their
    shards (a cron and a person at once) and whose shards that run landed: waited for (up to
    ``wait_s``) and said, so the command exits 0 when every row landed, once."""
    asset = dg.AssetKey([name, "completions"])
    keys = instance.get_dynamic_partitions(JobNames(name).partitions_name)
    answered = []
    for result in failed:
        if not any(HELD_ELSEWHERE in line for line in _said(instance, result.run_id)):
            continue
        mine = run_keys(result.dagster_run.tags, keys)
        since = instance.get_run_stats(result.run_id).start_time or 0.0
        print(f"{name}: shards {mine} are being answered by another run; waiting for them to land", flush=True)
        deadline = time.monotonic() + wait_s
        while not all(instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=asset, asset_partitions=[key], after_timestamp=since), limit=1).records
                for key in mine):
            if time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        else:
            print(f"{name}: shards {mine} landed, answered by another run")
            answered.append(result)
    return answered


def print_night_lines() -> None:
    """The night's lines (``night_log``: forecast, shard start and end, progress) on stdout as they come,
    each with its time: a terminal and a captured log alike."""
    from .night_log import NIGHT

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    NIGHT.addHandler(handler)
    NIGHT.setLevel(logging.INFO)
    NIGHT.propagate = False


def shard_lines(shards: list[tuple[str, dict]]) -> list[str]:
    """One line per shard landed and a total, from each partition's metadata: its rows (computed,
    reused, error), rows and tokens per second of engine time, prompt tokens saved, who admitted the
    rows, and the engine's wall time."""
    def value(metadata: dict, name: str, default=0):
        found = metadata.get(name)
        return getattr(found, "value", found) if found is not None else default

    lines, total = [], {"rows": 0, "computed": 0, "reused": 0, "errors": 0, "tokens": 0, "saved": 0, "wall": 0.0}
    for key, metadata in shards:
        rows, computed = value(metadata, "planned_rows"), value(metadata, "computed_rows")
        reused, errors, wall = value(metadata, "reused_rows"), value(metadata, "error_rows"), value(metadata, "wall_s")
        tokens = value(metadata, "prompt_tokens") + value(metadata, "output_tokens")
        saved = value(metadata, "prompt_tokens") - value(metadata, "prefill_tokens")
        for name, number in zip(total, (rows, computed, reused, errors, tokens, saved, wall)):
            total[name] += number
        ran = (f"{computed / wall:,.1f} rows/s, {tokens / wall:,.0f} tok/s, saved {saved:,} prompt tok, admission "
               f"{value(metadata, 'admission', 'n/a')}, wall {wall:.2f} s" if computed and wall else "nothing to run")
        lines.append(f"  {key}: {rows:,} rows ({computed:,} computed, {reused:,} reused, {errors:,} errors), {ran}")
    if shards:
        wall = total["wall"]
        lines.append(f"  total: {total['rows']:,} rows ({total['computed']:,} computed, {total['reused']:,} reused, "
                     f"{total['errors']:,} errors)" + (
                         f", {total['computed'] / wall:,.1f} rows/s, {total['tokens'] / wall:,.0f} tok/s, saved "
                         f"{total['saved']:,} prompt tok, wall {wall:.2f} s" if wall else ""))
    return lines


def load_error(exc: BaseException) -> str:
    """The innermost cause of a load failure in one line (a pydantic error: each field and why)."""
    from pydantic import ValidationError

    from engine.setting_text import one_line

    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    text = one_line(exc) if isinstance(exc, ValidationError) else str(exc)
    return f"{type(exc).__name__}: {' '.join(text.split())}"


def _at_least_warning(level: str) -> bool:
    return logging.getLevelName(level) in (logging.WARNING, logging.ERROR, logging.CRITICAL)


def _say(instance: dg.DagsterInstance, result, already: set[str]) -> None:
    """A run's warnings and failures, one line each, on stderr; a warning every run of the command
    repeats (the instance's missing limits, say) once."""
    for line in _said(instance, result.run_id):
        if line not in already:
            print(line, file=sys.stderr)
        already.add(line)


def _said(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    """The run's warnings, and each step's failure in one line: a ``Failure``'s own message (what to
    fix), else the exception's type and message."""
    lines = []
    for entry in instance.all_logs(run_id):
        event = entry.dagster_event
        if event is not None and event.event_type_value == "STEP_FAILURE":
            error = event.event_specific_data.error
            while error.cls_name in ("DagsterExecutionStepExecutionError", "DagsterUserCodeExecutionError") \
                    and error.cause is not None:
                error = error.cause
            text = error.message.split(": ", 1)[1] if error.cls_name == "Failure" else f"{error.cls_name}: " + \
                error.message.split(": ", 1)[-1]
            lines.append(f"error in {event.step_key}: {' '.join(text.split())}")
        elif event is None and entry.level == logging.WARNING:
            lines.append(f"warning: {entry.user_message.strip()}")  # its own lines (a YAML snippet, say) kept
    return lines


if __name__ == "__main__":
    sys.exit(main())
