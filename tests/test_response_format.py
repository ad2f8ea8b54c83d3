"""Constrained answers: checked before inference, carried by the plan, sent per request, checked after."""

import pyarrow as pa
import pytest

from engine.plan.plan_table import prepared_batch
from engine.plan.prepared import prepare_batch
from engine.plan.tokenizing import load_tokenizer
from engine.response_format import ResponseFormat
from engine.run.batch_run import BatchRun
from engine.run.checkpoint import row_fingerprints
from engine.run.requests import RequestKind
from engine.run.stand_in import BlockAccountingEngine
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings

from .plan_rows import rows_table

LABELS = ResponseFormat(choice=["positive", "negative"])
PERSON = ResponseFormat(json_schema={"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]})


@pytest.mark.parametrize("text, reason", [
    ('{"choice": []}', "at least two answers"),
    ('{"choice": ["budget"]}', r"choice \['budget'\] needs at least two answers"),
    ('{"choice": ["budget", "mid", "budget", "premium"]}', "repeats 'budget': list each answer once"),
    ('{"choice": ["a", ""]}', "non-empty strings"),
    ('{"regex": "[a"}', "invalid regex"),
    ('{"json_schema": {"type": "nonsense"}}', "invalid JSON schema"),
    ('{"json_schema": {"required": "age"}}', "invalid JSON schema"),
    ('{"choice": ["a"], "regex": "b"}', "exactly one of"),
    ("{}", "exactly one of"),
    ('{"grammar": "x"}', "grammar"),
    ("choice: a", "not JSON"),
])
def test_an_invalid_format_is_refused_with_the_reason(text, reason):
    with pytest.raises(ValueError, match=reason):
        ResponseFormat.from_text(text)


def test_answers_are_checked_against_their_format():
    assert LABELS.violation("positive") is None and "not one of" in LABELS.violation("positive!")
    assert PERSON.violation('{"age": 3}') is None
    assert "schema" in PERSON.violation('{"age": "3"}') and "not JSON" in PERSON.violation('{"age": 3')
    assert ResponseFormat(regex=r"\d{3}").violation("123") is None
    assert ResponseFormat(regex=r"\d{3}").violation("1234") is not None  # the whole answer must match


def test_rows_carry_their_own_format_through_the_plan_and_a_bad_one_is_an_error_row(tiny_model):
    table = pa.table({
        "id": ["a", "b", "c", "d"],
        "prompt": ["Label: good", "Label: bad", "Age of Bob?", "Age of Ann?"],
        "response_format": [None, LABELS.to_text(), PERSON.to_text(), '{"json_schema": {"type": 7}}'],
    })
    settings = EngineSettings(model_path=tiny_model, block_size=8)
    prepared = prepare_batch(table, load_tokenizer(tiny_model), settings, SamplingSettings())
    assert prepared.response_formats == {1: LABELS, 2: PERSON}
    assert prepared.errors[3].startswith("invalid response_format: invalid JSON schema")
    back = prepared_batch(rows_table(prepared), prepared.batch)
    assert back.response_formats == prepared.response_formats
    assert prepared.subset([2, 3]).response_formats == {0: PERSON}
    plain = prepared.subset([0, 1, 2])
    plain.response_formats.clear()
    # Rows 1 and 2 carry a format of their own, so each one's fingerprint changes without it; row 0 has none.
    with_formats, without = row_fingerprints(prepared.subset([0, 1, 2]), "s"), row_fingerprints(plain, "s")
    assert with_formats[0] == without[0] and with_formats[1] != without[1] and with_formats[2] != without[2]


def test_each_row_is_sent_with_its_format_and_prefix_requests_with_none(tiny_model):
    shared = "You label reviews. " * 8
    table = pa.table({"id": [f"r{i}" for i in range(6)], "prompt": [f"{shared}Review {i}:" for i in range(6)],
                      "response_format": [None, None, PERSON.to_text(), None, None, None]})
    job = SamplingSettings(max_tokens=3, response_format=LABELS)
    prepared = prepare_batch(
        table, load_tokenizer(tiny_model), EngineSettings(model_path=tiny_model, block_size=8), job
    )
    engine = BlockAccountingEngine(num_blocks=12, block_size=8)  # the group cannot enter at once: a prefix request
    results = list(BatchRun(prepared, engine, job, SchedulerSettings(log_every_s=60, prefix_requests=True)))
    assert len(results) == 6
    sent = engine.sampling_of
    prefixes = [s for (kind, _), s in sent.items() if kind is RequestKind.PREFIX]
    assert prefixes and all(s.response_format is None for s in prefixes)
    assert sent[(RequestKind.ROW, 2)].response_format == PERSON
    assert all(sent[(RequestKind.ROW, r)].response_format == LABELS for r in (0, 1, 3, 4, 5))


def test_a_component_with_an_invalid_schema_fails_to_load_with_the_reason():
    from assets import BatchJobComponent

    yaml_text = ("name: x\ndataset: {sql: select 1, database: d.duckdb}\n"
                 "sampling: {response_format: {json_schema: {type: nonsense}}}\n")
    with pytest.raises(Exception, match="invalid JSON schema"):
        BatchJobComponent.resolve_from_yaml(yaml_text)
    ok = BatchJobComponent.resolve_from_yaml(
        'name: x\ndataset: {sql: select 1, database: d.duckdb}\nsampling: {response_format: {choice: ["yes", "no"]}}\n'
    )
    assert ok.sampling.response_format == ResponseFormat(choice=["yes", "no"])


CARS = ResponseFormat(choice=["family", "commuter", "enthusiast"])


def test_a_choice_rows_budget_is_raised_to_its_longest_choice_spelled_a_byte_per_token(tiny_model):
    """vLLM's grammar lets the model spell a choice in any tokens, not only the tokenizer's own: a
    budget counted in the latter cut 31 of 43 demo answers (``accoun``). A choice row's budget is
    raised to its longest choice's bytes plus the end of the answer (the grammar ends the answer
    there, whatever the budget): its own format's, else the job's; other rows keep theirs."""
    table = pa.table({"id": ["own", "job", "schema"], "prompt": ["a", "b", "c"],
                      "response_format": ['{"choice": ["yes", "no"]}', None, PERSON.to_text()]})
    settings = EngineSettings(model_path=tiny_model, block_size=8)
    prepared = prepare_batch(table, load_tokenizer(tiny_model), settings,
                             SamplingSettings(max_tokens=2, response_format=CARS))
    assert CARS.most_answer_tokens() == len("enthusiast") + 1
    assert prepared.max_tokens.tolist() == [len("yes") + 1, len("enthusiast") + 1, 2]
    unconstrained = prepare_batch(table.drop_columns(["response_format"]), load_tokenizer(tiny_model), settings,
                                  SamplingSettings(max_tokens=2))
    assert unconstrained.max_tokens.tolist() == [2, 2, 2]


@pytest.mark.slow  # runs vLLM
def test_choices_are_never_cut_off_whatever_max_tokens_the_job_gives(tiny_model):
    """On real vLLM with the tiny model (random weights: it spells choices in odd tokens), a job
    whose max_tokens is 2 answers every row with a whole choice, none cut off."""
    from engine.vllm.vllm_engine import open_engine

    table = pa.table({"id": [f"r{i}" for i in range(12)], "prompt": [f"Car {i} is for a" for i in range(12)]})
    settings = EngineSettings(model_path=tiny_model, kv_cache_blocks=64)
    sampling = SamplingSettings(max_tokens=2, response_format=CARS)
    prepared = prepare_batch(table, load_tokenizer(tiny_model), settings, sampling)
    with open_engine(settings) as engine:
        results = list(BatchRun(prepared, engine, sampling, SchedulerSettings(log_every_s=60)))
    assert [r.status for r in results] == ["ok"] * 12, [r.error for r in results if r.status != "ok"]
    assert all(r.text in CARS.choice for r in results)
    assert max(r.output_tokens for r in results) > 2  # spelled in more tokens than the job's max_tokens


def test_a_constrained_answer_cut_off_at_max_tokens_is_an_error_row_never_ok(tiny_model):
    # The fake engine stops every row at max_tokens with a text that follows no format: a
    # constrained row's answer is then cut off (an error row, text kept); an unconstrained one is ok.
    table = pa.table({"id": ["a", "b", "c"], "prompt": ["Car 1:", "Car 2:", "Car 3:"],
                      "response_format": [CARS.to_text(), None, PERSON.to_text()]})
    sampling = SamplingSettings(max_tokens=3)
    prepared = prepare_batch(
        table, load_tokenizer(tiny_model), EngineSettings(model_path=tiny_model, block_size=8), sampling
    )
    run = BatchRun(prepared, BlockAccountingEngine(num_blocks=64, block_size=8), sampling,
                   SchedulerSettings(log_every_s=60))
    results = {r.id: r for r in run}
    assert results["b"].status == "ok"
    for row_id, budget in (("a", CARS.most_answer_tokens()), ("c", 3)):  # a choice's budget is raised
        assert results[row_id].status == "error" and results[row_id].text
        assert results[row_id].error.startswith(f"cut off at max_tokens ({budget}) before the answer was complete")
    assert (run.finished_stats().ok_rows, run.finished_stats().error_rows) == (1, 2)


NUMBER = ResponseFormat(json_schema={"type": "integer"})
AGREE = ResponseFormat(choice=["no", "not sure", "yes"])


@pytest.mark.parametrize("fmt, text, finish, stop, complete", [
    (AGREE, "yes", "length", None, True),  # no other choice extends it
    (AGREE, "no", "length", None, False),  # "not sure" starts with it
    (AGREE, "no", "stop", None, True),  # ended by itself: the grammar allowed the end here
    (AGREE, "no", "stop", "\n", False),  # a stop string ended it
    (ResponseFormat(regex="[0-9]+"), "12", "length", None, False),  # "123" matches too
    (NUMBER, "12", "length", None, False),  # a number may go on
    (NUMBER, "12", "stop", None, True),
    (PERSON, '{"age": 3}', "length", None, True),  # a closed object: nothing valid can follow
    (PERSON, "{", "stop", "}", False),  # a stop string cut the object open
    (ResponseFormat(json_schema={"type": "string"}), '"ab"', "length", None, True),
    (ResponseFormat(json_schema={"type": "boolean"}), "true", "stop", "\n", True),
    (None, "anything", "length", None, True),  # unconstrained: a long answer is still an answer
])
def test_a_constrained_answer_that_ended_early_is_ok_only_where_its_format_proves_it_complete(
        fmt, text, finish, stop, complete):
    from engine.response_format import cut_off_reason

    reason = cut_off_reason(fmt, text, finish, 8, stop)
    assert (reason is None) == complete, reason
    if not complete:
        assert reason.startswith(
            "cut off at max_tokens (8)" if finish == "length" else f"ended by the stop string {stop!r}"
        )


def test_a_bench_prompt_set_runs_every_row_where_a_choice_raises_its_budget():
    """The bench sizes its context to hold each row's budget as raised for a choice, so no row of a
    shape becomes an error row (an empty prompt that vLLM's own LLM.generate refuses)."""
    import numpy as np

    from engine.bench.prompt_sets import planned_prompt_set
    from engine.plan.tokenizing import TokenizedBatch

    batch = TokenizedBatch.from_rows([np.arange(1, 11, dtype=np.int32) + i for i in range(3)])
    formats = {0: ResponseFormat(choice=["technical", "billing"])}
    _, prepared = planned_prompt_set(batch, np.array([2, 2, 2]), 8, None, formats)
    assert prepared.errors == {} and prepared.max_tokens.tolist() == [len("technical") + 1, 2, 2]


@pytest.mark.slow  # imports vLLM
def test_a_step_after_a_constrained_request_entered_first_lets_its_grammar_compile(monkeypatch):
    """vLLM compiles grammars on a thread pool and skips, for the step, a request whose compile is
    not done: the handle gives up the GIL once before a step that follows a constrained submission
    (with the core in this process, a cached compile then finishes first), and only then."""
    import numpy as np

    import engine.vllm.vllm_engine as handle_module
    from engine.bench.bench_scheduler import LLMEngineStandIn
    from engine.run.requests import Submission
    from engine.vllm.vllm_engine import VLLMEngine

    pauses = []
    monkeypatch.setattr(handle_module.time, "sleep", lambda seconds: pauses.append(seconds))
    handle = VLLMEngine.over(LLMEngineStandIn(), 4, 100)
    tokens = np.arange(8, dtype=np.int32)
    handle.submit(Submission(RequestKind.ROW, 0, tokens, 4), SamplingSettings(max_tokens=4))
    handle.step()
    assert pauses == []  # unconstrained: no pause
    handle.submit(Submission(RequestKind.ROW, 1, tokens, 4), SamplingSettings(max_tokens=4, response_format=LABELS))
    handle.step()
    handle.step()
    assert pauses == [0]  # once, before the first step after it entered


def test_a_format_the_engine_refuses_makes_its_rows_error_rows_asked_once_per_format(tiny_model):
    refused = ResponseFormat(regex=r"(a)\1")
    table = pa.table({"id": [f"r{i}" for i in range(6)], "prompt": [f"Review {i}: fine" for i in range(6)],
                      "response_format": [None, refused.to_text(), None, refused.to_text(), PERSON.to_text(), None]})
    job = SamplingSettings(max_tokens=3, response_format=LABELS)
    prepared = prepare_batch(table, load_tokenizer(tiny_model), EngineSettings(model_path=tiny_model, block_size=8),
                             job)
    engine = BlockAccountingEngine(num_blocks=64, block_size=8)
    engine.refuses = {refused.to_text(): "backreferences are not supported"}
    results = {r.id: r for r in BatchRun(prepared, engine, job, SchedulerSettings(log_every_s=60))}
    # (the stand-in's answers follow no format: the other rows are cut-off error rows of their own)
    refused_rows = {i for i, r in results.items() if r.error == "backreferences are not supported"}
    assert refused_rows == {"r1", "r3"} and len(results) == 6
    assert sorted(engine.asked) == sorted([LABELS.to_text(), refused.to_text(), PERSON.to_text()])
    assert {s.row for _, s in engine.submitted} == {0, 2, 4, 5}  # a refused row never reaches the engine


@pytest.mark.parametrize("finish_reason", ["error", "abort"])
def test_a_request_the_engine_ended_is_an_error_row_whatever_its_text(tiny_model, finish_reason):
    """vLLM ends a request with ``error`` (a grammar that rejected the model's tokens) or ``abort``:
    no answer, though it has text and no format says otherwise; a later run never reuses it."""
    table = pa.table({"id": ["a", "b"], "prompt": ["first prompt", "second prompt"]})
    job = SamplingSettings(max_tokens=3)
    prepared = prepare_batch(table, load_tokenizer(tiny_model), EngineSettings(model_path=tiny_model, block_size=8),
                             job)

    class EndsOne(BlockAccountingEngine):
        def step(self):
            report = super().step()
            for finished in report.finished:
                if finished.submission.row == 1:
                    finished.finish_reason = finish_reason
            return report

    run = BatchRun(prepared, EndsOne(num_blocks=64, block_size=8), job, SchedulerSettings(log_every_s=60))
    results = {r.id: r for r in run}
    assert results["a"].status == "ok"
    assert results["b"].status == "error" and finish_reason in results["b"].error and results["b"].text
    assert (run.finished_stats().ok_rows, run.finished_stats().error_rows) == (1, 1)


@pytest.mark.slow  # imports vLLM
def test_a_request_vllm_refuses_as_it_arrives_comes_back_finished_with_the_reason():
    """The handle's last line of defence (a refusal the format check did not foresee): the request
    is not raised out of ``submit``, it finishes at the next step as an error, the others run."""
    import numpy as np

    from engine.bench.bench_scheduler import LLMEngineStandIn
    from engine.run.requests import Submission
    from engine.vllm.vllm_engine import VLLMEngine

    class Refusing(LLMEngineStandIn):
        def add_request(self, request_id, engine_input, params):
            if request_id == "row-1":
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError("Grammar error:\n  backreferences are not supported")
            super().add_request(request_id, engine_input, params)

    handle = VLLMEngine.over(Refusing(), block_size=16, kv_capacity_blocks=64)
    for row in (0, 1):
        handle.submit(Submission(RequestKind.ROW, row, np.arange(20), 2), SamplingSettings(max_tokens=2))
    finished = []
    while handle.has_unfinished():
        finished += handle.step().finished
    by_row = {f.submission.row: f for f in finished}
    assert by_row[0].failure is None
    assert by_row[1].failure == "vLLM refused the request: Grammar error: backreferences are not supported"
