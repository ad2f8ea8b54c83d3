"""Choice rows answered by scoring their choices (engine/choice_scoring.py): the tree of the choices'
tokens, the probabilities read off it, the plan's budget, and the rows on real vLLM."""

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from engine.choice_scoring import MAX_BRANCHES, ChoiceTree, ScoredAnswer, needs_review
from engine.plan.plan_stamp import PlanShaping
from engine.plan.prepared import prepare_batch
from engine.plan.tokenizing import load_tokenizer
from engine.response_format import ResponseFormat
from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings, fingerprint
from engine.table.dataset import Columns

SPELLING = {"yes": [1], "no": [2], "not": [3], "not sure": [3, 4], "ab": [5, 6], "ac": [5, 7], "maybe": [8, 9]}
EOS = 0


def tree(choices, eos=EOS) -> ChoiceTree:
    return ChoiceTree.build(choices, SPELLING.__getitem__, eos)


def test_choices_that_start_with_their_own_tokens_are_read_at_the_prompt_alone():
    labels = tree(["yes", "no", "maybe"])
    assert [(p.prefix, p.tokens) for p in labels.branch_points] == [((), (1, 2, 8))]  # maybe's 9 is never asked
    probabilities = labels.probabilities([[math.log(0.5), math.log(0.2), math.log(0.05)]])
    assert probabilities == pytest.approx({"yes": 0.5 / 0.75, "no": 0.2 / 0.75, "maybe": 0.05 / 0.75})


def test_a_choice_that_ends_where_a_longer_one_goes_on_is_read_against_the_end_of_the_answer():
    labels = tree(["no", "not", "not sure"])
    assert [(p.prefix, p.tokens) for p in labels.branch_points] == [((), (2, 3)), ((3,), (EOS, 4))]
    p = labels.probabilities([[math.log(0.3), math.log(0.1)], [math.log(0.2), math.log(0.6)]])
    assert p["no"] == pytest.approx(0.75) and p["not"] == pytest.approx(0.25 * 0.25)
    assert p["not sure"] == pytest.approx(0.25 * 0.75) and sum(p.values()) == pytest.approx(1)


def test_choices_sharing_their_first_token_are_read_after_it():
    assert [(p.prefix, p.tokens) for p in tree(["ab", "ac"]).branch_points] == [((5,), (6, 7))]
    assert tree(["ab", "ac"]).probabilities([[0.0, -math.inf]]) == {"ab": 1.0, "ac": 0.0}


def test_a_single_choice_needs_no_read_and_a_repeated_one_counts_once():
    assert tree(["yes"]).branch_points == () and tree(["yes"]).probabilities([]) == {"yes": 1.0}
    assert tree(["yes", "no", "yes"]).choices == ("yes", "no")


@pytest.mark.parametrize("choices, encode, eos, reason", [
    (["yes", ""], lambda c: SPELLING.get(c, []), EOS, "no tokens"),
    (["yes", "oui"], lambda c: [1], EOS, "same tokens"),
    (["not", "not sure"], SPELLING.__getitem__, None, "no end-of-sequence token"),
    ([f"c{i}" for i in range(MAX_BRANCHES + 1)], lambda c: [int(c[1:]) + 10], EOS, "reads at most 128"),
])
def test_choices_that_cannot_be_scored_say_why(choices, encode, eos, reason):
    with pytest.raises(ValueError, match=reason):
        ChoiceTree.build(choices, encode, eos)


def test_the_answer_is_the_most_probable_choice_the_first_listed_of_equals():
    answer = ScoredAnswer.of({"yes": 0.4, "no": 0.4, "maybe": 0.2})
    assert (answer.text, answer.probability) == ("yes", 0.4)
    assert json.loads(answer.probabilities_json()) == {"yes": 0.4, "no": 0.4, "maybe": 0.2}
    assert [needs_review(p, 0.5) for p in (0.4, 0.5, None)] == [True, False, None]
    assert needs_review(0.1, None) is None


def test_scored_choice_rows_are_planned_with_the_one_token_they_generate(tiny_model):
    labels = ResponseFormat(choice=["positive", "negative"])
    table = pa.table({"id": ["a", "b", "c"], "prompt": ["Car 1:", "Car 2:", "Car 3:"],
                      "response_format": [None, labels.to_text(), None]})
    settings = EngineSettings(model_path=tiny_model, kv_cache_blocks=64)
    tokenizer = load_tokenizer(tiny_model)
    scored = prepare_batch(table, tokenizer, settings, SamplingSettings(max_tokens=5, score_choices=True))
    decoded = prepare_batch(table, tokenizer, settings, SamplingSettings(max_tokens=5))
    assert scored.max_tokens.tolist() == [5, 1, 5]
    assert decoded.max_tokens.tolist() == [5, labels.most_answer_tokens(), 5]


def test_the_switch_left_off_changes_no_fingerprint_and_on_it_changes_the_plan_and_the_answers():
    # Recorded before score_choices existed: answers and plans on disk keep their fingerprints.
    assert fingerprint(SamplingSettings()) == "029164e0865885ac"
    on = SamplingSettings(score_choices=True)
    assert fingerprint(on) != fingerprint(SamplingSettings())
    shaping = [PlanShaping.of(EngineSettings(max_model_len=512), s, SchedulerSettings(), Columns()).fingerprint()
               for s in (SamplingSettings(), on)]
    assert shaping[0] != shaping[1]
    assert not SamplingSettings(score_choices=True).scores_choice  # no choice format: nothing to score
    assert SamplingSettings(score_choices=True, response_format=ResponseFormat(choice=["a", "b"])).scores_choice


@pytest.mark.slow  # runs vLLM
def test_scored_rows_on_real_vllm_carry_the_probabilities_vllm_gives_the_choices_tokens(tiny_model):
    """Each row's answer is the most probable choice, and every choice's probability is what vLLM's
    prompt log probabilities (another of its paths: the prompt followed by a choice's token, read
    at its last position) give the tokens at each branch point of its tokens. One list of
    choices starts each with its own token; in the other, ``not`` ends where ``not sure`` goes on
    (read at a second branch point, against the end of the answer)."""
    from vllm import SamplingParams

    from engine.run.batch_run import BatchRun
    from engine.vllm.choice_reads import SCORED
    from engine.vllm.vllm_engine import open_engine

    tokenizer = load_tokenizer(tiny_model)
    distinct = ResponseFormat(choice=["positive", "negative", "neutral"])
    nested = ResponseFormat(choice=["no", "not", "not sure"])
    trees = {f.to_text(): ChoiceTree.build(f.choice, lambda t: tokenizer.encode(t, add_special_tokens=False),
                                           tokenizer.eos_token_id) for f in (distinct, nested)}
    assert [len(t.branch_points) for t in trees.values()] == [1, 2]  # at the prompt; and after "not"
    n = 8
    formats = [(distinct if i % 2 else nested).to_text() for i in range(n)]
    table = pa.table({"id": [f"r{i}" for i in range(n)], "response_format": formats,
                      "prompt": [f"Review {i}: it {'broke' * (i % 3)}." for i in range(n)]})
    settings = EngineSettings(model_path=tiny_model, kv_cache_blocks=64)
    sampling = SamplingSettings(max_tokens=4, score_choices=True)
    prepared = prepare_batch(table, tokenizer, settings, sampling)
    expected = {}
    with open_engine(settings) as engine:
        results = {r.id: r for r in BatchRun(prepared, engine, sampling, SchedulerSettings(log_every_s=60))}
        vllm, read = engine._engine, SamplingParams(max_tokens=1, prompt_logprobs=0)
        for i in range(n):
            prompt = prepared.batch.tokens_of(i).tolist()
            for k, point in enumerate(trees[formats[i]].branch_points):
                for j, token in enumerate(point.tokens):
                    tokens = prompt + list(point.prefix) + [token]
                    vllm.add_request(f"{i}/{k}/{j}", vllm.renderer.render_cmpl([{"prompt_token_ids": tokens}])[0],
                                     read)
        while vllm.has_unfinished_requests():
            for out in vllm.step():
                if out.finished:
                    expected[tuple(map(int, out.request_id.split("/")))] = out.prompt_logprobs[-1][
                        out.prompt_token_ids[-1]].logprob
    for i in range(n):
        tree, result = trees[formats[i]], results[f"r{i}"]
        logprobs = [[expected[i, k, j] for j in range(len(p.tokens))] for k, p in enumerate(tree.branch_points)]
        want = tree.probabilities(logprobs)
        got = json.loads(result.choice_probabilities)
        assert result.status == "ok" and result.finish_reason == SCORED
        assert got == pytest.approx(want, abs=1e-4) and sum(got.values()) == pytest.approx(1, abs=1e-4)
        assert result.text == max(want, key=want.get)
        assert result.choice_probability == pytest.approx(want[result.text], abs=1e-4)


@pytest.mark.parametrize("finish_reason, logprobs, reason", [
    ("error", None, "finish_reason 'error'"),
    ("abort", None, "finish_reason 'abort'"),
    ("length", [{}], "no log probability"),
])
def test_a_scoring_request_vllm_ended_or_left_unread_makes_an_error_row_never_an_answer(finish_reason, logprobs,
                                                                                       reason):
    """A row is an answer only when every read came back whole: a read vLLM ended itself, or one
    without the tokens' log probabilities, makes the row an error row (never reused, never ok)."""
    from types import SimpleNamespace

    from engine.run.requests import RequestKind, Submission
    from engine.vllm.choice_reads import ScoredRow, ScoreRead

    labels = tree(["yes", "no"])
    row = ScoredRow(Submission(RequestKind.ROW, 0, np.array([7, 8]), 1), labels, [None], pending=1)
    ScoreRead(row, 0).take(SimpleNamespace(token_ids=[5], finish_reason=finish_reason, logprobs=logprobs), 0)
    finished = row.finished()
    assert row.pending == 0 and finished.scored is None and reason in finished.failure
