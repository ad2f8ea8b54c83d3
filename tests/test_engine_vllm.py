"""The engine on real vLLM (CPU) with the tiny random model: answers keyed by id, equal to plain vLLM's."""

import random

import numpy as np
import pyarrow as pa
import pytest

from engine.plan.prepared import prepare_batch
from engine.plan.tokenizing import load_tokenizer
from engine.run.batch_run import BatchRun
from engine.run.scheduler import InOrder, Planned
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
from engine.vllm.vllm_engine import open_engine

from .conftest import ROOT, make_prompt_table

pytestmark = pytest.mark.slow  # real vLLM, dg, Ray or a browser

SAMPLING = SamplingSettings(max_tokens=8)


def settings(model, **kw):
    return EngineSettings(model_path=model, kv_cache_blocks=kw.pop("kv_cache_blocks", 64), **kw)


def run(model, table, plain=False, engine_settings=None, sampling=SAMPLING, input_order=False, **scheduler):
    """Our scheduler, or (``plain``) plain vLLM given the rows in input order."""
    engine_settings = engine_settings or settings(model)
    prepared = prepare_batch(table, load_tokenizer(model), engine_settings, sampling)
    rows = list(range(table.num_rows)) if input_order else None
    with open_engine(engine_settings) as engine:
        batch_run = BatchRun(prepared, engine, sampling, SchedulerSettings(log_every_s=1, **scheduler), rows=rows,
                             scheduling=InOrder(list(range(table.num_rows))) if plain else Planned())
        results = list(batch_run)
    return {r.id: r for r in results}, batch_run.finished_stats()


def test_answers_are_keyed_by_id_whatever_the_input_order(tiny_model):
    table = make_prompt_table()
    first, _ = run(tiny_model, table)
    shuffled = list(range(table.num_rows))
    random.Random(7).shuffle(shuffled)
    second, _ = run(tiny_model, table.take(shuffled))
    assert set(first) == set(table.column("id").to_pylist())
    assert {i: r.text for i, r in first.items()} == {i: r.text for i, r in second.items()}
    assert len({r.text for r in first.values()}) > 1, "the model must answer rows differently for this to test anything"


def test_engine_equals_plain_vllm_and_reaches_the_ideal_saving_without_preemption(tiny_model):
    table = make_prompt_table(documents=8, questions=5)
    # Rows are handed over in input order: the engine must still run them in plan order.
    ours, ours_stats = run(tiny_model, table, input_order=True)
    plain, plain_stats = run(tiny_model, table, plain=True, input_order=True)
    assert {i: r.text for i, r in ours.items()} == {i: r.text for i, r in plain.items()}
    assert all(r.status == "ok" for r in ours.values())
    assert all(r.output_tokens == SAMPLING.max_tokens or r.finish_reason == "stop" for r in ours.values())
    assert ours_stats.prompt_tokens == plain_stats.prompt_tokens
    assert ours_stats.reusable_tokens == plain_stats.reusable_tokens > 0  # the minimum, whatever the order
    assert ours_stats.saving_vs_ideal >= 0.95, ours_stats.to_dict()
    assert ours_stats.prefix_requests == 0  # each group's first row computes its prefix (the default)
    assert ours_stats.preemptions == 0
    assert ours_stats.engine_steps > 0 and 0 < ours_stats.mean_kv_usage <= 1 and ours_stats.rows_per_step >= 1


def test_the_tokens_a_preemption_computes_again_are_counted(tiny_model):
    """vLLM alone, on a cache too small for what it admits, preempts rows and computes them again
    later: the run counts those tokens (vLLM's own prefix-cache counters at readmission), which the
    prompt tokens computed at first prefill do not show; a run that never preempts counts none."""
    table = make_prompt_table()
    engine_settings = settings(tiny_model, kv_cache_blocks=32)  # rows of ~430 tokens in blocks of 32
    sampling = SamplingSettings(max_tokens=96, ignore_eos=True)
    plain, plain_stats = run(tiny_model, table, plain=True, engine_settings=engine_settings, sampling=sampling)
    assert plain_stats.preemptions > 0 and plain_stats.recomputed_tokens > 0, plain_stats.to_dict()
    ours, ours_stats = run(tiny_model, table, engine_settings=engine_settings, sampling=sampling,
                           reserve_output="full")
    assert ours_stats.preemptions == 0 and ours_stats.recomputed_tokens == 0, ours_stats.to_dict()
    assert {i: r.text for i, r in ours.items()} == {i: r.text for i, r in plain.items()}


def test_bad_rows_become_error_results_and_the_batch_goes_on(tiny_model):
    table = pa.table({
        "id": [1, 2, 3, 4, 5],
        "prompt": ["fine prompt", "", "word " * 3000, "another fine prompt", None],
        "messages": [None, None, None, None, "not json"],
        "max_tokens": [4, 4, 4, 0, 4],
    })
    results, stats = run(tiny_model, table)
    assert results[1].status == "ok" and results[1].text
    assert results[2].status == "error" and "empty prompt" in results[2].error
    assert results[3].status == "error" and "exceeds the model's context" in results[3].error
    assert results[4].status == "error" and "max_tokens" in results[4].error
    assert results[5].status == "error" and "chat template failed" in results[5].error
    assert (stats.ok_rows, stats.error_rows) == (1, 4)
    assert stats.rows == 5


def test_missing_model_path_is_a_clear_error(tmp_path):
    from engine.vllm.vllm_engine import EngineStartError, VLLMEngine

    with pytest.raises(EngineStartError, match="does not exist"):
        VLLMEngine(EngineSettings(model_path=str(tmp_path / "no-model")))


def test_rows_too_long_for_a_small_kv_cache_are_errors(tiny_model):
    table = pa.table({"id": ["short", "long"], "prompt": ["a short prompt", "many words " * 200]})
    results, _ = run(tiny_model, table, engine_settings=settings(tiny_model, kv_cache_blocks=8))
    assert results["short"].status == "ok"
    assert results["long"].status == "error" and "KV cache 8 blocks" in results["long"].error


def test_constrained_answers_follow_their_format_on_real_vllm(tiny_model):
    """The tiny model's weights are random: without the constraint it answers noise."""
    from engine.response_format import ResponseFormat

    labels = ResponseFormat(choice=["positive", "negative", "neutral"])
    code = ResponseFormat(regex=r"[A-Z]{2}-[0-9]{3}")
    flag = ResponseFormat(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                       "required": ["ok"], "additionalProperties": False})
    table = make_prompt_table(documents=3, questions=3, singles=3)
    row_formats = [None, code.to_text(), flag.to_text()] * (table.num_rows // 3) + [None] * (table.num_rows % 3)
    table = table.append_column("response_format", pa.array(row_formats, pa.string()))
    sampling = SamplingSettings(max_tokens=24, response_format=labels)
    results, _ = run(tiny_model, table, sampling=sampling)
    formats = dict(zip(table.column("id").to_pylist(), row_formats))
    for row_id, result in results.items():
        fmt = ResponseFormat.from_text(formats[row_id]) if formats[row_id] else labels
        assert result.status == "ok" and fmt.violation(result.text) is None, (row_id, result.text)
    assert {r.text for i, r in results.items() if not formats[i]} <= set(labels.choice)


def core_groups(engine):
    """The KV cache groups of the in-process engine core (the CPU's default): vLLM's own."""
    core = engine._engine.engine_core.engine_core
    managers = core.scheduler.kv_cache_manager.coordinator.single_type_managers
    return [(type(g.kv_cache_spec).__name__, m.max_admission_blocks_per_request)
            for g, m in zip(core.scheduler.kv_cache_config.kv_cache_groups, managers)]


def test_what_vllm_decided_is_read_back_and_another_block_size_is_refused(tiny_model):
    from engine.run.kv_budget import KVGroups
    from engine.vllm.vllm_engine import EngineStartError, read_kv_groups

    with open_engine(settings(tiny_model)) as engine:
        assert core_groups(engine) == [("FullAttentionSpec", None)]
        assert engine.kv_groups == KVGroups() and engine.block_size == 32
        with pytest.raises(EngineStartError, match="vLLM chose KV blocks of 32 tokens, not the 16"):
            read_kv_groups(engine._engine, 16)


def kv_groups_with_the_core_apart(engine_settings):
    import os
    import subprocess
    import sys

    script = ("from engine.settings import EngineSettings\n"
              "from engine.vllm.vllm_engine import open_engine\n"
              "if __name__ == '__main__':\n"
              f"    with open_engine(EngineSettings.model_validate_json({engine_settings.model_dump_json()!r})) as e:\n"
              "        queued = e._engine.engine_core.outputs_queue.qsize()  # what step() reads as queued_steps\n"
              "        client = type(e._engine.engine_core).__name__\n"
              "        print(e.kv_groups.full, *e.kv_groups.window_caps, *e.kv_groups.window_holds, queued, client)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                               "VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    *counts, queued, client = done.stdout.strip().splitlines()[-1].split()
    assert client == "SyncMPClient" and queued == "0"  # the client's queue of the core's outputs, read
    from engine.run.kv_budget import KVGroups

    windows = [int(c) for c in counts[1:]]
    return KVGroups(int(counts[0]), tuple(windows[:len(windows) // 2]), tuple(windows[len(windows) // 2:]))


def test_a_decoding_row_holds_no_more_window_blocks_than_counted_and_a_prefill_more():
    """vLLM frees the blocks a row's window has left at its next allocation, which its scheduler makes
    for running rows before it admits waiting ones: on real vLLM's KV cache manager (``tiny-hybrid``:
    a 256-token window, blocks of 32), a row of a 400-token prompt holds all 13 of its blocks in the
    window group when its prefill gave its first token, and from its next step no more than the
    decoding hold the engine counts from then on (``KVGroups.window_holds``, vLLM's own bound)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine.models import resolve_model

    model = resolve_model("tiny-hybrid")
    with open_engine(settings(model, kv_cache_blocks=64, max_model_len=512)) as engine:
        [hold] = engine.kv_groups.window_holds
        core = engine._engine.engine_core.engine_core
        window = next(m for g, m in zip(core.scheduler.kv_cache_config.kv_cache_groups,
                                        core.scheduler.kv_cache_manager.coordinator.single_type_managers)
                      if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec")
        rng = np.random.default_rng(0)
        for i in range(3):
            engine._engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=rng.integers(5, 500, 400).tolist()),
                                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        held: dict[int, int] = {}  # output tokens so far -> the most window blocks a row held then
        while engine._engine.has_unfinished_requests():
            engine._engine.step()
            for request_id, blocks in window.req_to_blocks.items():
                request = core.scheduler.requests.get(request_id)
                if request is not None and request.num_output_tokens:
                    outputs = min(request.num_output_tokens, 2)
                    held[outputs] = max(held.get(outputs, 0), sum(b is not window._null_block for b in blocks))
    assert held[1] == -(-400 // 32) > hold >= held[2] > 0, (held, hold)


@pytest.mark.parametrize("max_num_batched_tokens", [None, 64])
def test_a_model_with_a_sliding_window_beside_full_attention_runs_group_wise_as_vllm_answers(max_num_batched_tokens):
    """Gemma's and gpt-oss's pattern in miniature (``tiny-hybrid``): vLLM gives it two KV cache groups
    in one pool. The engine reads them as vLLM's core built them (over vLLM's RPC, as a GPU's core in
    its own process is read), counts each row in both, and admits group-wise on a cache so small that a
    one-pool count would over-admit, with the answers of plain vLLM and no preemption. With 64 tokens a
    step, vLLM lets a row hold fewer blocks in the window's group than its prompt has: the cap binds."""
    from engine.models import resolve_model
    from engine.run.kv_budget import KVGroups

    model = resolve_model("tiny-hybrid")
    engine_settings = settings(model, kv_cache_blocks=40, max_model_len=512,
                               max_num_batched_tokens=max_num_batched_tokens)
    table = make_prompt_table(documents=8, questions=5)
    with open_engine(engine_settings) as engine:
        (window, cap), full = core_groups(engine)
        assert window == "SlidingWindowSpec" and full == ("FullAttentionSpec", None)
        hold = engine.kv_groups.window_holds[0]  # vLLM's bound on a decoding row's (test above)
        assert engine.kv_groups == KVGroups(1, (cap,), (hold,)) and hold <= cap
    # The core in its own process (a GPU's) is read the same, over its socket; its queue of step
    # outputs is where the handle reads how far it ran ahead (``StepReport.queued_steps``).
    if max_num_batched_tokens:
        assert kv_groups_with_the_core_apart(engine_settings) == KVGroups(1, (cap,), (hold,))
    prepared = prepare_batch(table, load_tokenizer(model), engine_settings, SAMPLING)
    longest = int(prepared.batch.lengths.max()) + SAMPLING.max_tokens
    assert (cap < -(-longest // 32)) == (max_num_batched_tokens == 64)
    ours, ours_stats = run(model, table, engine_settings=engine_settings, admission="group_wise",
                           reserve_output="full")
    plain, _ = run(model, table, plain=True, engine_settings=engine_settings)
    assert {i: r.text for i, r in ours.items()} == {i: r.text for i, r in plain.items()}
    assert all(r.status == "ok" for r in ours.values()) and len(ours) == table.num_rows
    assert ours_stats.preemptions == 0, ours_stats.to_dict()
    assert ours_stats.saved_tokens > 0  # rows still share their prefixes


def test_answers_equal_vllms_own_generate(tiny_model):
    """vLLM's own ``LLM.generate`` (whole outputs) as the oracle of the engine's delta outputs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from engine.machine import current_platform
    from engine.vllm.vllm_env import configure, engine_args

    table = make_prompt_table(documents=2, questions=3, singles=2)
    ours, _ = run(tiny_model, table)
    engine_settings = settings(tiny_model)
    prepared = prepare_batch(table, load_tokenizer(tiny_model), engine_settings, SAMPLING)
    configure(engine_settings, current_platform())
    llm = LLM(**engine_args(engine_settings, current_platform()))
    try:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prepared.batch.row(i)) for i in range(prepared.num_rows)],
                               SamplingParams(max_tokens=SAMPLING.max_tokens, temperature=0), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    theirs = {prepared.ids[i]: out.outputs[0] for i, out in enumerate(outputs)}
    assert {i: r.text for i, r in ours.items()} == {i: o.text for i, o in theirs.items()}
    assert {i: r.output_tokens for i, r in ours.items()} == {i: len(o.token_ids) for i, o in theirs.items()}


def test_the_engine_core_in_its_own_process_started_by_spawn_gives_the_same_answers(
    tiny_model, prompt_parquet, tmp_path
):
    """What a GPU runs by default (the engine core in its own process, spawned), run here on the
    CPU build: the same answers as in one process."""
    import os
    import subprocess
    import sys
    import time

    import pyarrow.parquet as pq

    def batchllm_run(output, **env):
        started = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "engine.cli.main",
                "--log-file",
                str(output.with_suffix(".log")),
                "run",
                str(prompt_parquet),
                "--model",
                tiny_model,
                "--output",
                str(output),
                "--max-tokens",
                "6",
                "--kv-cache-blocks",
                "64",
                "--json",
            ],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        )
        answers = pq.read_table(output)
        assert "INFO" not in done.stderr  # vLLM's start-up report goes to the log file, not the console
        return dict(zip(answers["id"].to_pylist(), answers["text"].to_pylist())), time.perf_counter() - started

    separate, separate_s = batchllm_run(tmp_path / "mp.parquet", VLLM_ENABLE_V1_MULTIPROCESSING="1",
                                        VLLM_WORKER_MULTIPROC_METHOD="spawn")
    one, one_s = batchllm_run(tmp_path / "one.parquet")
    assert separate == one and len(one) == make_prompt_table().num_rows
    # The engine core's own lines (its process is not the run's) are in the run's log file.
    core_lines = [line for line in (tmp_path / "mp.log").read_text().splitlines()
                  if " INFO [" in line and "[MainProcess]" not in line and " vllm." in line]
    assert core_lines, "no vLLM line from the engine core's process in the log file"
    print(
        f"batchllm run, {len(one)} rows: engine core in its own process {separate_s:.1f}s, in one process {one_s:.1f}s"
    )


def test_identical_rows_run_once_and_every_id_gets_plain_vllms_answer(tiny_model):
    base = make_prompt_table(documents=3, questions=3, singles=2)
    repeated = base.slice(0, 4)  # the same rows again under other ids
    repeated = repeated.set_column(0, "id", pa.array([f"again-{i}" for i in repeated.column("id").to_pylist()]))
    table = pa.concat_tables([base, repeated])
    ours, ours_stats = run(tiny_model, table)
    plain, plain_stats = run(tiny_model, table, plain=True)
    assert {i: r.text for i, r in ours.items()} == {i: r.text for i, r in plain.items()}
    for original in base.slice(0, 4).column("id").to_pylist():
        assert ours[f"again-{original}"].text == ours[original].text
    assert ours_stats.duplicate_rows == 4 and plain_stats.duplicate_rows == 0
    assert ours_stats.output_tokens == plain_stats.output_tokens  # every id answered in full
    assert ours_stats.prefill_tokens < plain_stats.prefill_tokens


def test_vllm_emits_a_rows_first_output_and_its_last_not_one_per_step(tiny_model):
    """Host work per step follows what changed, not the rows running: each row's RequestOutputs are
    its first token's and its last, however many steps it decodes, and its answer is whole."""
    table = make_prompt_table(documents=2, questions=3, singles=2)
    sampling = SamplingSettings(max_tokens=16, ignore_eos=True)
    engine_settings = settings(tiny_model)
    prepared = prepare_batch(table, load_tokenizer(tiny_model), engine_settings, sampling)
    with open_engine(engine_settings) as engine:
        emitted = []
        step = engine._engine.step

        def counted_step():
            outputs = step()
            emitted.extend(o.request_id for o in outputs)
            return outputs

        engine._engine.step = counted_step
        results = list(BatchRun(prepared, engine, sampling, SchedulerSettings(log_every_s=60)))
    rows = [r for r in results if r.status == "ok"]
    assert rows and all(r.output_tokens == 16 for r in rows)
    per_request = {i: emitted.count(i) for i in set(emitted)}
    assert max(per_request.values()) <= 2  # 16 tokens each, two outputs at most


def test_vllm_runs_no_stat_logger_beside_the_engines_own(tiny_model, monkeypatch):
    """vLLM adds a Prometheus logger that observes a latency per running request per step unless a
    custom logger is one, and its LoggingStatLogger whenever its logger takes INFO lines (a routed
    run's log file: set here); the engine's own is the only one, registers nothing, and still reads
    every gauge."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # as a routed run's log file takes them
    engine_settings = settings(tiny_model)
    table = make_prompt_table(documents=2, questions=3, singles=2)
    prepared = prepare_batch(table, load_tokenizer(tiny_model), engine_settings, SAMPLING)
    with open_engine(engine_settings) as engine:
        loggers = [type(x).__name__ for x in engine._engine.logger_manager.stat_loggers]
        run = BatchRun(prepared, engine, SAMPLING, SchedulerSettings(log_every_s=60))
        assert len(list(run)) == table.num_rows
    assert loggers == ["GaugeStatLogger"]
    stats = run.finished_stats()
    assert stats.engine_steps > 0 and stats.mean_kv_usage > 0 and stats.rows_per_step > 0


def test_an_engine_core_whose_parent_is_killed_exits(tiny_model, tmp_path):
    """With the core in its own process (a GPU's default), SIGKILL of the process that started it
    (the OOM killer, a pod's hard stop) must not leave the core holding the GPU: its watch kills it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "start.py"
    script.write_text(
        "import sys, time\n"
        "from engine.settings import EngineSettings\n"
        "from engine.vllm.core_watch import core_pids\n"
        "from engine.vllm.vllm_engine import open_engine\n"
        "if __name__ == '__main__':  # vLLM spawns its core: the script is imported again there\n"
        f"    engine = open_engine(EngineSettings(model_path={tiny_model!r}, kv_cache_blocks=64))\n"
        "    print(*core_pids(engine._engine), flush=True)\n"
        "    time.sleep(600)\n")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=env)
    cores = [int(p) for p in parent.stdout.readline().split()]
    assert cores, "the core did not start in its own process"
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"  # a zombie is dead, unreaped

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in cores):
        time.sleep(0.2)
    assert not any(alive(p) for p in cores)


def test_rows_that_finish_in_the_step_that_ran_them_count_in_that_step(tiny_model):
    """vLLM reports the requests still running after a step: rows of one output token (a scored
    choice row's single step, say) finish in it and were once counted nowhere (97 rows read as 0.5
    rows per step). Each row ran in at least one step."""
    table = make_prompt_table()
    results, stats = run(tiny_model, table, sampling=SamplingSettings(max_tokens=1, ignore_eos=True))
    ran = sum(r.status == "ok" for r in results.values())
    assert ran == table.num_rows and stats.engine_steps >= 1
    assert stats.rows_per_step * stats.engine_steps >= ran
