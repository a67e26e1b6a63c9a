"""The math reward: equivalent forms score 1, wrong or missing answers 0, and no input raises or
takes long."""

import importlib
import sys
import threading

import pytest

pytest.importorskip("math_verify")

from eddyrl.core.rewarding import load_reward_fn  # noqa: E402
from eddyrl.tasks import math_reward  # noqa: E402
from eddyrl.tasks.math_reward import final_answer, reward  # noqa: E402


@pytest.mark.parametrize("response, gold", [
    ("so the answer is \\boxed{1/2}.", "0.5"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{1}{2}}", "1/2"),
    ("\\boxed{\\dfrac12}", "0.5"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
    ("\\boxed{x^2+1}", "1+x^2"),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}"),
    ("first \\boxed{7}, then on reflection \\boxed{26}", "26"),
    ("\\boxed{26} and then a cut-off \\boxed{2", "26"),
    ("She makes 9 * 2 = <<9*2=18>>18.\n#### 18", "18"),
    ("#### $1,000", "1000"),
    ("#### 18 dollars", "18"),
    ("Step by step...\nAnswer: 34", "34"),
    ("Answer: $\\frac{3}{4}$.", "0.75"),
])
def test_equivalent_answers_score_one(response, gold):
    assert reward(response, gold) == 1.0


@pytest.mark.parametrize("response, gold", [
    ("\\boxed{3}", "2"),
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{8}"),
    ("\\boxed{26} at first, but \\boxed{27}", "26"),
    ("Answer: 35", "34"),
    ("#### 17", "18"),
])
def test_wrong_answers_score_zero(response, gold):
    assert reward(response, gold) == 0.0


@pytest.mark.parametrize("response", [
    "The answer is 5", "5", "", "\\boxed{", "\\boxed{}", "Answer:", "####",
])
def test_no_stated_answer_scores_zero(response):
    assert reward(response, "5") == 0.0


def test_final_answer_prefers_boxed_then_answer_line_then_hashes():
    assert final_answer("Answer: 1\n#### 2\n\\boxed{3}") == "3"
    assert final_answer("#### 2\nAnswer: 1") == "1"
    assert final_answer("#### 2") == "2"
    assert final_answer("\\boxed{\\frac{1}{\\sqrt{2}}}") == "\\frac{1}{\\sqrt{2}}"
    assert final_answer("nothing here") is None


@pytest.mark.parametrize("response, gold", [
    ("x" * 5_000_000, "1"),  # a huge response with no answer
    ("\\boxed{" * 200_000, "1"),  # many unclosed boxes
    ("Answer: " + "(" * 2_000_000, "1"),  # a huge answer line
    ("\\boxed{" + "1" * 5000 + "}", "1"),  # an answer longer than MAX_ANSWER_CHARS
    ("\\boxed{\\frac{}{}\\sqrt[}", "1"),  # LaTeX that does not parse
    ("\\boxed{1}", "\\frac{"),  # a gold answer that does not parse
    ("\\boxed{1}", ""),
    (None, "1"),
    ("\\boxed{1}", None),
    (b"\\boxed{1}", 1),
])
@pytest.mark.timeout(120)  # a hang guard, not a speed check: each is refused before parsing
def test_garbage_scores_zero_fast(response, gold):
    assert reward(response, gold) == 0.0


@pytest.mark.timeout(120)  # without the cut-off this tower runs past 30 s; far past that
def test_a_slow_comparison_is_cut_off_by_the_timeout(monkeypatch):
    monkeypatch.setattr(math_reward, "VERIFY_TIMEOUT_S", 1)
    tower = "\\boxed{" + "9^" * 400 + "9}"
    assert reward(tower, "1") == 0.0


def test_works_off_the_main_thread():
    """SIGALRM timeouts need the main thread; elsewhere they are off instead of failing."""
    results = []
    worker = threading.Thread(target=lambda: results.extend(
        [reward("\\boxed{\\frac12}", "0.5"), reward("\\boxed{3}", "4")]))
    worker.start()
    worker.join(timeout=30)
    assert results == [1.0, 0.0]


def test_selectable_as_the_configured_reward():
    fn = load_reward_fn("eddyrl.tasks.math_reward:reward")
    assert fn("\\boxed{42}", "42") == 1.0


def test_missing_math_verify_is_a_clear_import_error(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "math_verify" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.delitem(sys.modules, "eddyrl.tasks.math_reward")
    with pytest.raises(ImportError, match=r"needs the math-verify package: "
                                          r"pip install 'eddyrl\[data\]'"):
        importlib.import_module("eddyrl.tasks.math_reward")
