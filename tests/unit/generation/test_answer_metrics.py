"""finetune.generation.metrics on fixed strings: number normalisation, answer extraction, the metrics."""

from __future__ import annotations

import doctest

import pytest

from finetune.generation import metrics
from finetune.generation.metrics import (
    contains,
    exact_match,
    extract_answer,
    last_number,
    normalize_number,
    score,
)


def test_doctests() -> None:
    assert doctest.testmod(metrics).failed == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", "42"),
        ("-42", "-42"),
        ("1,234", "1234"),
        ("1,234,567.890", "1234567.89"),
        ("$18", "18"),
        ("$1,000.00", "1000"),
        ("3.0", "3"),
        ("3.10", "3.1"),
        ("72.", "72"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("-0", "0"),
        ("-0.0", "0"),
        ("007", "7"),
        ("100", "100"),
        (" 5 ", "5"),
        ("", None),
        ("-", None),
        ("abc", None),
        ("1e5", None),
        ("1.2.3", None),
        ("12kg", None),
    ],
)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 5.", "5"),
        ("It went from -3 to -7", "-7"),
        ("He paid $1,250.50 in total", "1250.5"),
        ("first 2 then 3 then 4", "4"),
        ("no number here", None),
        ("", None),
        ("ages 5-10", "10"),  # a hyphen between numbers is not a minus sign
        ("COVID-19 cases", "19"),
        ("x2 and y3", None),  # digits inside words are not numbers
        ("the list 1, 2, 3", "3"),
        ("10,000 people and 2.5 percent", "2.5"),
        ("a loss of -$5", "-5"),
        ("costs 12 dollars.", "12"),
        ("value: .75", "0.75"),
        ("1,23", "23"),  # not a thousands group
    ],
)
def test_last_number(text: str, expected: str | None) -> None:
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("#### 1,000", "1000"),
        ("####-5", "-5"),
        ("#### $18.00", "18"),
        ("#### 72.", "72"),
        ("#### 3\nthen more text with 99", "3"),  # the marked answer wins over a later number
        ("#### 4\n#### 5", "5"),  # the last marked answer
        ("#### .\nso 12", "12"),  # an empty marked answer falls back to the last number
        ("So she has 8 apples.", "8"),  # no marker: the last number
        ("I cannot tell.", None),
    ],
)
def test_extract_answer_gsm8k(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_extract_answer_with_another_pattern_or_none() -> None:
    assert extract_answer("Answer: B because 3 > 2", r"Answer:\s*([A-D])") == "B"
    assert extract_answer("The answer is 7 (not 8)", r"answer is (\d+)") == "7"
    assert extract_answer("#### 5 and 6", None) == "6"  # pattern off: the last number


@pytest.mark.parametrize(
    ("output", "expected", "correct"),
    [
        ("5 + 3 = 8\n#### 8", "Janet has 8 ducks.\n#### 8", True),
        ("The answer is 8.", "#### 8", True),
        ("The answer is $1,000.", "#### 1000", True),
        ("-3", "#### -3", True),
        ("3", "#### -3", False),
        ("2.50", "2.5", True),
        ("8.1", "8", False),
        ("no idea", "#### 8", False),
        ("", "#### 0", False),
        ("Paris", "Paris", True),  # no number in the reference: whole texts compared
        ("  Paris \n", "Paris", True),
        ("paris", "Paris", False),
        ("Paris, France", "Paris", False),
    ],
)
def test_exact_match(output: str, expected: str, correct: bool) -> None:
    assert exact_match(output, expected) is correct


@pytest.mark.parametrize(
    ("output", "expected", "case_sensitive", "correct"),
    [
        ("The capital is Paris.", "paris", False, True),
        ("The capital is Paris.", "paris", True, False),
        ("The capital is Paris.", "Paris", True, True),
        ("New   York\ncity", "new york", False, True),  # whitespace collapsed on both sides
        ("London", "Paris", False, False),
        ("anything", "", False, False),
        ("anything", "   ", False, False),
    ],
)
def test_contains(output: str, expected: str, case_sensitive: bool, correct: bool) -> None:
    assert contains(output, expected, case_sensitive=case_sensitive) is correct


def test_score_dispatches_and_rejects_unknown_metrics() -> None:
    assert score("exact_match", "#### 3", "3") is True
    assert score("contains", "YES", "yes") is True
    assert score("contains", "YES", "yes", case_sensitive=True) is False
    assert score("none", "x", "y") is None
    assert score("exact_match", "x", None) is None
    with pytest.raises(ValueError, match="unknown metric 'bleu'"):
        score("bleu", "x", "y")


@pytest.mark.parametrize(
    ("output", "expected", "equal"),
    [
        ("\\frac{1}{2}", "0.5", True),  # equal in math, not as strings or numbers exact_match reads
        ("The answer is $\\frac{1}{2}$", "0.5", True),
        ("$\\boxed{\\frac{2}{4}}$", "$\\frac{1}{2}$", True),
        ("$\\sqrt{4}$", "2", True),
        ("so $x = 2$", "$2$", True),
        ("1/3", "0.5", False),
        ("$x=3$", "2", False),
        ("I do not know", "0.5", False),
    ],
)
def test_math_verify_compares_answers_as_mathematics(output: str, expected: str, equal: bool) -> None:
    pytest.importorskip("math_verify", reason="math-verify is in the test extra")
    assert score("math_verify", output, expected) is equal
    if equal and "=" not in output:  # where exact_match already agrees ("x = 2" vs "2") it is no test
        assert score("exact_match", output, expected) is False


def test_math_verify_without_the_package_is_refused_naming_the_install(monkeypatch) -> None:
    from finetune.errors import FinetuneError

    real = metrics.importlib.util.find_spec
    monkeypatch.setattr(
        metrics.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "math_verify" else real(name, *a),
    )
    with pytest.raises(FinetuneError, match=r"eval.generation_sets\[m\].metric: .*pip install math-verify"):
        metrics.require_math_verify("eval.generation_sets[m].metric")
