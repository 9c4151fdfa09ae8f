"""Scoring generated answers: answer extraction, number normalisation, exact match, contains.

Metrics (the `metric` argument of `score`):
* ``exact_match``: the answer extracted from the output equals the one extracted from the expected
  text. Extraction takes the last match of a regex's first group (default: GSM8K's ``#### 42``),
  else the last number in the text; numbers are normalised (``$1,234.50`` -> ``1234.5``). An
  expected text that holds no answer is compared whole (stripped, whitespace collapsed).
* ``math_verify``: Hugging Face's math-verify finds the answer in the output and in the expected
  text (LaTeX, ``\\boxed{}``, fractions, plain numbers) and compares them as mathematics
  (``\\frac{1}{2}`` equals ``0.5``; ``x = 2`` equals ``2``). The online-RL reward of the same name
  calls the same function.
* ``contains``: the expected text occurs in the output (case-insensitive unless asked otherwise).
* ``none``: no score; the samples are the result.
"""

from __future__ import annotations

import importlib.util
import re
from decimal import Decimal, InvalidOperation

from finetune.errors import FinetuneError

METRICS = ("exact_match", "math_verify", "contains", "none")
# GSM8K answers end with "#### <number>"; a model trained on them writes the same.
GSM8K_ANSWER_PATTERN = r"####\s*\$?\s*(-?[\d,.]+)"
# A number: optionally signed and with a currency sign, thousands commas, decimals (-3, $1,234.50, .5).
# A minus sign counts only where it is not a hyphen inside a word or a range ("5-3", "COVID-19"), and
# a number is never the tail of a word or of a longer number ("x2", "1,23").
_NUMBER = re.compile(
    r"(?:(?<![\w.])(-))?\$?(?<![\w.])((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?![\d,]*\d)"
)


def normalize_number(text: str) -> str | None:
    """A number written in `text` in canonical form, or None when `text` is not a number.

    Strips spaces, ``$``, thousands commas and a trailing period; drops trailing zeros after the
    decimal point; -0 is 0.

    >>> [normalize_number(s) for s in ["1,234", "$5.00", "-3.50", "42.", " 007 ", "-0", "1e3", "x"]]
    ['1234', '5', '-3.5', '42', '7', '0', None, None]
    """
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:  # pragma: no cover - the regex only lets decimals through
        return None
    return "0" if value == 0 else format(value.normalize(), "f")


def last_number(text: str) -> str | None:
    """The last number in `text`, normalised; None when there is none.

    >>> last_number("3 apples cost $1,250.50, so -2 left."), last_number("no digits"), last_number("ages 5-10")
    ('-2', None, '10')
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    sign, digits = matches[-1]
    return normalize_number(sign + digits)


def extract_answer(text: str, pattern: str | None = GSM8K_ANSWER_PATTERN) -> str | None:
    """The answer in `text`: the last match of `pattern` (its first group, or the whole match when
    it has none), normalised as a number when it is one; else the last number in the text.

    >>> extract_answer("She has 3 + 4 = 7 eggs.\\n#### 7"), extract_answer("So the answer is 1,000.")
    ('7', '1000')
    >>> extract_answer("#### -12.0 (and 5 more)"), extract_answer("no idea") is None
    ('-12', True)
    """
    if pattern:
        matches = list(re.finditer(pattern, text))
        if matches:
            last = matches[-1]
            found = last.group(1) if last.re.groups else last.group(0)
            if found is not None:
                number = normalize_number(found)
                if number is not None:
                    return number
                if found.strip(" .,$"):
                    return found.strip()
    return last_number(text)


def normalize_text(text: str, *, case_sensitive: bool = True) -> str:
    """Stripped, inner whitespace collapsed to single spaces, lower-cased unless case_sensitive.

    >>> normalize_text("  Paris\\n is  nice ", case_sensitive=False)
    'paris is nice'
    """
    out = " ".join(text.split())
    return out if case_sensitive else out.lower()


def exact_match(output: str, expected: str, *, pattern: str | None = GSM8K_ANSWER_PATTERN) -> bool:
    """Whether the answer in `output` equals the answer in `expected` (see extract_answer); an
    expected text with no answer in it (no pattern match, no number) must equal the whole output
    (normalize_text).

    >>> exact_match("The total is $1,200.", "#### 1200"), exact_match("It is 12.", "#### 1200")
    (True, False)
    >>> exact_match(" Paris ", "Paris"), exact_match("I have no idea", "#### 3")
    (True, False)
    """
    gold = extract_answer(expected, pattern)
    if gold is None:
        return normalize_text(output) == normalize_text(expected)
    return extract_answer(output, pattern) == gold


def contains(output: str, expected: str, *, case_sensitive: bool = False) -> bool:
    """Whether `expected` (stripped, whitespace collapsed) occurs in `output`; an empty expected text
    never counts as found.

    >>> contains("The capital is PARIS.", "paris"), contains("x", ""), contains("Paris", "paris", case_sensitive=True)
    (True, False, False)
    """
    needle = normalize_text(expected, case_sensitive=case_sensitive)
    return bool(needle) and needle in normalize_text(output, case_sensitive=case_sensitive)


def require_math_verify(where: str) -> None:
    """Refuse math_verify at start when the math-verify package is missing (`where` names the
    recipe field that asked for it)."""
    if importlib.util.find_spec("math_verify") is None:
        raise FinetuneError(
            f"{where}: math_verify needs Hugging Face's math-verify package: pip install math-verify"
        )


def math_equal(output: str, expected: str) -> bool:
    """Whether math-verify finds the answer in `output` mathematically equal to `expected`'s.

    parse() extracts the answer from free text (LaTeX, ``\\boxed{}``, plain numbers); verify()
    compares symbolically and numerically. Order matters: the expected answer goes first.

    >>> math_equal("so x = \\\\frac{1}{2}", "0.5"), math_equal("$\\\\boxed{3}$", "$x=3$"), math_equal("1/3", "0.5")
    (True, True, False)
    """
    from math_verify import parse, verify

    return bool(verify(parse(expected), parse(output)))


def score(
    metric: str,
    output: str,
    expected: str | None,
    *,
    pattern: str | None = GSM8K_ANSWER_PATTERN,
    case_sensitive: bool = False,
) -> bool | None:
    """One output scored by `metric` (exact_match, math_verify, contains, none); None for none or no
    expected text.

    >>> score("exact_match", "#### 4", "4"), score("contains", "Yes!", "yes"), score("none", "a", "b")
    (True, True, None)
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    if metric == "none" or expected is None:
        return None
    if metric == "exact_match":
        return exact_match(output, expected, pattern=pattern)
    if metric == "math_verify":
        return math_equal(output, expected)
    return contains(output, expected, case_sensitive=case_sensitive)
