"""What a person at a terminal sees of a run: a progress bar and a summary table (the libraries'
own lines go to a log file: ``engine.vllm.library_output``)."""

from __future__ import annotations

import os
import shutil
import sys

from .progress import Snapshot, format_eta


def is_terminal() -> bool:
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


class ProgressBar:
    """A tqdm bar on stderr: rows done, tokens/s, cache hits against the ideal, time left."""

    def __init__(self, description: str = "rows"):
        from tqdm import tqdm

        size = shutil.get_terminal_size((120, 20))  # a terminal without a size (a pty) reports 0: tqdm would hide
        self._bar = tqdm(total=0, desc=description, unit="row", file=sys.stderr, ncols=size.columns, nrows=size.lines,
                         mininterval=0.25, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows "
                         "[{elapsed}<{remaining}] {postfix}")

    @classmethod
    def on_terminal(cls, description: str = "rows") -> "ProgressBar | None":
        """A bar when stderr is a terminal; None when it is a file or a pipe (logs, CI, Dagster runs)."""
        return cls(description) if is_terminal() else None

    def show(self, snapshot: Snapshot) -> None:
        self._bar.total = snapshot.total
        share = f" ({100 * snapshot.saved / snapshot.reusable:.0f}% of the reusable)" if snapshot.reusable else ""
        self._bar.set_postfix_str(f"{snapshot.tokens_per_s:,.0f} tok/s, prefill saved {snapshot.saved:,} tok{share}",
                                  refresh=False)
        self._bar.update(snapshot.done - self._bar.n)

    def close(self) -> None:
        self._bar.close()


def summary_table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns: what, how much."""
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)


def run_summary(stats: dict) -> list[tuple[str, str]]:
    """The lines of a finished run's summary, from ``RunStats.to_dict()`` plus row counts."""
    reusable = stats.get("reusable_tokens") or 0
    return [
        (
            "rows",
            f"{stats['rows']:,} ({stats['ok_rows']:,} ok, {stats['error_rows']:,} errors, "
            f"{stats['reused_rows']:,} reused from a checkpoint)",
        ),
        (
            "prompt tokens",
            f"{stats['prompt_tokens']:,}, computed {stats['prefill_tokens']:,} (minimum "
            f"{stats['prompt_tokens'] - reusable:,}: "
            f"{100 * stats['saving_vs_ideal']:.0f}% of the reusable tokens saved)",
        ),
        ("output tokens", f"{stats['output_tokens']:,}"),
        ("throughput", f"{stats['tokens_per_s']:,.0f} tok/s ({stats['output_tokens_per_s']:,.0f} output tok/s)"),
        (
            "engine",
            f"{stats['engine_steps']:,} steps, {stats['rows_per_step']:.1f} rows/step, "
            f"vLLM KV {100 * stats['mean_kv_usage']:.0f}% used, {stats['preemptions']} preemptions"
            + (f" ({stats['recomputed_tokens']:,} tokens computed again)" if stats.get("recomputed_tokens") else ""),
        ),
        ("time", f"{format_eta(stats['wall_s'])} running, {format_eta(stats['engine_start_s'])} starting vLLM"),
    ] + ([("admission", f"{stats['admission']}: {stats['admission_reason']}")] if stats.get("admission") else [])
