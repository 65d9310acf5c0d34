"""lze_trainer.reward: answer extraction, math-verify and reasoning-gym scoring, custom scorers,
and the worker pool's fault handling (errors, dead workers, hangs)."""

import logging
import multiprocessing
import os
import textwrap
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("math_verify")
pytest.importorskip("reasoning_gym")

from math_verify import parse, verify  # noqa: E402

from lze_trainer.data import decode_meta, load_prompts  # noqa: E402
from lze_trainer.reward import (  # noqa: E402
    RewardScorer, answer_expression, default_score, extract_math_answer,
    extract_reasoning_gym_answer, import_function, math_score,
)

logging.getLogger("math_verify").setLevel(logging.ERROR)

# (gold, response, expected reward)
TRICKY_ANSWERS = [
    # fractions and decimals
    ("\\frac{1}{2}", "So the answer is \\boxed{0.5}.", 1.0),
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
    ("0.5", "\\boxed{\\dfrac12}", 1.0),
    ("\\frac{1}{2}", "\\boxed{1/2}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.6}", 0.0),
    ("3.75", "\\boxed{3.750}", 1.0),
    ("3.75", "\\boxed{\\frac{15}{4}}", 1.0),
    # units
    ("12", "\\boxed{12 \\text{ dollars}}", 1.0),
    ("12", "Answer: 12 dollars", 1.0),
    ("12", "#### 12 dollars", 1.0),
    ("12", "\\boxed{12\\text{ cm}}", 1.0),
    ("12\\text{ cm}", "\\boxed{12}", 1.0),
    ("\\frac{3}{4}", "Answer: 3/4 cup", 1.0),
    ("1000", "#### $1,000", 1.0),
    # several boxes: the last one counts
    ("3", "First \\boxed{2}, corrected: \\boxed{3}", 1.0),
    ("2", "First \\boxed{2}, corrected: \\boxed{3}", 0.0),
    ("5", "\\boxed{5} and then \\boxed{6", 1.0),  # an unclosed last box does not count
    # no answer marker: 0, even when the right number is in the text
    ("5", "The answer is 5", 0.0),
    ("5", "", 0.0),
    # negative numbers
    ("-7", "\\boxed{-7}", 1.0),
    ("-7", "\\boxed{7}", 0.0),
    ("-7", "Answer: - 7", 1.0),
    # percentages
    ("50\\%", "\\boxed{50\\%}", 1.0),
    ("50", "\\boxed{50\\%}", 1.0),
    ("50\\%", "\\boxed{0.5}", 1.0),
    # GSM8K ####
    ("72", "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", 1.0),
    ("72", "#### 71", 0.0),
    ("1,000", "#### 1000", 1.0),
    # Answer: lines
    ("34", "Work...\nAnswer: 34", 1.0),
    ("34", "**Answer:** $34$", 1.0),
    ("34", "Final Answer: The final answer is $34$. I hope it is correct.", 1.0),
    # hedged answers are not rewarded
    ("13", "\\boxed{12 or 13}", 0.0),
    ("13", "Answer: 12 or 13", 0.0),
    # expressions
    ("2x", "\\boxed{2x}", 1.0),
    ("2", "\\boxed{2x}", 0.0),
    ("\\sqrt{2}", "\\boxed{\\sqrt 2}", 1.0),
    ("x+1", "\\boxed{1+x}", 1.0),
    ("(1,2)", "\\boxed{(1, 2)}", 1.0),
    ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", 1.0),
    ("2\\pi", "\\boxed{2\\pi}", 1.0),
    ("5", "\\boxed 5", 1.0),
    ("0", "\\boxed{-0}", 1.0),
    ("007", "\\boxed{7}", 1.0),
    ("3", "\\fbox{3}", 1.0),
    ("10", "\\boxed{\\text{10}}", 1.0),
]


@pytest.mark.parametrize("gold, response, expected", TRICKY_ANSWERS)
def test_tricky_answers(gold, response, expected):
    assert math_score(response, gold) == expected
    assert default_score(response, gold, "openai/gsm8k", {}) == expected


@pytest.mark.parametrize("response, answer", [
    ("\\boxed{1} then #### 2 then Answer: 3", "1"),  # the box first
    ("#### 2\nAnswer: 3", "2"),  # then ####
    ("Answer: 3", "3"),
    ("ANSWER : 3 apples", "3 apples"),
    ("nothing here", None),
])
def test_math_answer_precedence(response, answer):
    assert extract_math_answer(response) == answer


@pytest.mark.parametrize("text, expression", [
    ("12", "12"),
    ("$\\frac{1}{2}$", "\\frac{1}{2}"),
    ("The final answer is $3$. I hope it is correct.", "3"),
    ("$1,000", "1,000"),
    ("\\$12", "\\$12"),
    ("12 dollars", "12"),
    ("2 x", "2 x"),  # a one-letter word is a variable, not a unit
])
def test_answer_expression(text, expression):
    assert answer_expression(text) == expression


@given(st.integers(-10**20, 10**20), st.sampled_from([0, 0, 1, -1, 10**6, 10**15]))
@settings(max_examples=150, deadline=None)
def test_integer_shortcut_agrees_with_math_verify(value, offset):
    gold, answer = str(value), str(value + offset)
    full = verify(parse(f"${gold}$", parsing_timeout=None),
                  parse(f"${answer}$", parsing_timeout=None), timeout_seconds=None)
    assert math_score(f"\\boxed{{{answer}}}", gold) == float(full)


@pytest.mark.parametrize("response, answer", [
    ("<think>7?</think><answer>7</answer>", "7"),
    ("<answer>6</answer> no, <answer> 7 </answer>", "7"),
    ("so it is \\boxed{7}", "7"),
    ("Answer: 7", "7"),
    ("3 + 4\n\n= 7\n", "= 7"),
    ("7", "7"),
    ("", None),
])
def test_reasoning_gym_answer_extraction(response, answer):
    assert extract_reasoning_gym_answer(response) == answer


@pytest.fixture(scope="module")
def arithmetic_rows():
    ds = load_prompts("reasoning-gym:basic_arithmetic?size=8&seed=3&max_terms=3&max_digits=2")
    return [ds[i] for i in range(len(ds))]


def test_reasoning_gym_scoring(arithmetic_rows):
    for row in arithmetic_rows:
        gold, meta = row["ground_truth"], decode_meta(row["meta"])
        right = [f"<answer>{gold}</answer>", f"Adding up step by step.\n{gold}",
                 f"The result is \\boxed{{{gold}}}."]
        wrong = [f"<answer>{int(gold) + 1}</answer>", ""]
        scores = [default_score(response, gold, row["data_source"], meta)
                  for response in right + wrong]
        assert scores[:3] == [1.0, 1.0, 1.0] and scores[3] < 1.0 and scores[4] == 0.0


def test_reasoning_gym_scorer_gets_tuples_back():
    """rearc compares tuple grids: a JSON round trip without tuple tags would score 0.05."""
    row = load_prompts("reasoning-gym:rearc?size=1")[0]
    meta = decode_meta(row["meta"])
    assert default_score(f"<answer>{row['ground_truth']}</answer>", row["ground_truth"],
                         row["data_source"], meta) == 1.0


# --- custom scorers and the worker pool --------------------------------------------------------

FAULTY_SCORER = textwrap.dedent('''
    import math, os, time

    def score(response, ground_truth, data_source, meta):
        """1 if the response is the ground truth; special responses misbehave."""
        if response == "hang":
            time.sleep(3600)
        if response == "raise":
            raise RuntimeError("scorer bug")
        if response == "exit":
            os._exit(3)
        if response == "nan":
            return math.nan
        if response == "too big":
            return 2.0
        if response == "text":
            return "1"
        if response == "meta":
            return float(meta == {"k": [1, 2]})
        return float(response == ground_truth)

    not_callable = 3
''')


@pytest.fixture
def scorer_module(tmp_path, monkeypatch):
    (tmp_path / "lze_test_scorers.py").write_text(FAULTY_SCORER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "lze_test_scorers:score"


def rows_for(golds):
    return [{"ground_truth": gold, "data_source": "custom", "meta": "{}"} for gold in golds]


def live_workers():
    return [p for p in multiprocessing.active_children() if p.name == "lze-reward" and p.is_alive()]


def test_pool_scores_math_and_reasoning_gym_together(arithmetic_rows):
    golds = [gold for gold, _, _ in TRICKY_ANSWERS]
    rows = rows_for(golds) + arithmetic_rows
    responses = [response for _, response, _ in TRICKY_ANSWERS]
    responses += [f"<answer>{row['ground_truth']}</answer>" for row in arithmetic_rows]
    with RewardScorer(num_workers=2) as scorer:
        result = scorer.score(responses, rows)
        assert scorer.score([], []).rewards == []
    expected = [reward for _, _, reward in TRICKY_ANSWERS] + [1.0] * len(arithmetic_rows)
    assert result.rewards == expected
    assert (result.errors, result.timeouts, result.first_error) == (0, 0, None)


def test_custom_function_and_faults(scorer_module):
    responses = ["a", "raise", "b", "exit", "nan", "too big", "text", "meta", "c"]
    golds = ["a", "x", "x", "x", "x", "x", "x", "x", "c"]
    rows = rows_for(golds)
    rows[7]["meta"] = '{"k": [1, 2]}'
    with RewardScorer(function=scorer_module, num_workers=1) as scorer:
        result = scorer.score(responses, rows)
        assert result.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        assert (result.errors, result.timeouts) == (5, 0)
        assert result.first_error == "RuntimeError: scorer bug"
        again = scorer.score(["a", "b"], rows_for(["a", "a"]))  # the dead worker was replaced
        assert (again.rewards, again.errors) == ([1.0, 0.0], 0)
        assert len(live_workers()) == 1
        died = scorer.score(["exit"], rows_for(["a"]))
        assert (died.errors, died.first_error) == (1, "the scoring process died (exit code 3)")


def test_a_worker_that_cannot_start_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "lze_test_child_only.py").write_text(textwrap.dedent('''
        import multiprocessing
        if multiprocessing.current_process().name == "lze-reward":
            raise ImportError("only in the worker")
        def score(response, ground_truth, data_source, meta):
            return 1.0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardScorer("lze_test_child_only:score") as scorer:
        with pytest.raises(RuntimeError, match="a reward worker failed to start"):
            scorer.score(["a"], rows_for(["a"]))
    assert live_workers() == []


@pytest.mark.parametrize("num_workers", [1, 2])
def test_hanging_scorer_is_killed_and_the_pool_keeps_working(scorer_module, num_workers):
    timeout_s = 1.0
    responses = ["a", "hang", "b", "c", "hang", "d"]
    with RewardScorer(scorer_module, timeout_s=timeout_s, num_workers=num_workers) as scorer:
        start = time.monotonic()
        result = scorer.score(responses, rows_for(["a", "x", "x", "c", "x", "d"]))
        elapsed = time.monotonic() - start
        assert result.rewards == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
        assert (result.timeouts, result.errors) == (2, 0)
        # Each hang costs one time limit on its worker; the workers hang in parallel.
        hangs_per_worker = -(-2 // num_workers)
        assert hangs_per_worker * timeout_s <= elapsed < hangs_per_worker * timeout_s + 3.0
        start = time.monotonic()
        assert scorer.score(["a", "b"], rows_for(["a", "b"])).rewards == [1.0, 1.0]
        assert time.monotonic() - start < timeout_s
        assert len(live_workers()) == num_workers
    assert live_workers() == []


def test_bad_settings_fail_at_construction(scorer_module):
    with pytest.raises(ValueError, match="reward.function: expected 'module:function'"):
        RewardScorer(function="lze_test_scorers.score")
    with pytest.raises(ValueError, match="reward.function='no_such_module:f' cannot be imported.*"
                                         "ModuleNotFoundError"):
        RewardScorer(function="no_such_module:f")
    with pytest.raises(ValueError, match="reward.function='lze_test_scorers:missing' cannot be "
                                         "imported.*AttributeError"):
        RewardScorer(function="lze_test_scorers:missing")
    with pytest.raises(ValueError, match="is not callable"):
        import_function("lze_test_scorers:not_callable")
    with pytest.raises(ValueError, match="reward.timeout_s must be a finite number > 0"):
        RewardScorer(timeout_s=0)
    with pytest.raises(ValueError, match="reward.num_workers must be an int >= 1"):
        RewardScorer(num_workers=0)
    assert live_workers() == []


def test_score_arguments_and_close(scorer_module):
    scorer = RewardScorer(function=scorer_module)
    with pytest.raises(ValueError, match="same length, got 2 and 1"):
        scorer.score(["a", "b"], rows_for(["a"]))
    scorer.close()
    scorer.close()
    assert live_workers() == []
    with pytest.raises(RuntimeError, match="after close"):
        scorer.score(["a"], rows_for(["a"]))


def test_partial_credit_is_not_correctness():
    from lze_trainer.reward import as_correctness

    # reasoning-gym gives len(answer) / len(response) to a response that contains the answer.
    assert as_correctness([1.0, 0.5, 0.01, 0.0], 1.0) == [1.0, 0.0, 0.0, 0.0]
    assert as_correctness([0.6, 0.4], 0.5) == [1.0, 0.0]
    assert as_correctness([0.25, 1.0], None) == [0.25, 1.0]


def test_workers_leave_the_trainers_process_group():
    """torchrun preempts a rank with SIGTERM to the rank's whole process group, and the rank
    still scores the step in flight: a ready worker leads a process group of its own."""
    with RewardScorer(num_workers=2) as scorer:
        deadline = time.monotonic() + 60
        while not all(w.ready for w in scorer._workers) and time.monotonic() < deadline:
            scorer.score(["\\boxed{1}"], rows_for(["1"]))
        pids = [w.process.pid for w in scorer._workers]
        assert all(w.ready for w in scorer._workers)
        assert [os.getpgid(pid) for pid in pids] == pids != [os.getpgid(0)] * 2
