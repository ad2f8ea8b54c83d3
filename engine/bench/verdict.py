"""A bench's statistics and verdict: ratios per repetition, their median and range, and the
sentence naming the strongest baseline."""

from __future__ import annotations

import numpy as np

from .runs import BASELINES, ENGINE_LABELS, ENGINE_RUNS, LABELS, RUNS


def rotated(names: list[str], repetition: int) -> list[str]:
    """The runs' order in repetition ``repetition``: each run goes first once every len(names)."""
    k = repetition % len(names)
    return names[k:] + names[:k]


def ratio_summary(values: list[float]) -> dict:
    """Median and range of one ratio over the repetitions; a range that crosses 1.0 is on par."""
    lo, hi = min(values), max(values)
    call = "faster" if lo > 1 else "slower" if hi < 1 else "on par"
    return {"median": round(float(np.median(values)), 3), "min": round(lo, 3), "max": round(hi, 3), "call": call}


def ratios_over_repetitions(repetitions: list[dict], plan_s: dict[str, float]) -> tuple[dict, dict]:
    """Each engine run against each baseline, per repetition (runs of one repetition ran back to
    back), summarized: without and with the engine run's planning time charged to its wall time.
    ``batchllm`` is compared only with runs of its own prompts, ``batchllm_field_order`` with all.
    Throughput is rows answered per second: runs on other prompts (another field order) answer the
    same rows with other token counts."""
    plain, charged = {}, {}
    for ours_name in ENGINE_RUNS:
        # a learned run is this engine's too: against the one without what it learned as well
        for baseline in BASELINES + (["batchllm"] if RUNS[ours_name].learned else []):
            if RUNS[ours_name].prompts == "declared" and RUNS[baseline].prompts != "declared":
                continue  # the engine's own effect: on exactly the prompts the baseline ran
            pairs = [
                (runs[ours_name], runs[baseline]) for runs in repetitions if ours_name in runs and baseline in runs
            ]
            pairs = [(ours, theirs) for ours, theirs in pairs if theirs["wall_s"]]
            if not pairs:
                continue
            plain.setdefault(ours_name, {})[f"vs_{baseline}"] = ratio_summary(
                [theirs["wall_s"] / ours["wall_s"] for ours, theirs in pairs])
            charged.setdefault(ours_name, {})[f"vs_{baseline}"] = ratio_summary(
                [theirs["wall_s"] / (ours["wall_s"] + plan_s[ours_name]) for ours, theirs in pairs])
    return plain, charged


def prefill_ratios(repetitions: list[dict]) -> dict:
    """Each engine run's computed prompt tokens over each baseline's (the first repetition: counts do not vary)."""
    runs = repetitions[0]
    return {ours: {f"vs_{b}": round(runs[ours]["prefill_tokens"] / runs[b]["prefill_tokens"], 4)
                   for b in BASELINES if b in runs and runs[b]["prefill_tokens"]}
            for ours in ENGINE_RUNS if ours in runs}


def median_run(reports: list[dict]) -> dict:
    """One run's report over the repetitions: each number's median, tokens/s with its range."""
    out = {key: (float(np.median([r[key] for r in reports])) if isinstance(value, float) else value)
           for key, value in reports[0].items() if key not in ("pid", "per_step")}
    out["tokens_per_s_range"] = [min(r["tokens_per_s"] for r in reports), max(r["tokens_per_s"] for r in reports)]
    out["pids"] = [r["pid"] for r in reports]
    if "per_step" in reports[0]:  # each repetition's own profile: a median of profiles would describe no run
        out["per_step"] = [r["per_step"] for r in reports]
    return out


def verdict(
    ratios: dict, agreement: float, rows: int, described: dict, field_order_agreement: float | None = None
) -> str:
    """Lines a team can act on: how each engine run compared with the strongest baseline that ran
    (the one it leads by least), with the range over the repetitions. ``batchllm`` is judged on
    the baselines' own prompts (the engine's effect); ``batchllm_field_order`` against every
    baseline, the hand order included (the engine and its field order together)."""
    what = (
        f"{rows} rows of {described['source']}" if described["shape"] == "table" else f"the {described['shape']} shape"
    )
    if not ratios:
        return f"on {what}: run batchllm and a vLLM run to compare"
    equal = "outputs equal" if agreement == 1 else f"OUTPUTS DIFFER in {100 * (1 - agreement):.1f}% of rows"
    if field_order_agreement is not None:
        equal = (f"outputs on the same prompts {'equal' if agreement == 1 else 'DIFFER'}; batchllm's field order gave "
                 f"the same answer for {100 * field_order_agreement:.1f}% of rows")
    lines = []
    for ours, compared in ratios.items():
        # a learned run against the engine without what it learned is said apart from the baselines
        against = {key: r for key, r in compared.items() if key[3:] in LABELS}
        itself = compared.get("vs_batchllm")
        if itself is not None:
            lines.append(f"{ENGINE_LABELS[ours]} against without: {itself['median']:.2f}x "
                         f"(range {itself['min']:.2f}-{itself['max']:.2f}), {itself['call']}")
        if not against:
            continue
        strongest = min(against, key=lambda key: against[key]["median"])
        r = against[strongest]
        spread = (
            f"{r['median']:.2f}x (range {r['min']:.2f}-{r['max']:.2f})"
            if r["min"] != r["max"]
            else f"{r['median']:.2f}x"
        )
        call = {"faster": "faster than", "on par": "on par with", "slower": "SLOWER than"}[r["call"]]
        others = ", ".join(f"{against[k]['median']:.2f}x {LABELS[k[3:]]}" for k in against if k != strongest)
        lines.append(f"{ENGINE_LABELS[ours]} is {call} the strongest baseline, {LABELS[strongest[3:]]}: {spread}"
                     + (f"; {others}" if others else ""))
    return f"on {what}: " + "; ".join(lines) + f" ({equal})"
