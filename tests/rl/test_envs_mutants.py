"""Answer extraction, normalisation and comparison (rl/tasks/answers.py, the reward of math, web and
docqa) against values written out here; each test names the mistake it catches."""

import time

import pytest

from rl.tasks import answers

MATH = answers.MATH_REL_TOL


def test_an_empty_answer_tag_is_the_answer():
  """Catches `found or text`: an empty <answer></answer> fell back to the whole final text."""
  assert answers.extract_answer("I give up. <answer></answer> 42") == ""
  assert answers.extract_answer("<answer>7</answer> then <answer></answer>") == ""


@pytest.mark.parametrize("text, expected", [
  ("42 .", "42"),  # a full stop after a space: the space goes too
  ("'Paris' .", "paris"),
  ("'", "'"),  # a lone quote is no pair of quotes
  ('"', '"'),
  ("\u201cLyon\u201d", "lyon"),
])
def test_normalize(text, expected):
  """Catches a full stop dropped without the space before it, and a single quote character
  taken for a pair (then dropped)."""
  assert answers.normalize(text) == expected


@pytest.mark.parametrize("text, value", [
  ("1e3", 1000.0),
  ("2.5E-3", 0.0025),
  ("-1.5e+2", -150.0),
  (".5", 0.5),
  ("-.25", -0.25),
  ("3/-4", -0.75),
  ("-6 / -8", 0.75),
  ("+ 5", 5.0),
  ("1,234,567", 1234567.0),
])
def test_parse_number_reads_every_documented_form(text, value):
  """Catches the exponent, a leading-point decimal or a signed denominator dropped from the
  patterns, and a space after '+' (as after '-') kept."""
  assert answers.parse_number(text) == value


@pytest.mark.parametrize("text", ["1234,567", "12,34", "1e400", "-1e400", "1/0", "3/0",
                                  float("inf"), float("nan"), True, "1" * 990 + "/1", "9" * 400 + "/3"])
def test_parse_number_refuses_what_is_no_finite_number(text):
  """Catches a first group of 4 digits before a thousands comma, an infinite value kept, and a
  fraction of hundreds of digits raising OverflowError (the episode's grade crashed) instead of
  being no number."""
  assert answers.parse_number(text) is None


@pytest.mark.parametrize("given, expected, tol, ok", [
  ("+ 5", 5, MATH, True),
  ("1234", "1,234.0", MATH, True),  # an integer-valued expected string with a decimal point
  ("12", 12.0, MATH, True),  # a float expected answer
  ("12.0000001", 12.0, MATH, False),
  # A task's own tolerance applies to integer answers too: 1 off 100 is 1%.
  ("101", 100, 0.01, True),
  ("99", "100", 0.01, True),
  ("102", 100, 0.01, False),
  ("101", 100.0, 0.01, True),  # exactly at the tolerance: 1.0 <= 0.01 * 100
  ("0.001", 0, 1e-3, True),  # exactly at the absolute tolerance around 0
  ("-0.001", 0.0, 1e-3, True),
  ("0.0011", 0, 1e-3, False),
  # Symbols are dropped only from numbers: as text, '$paris' is not 'paris'.
  ("$paris", "paris", MATH, False),
  ("paris%", "paris", MATH, False),
  ("1" * 990 + "/1", 5, MATH, False),
  ("9" * 400 + "/3", "3", MATH, False),
])
def test_answers_match(given, expected, tol, ok):
  """Catches the integer path taken at a docqa tolerance, `<` for `<=` at the tolerance, text
  compared with its `$`/`%` dropped, an expected float or decimal string read as an int."""
  assert answers.answers_match(given, expected, tol) is ok


@pytest.mark.parametrize("given, expected, ok", [
  ("123456789100.0", 123456789012, False),  # 88 off: within 1e-9 relative, but a wrong integer
  ("1.234567891e11", "123456789012", False),
  ("1411750001.0", "1,411,750,000", False),
  ("1,411,750,001.0", 1411750000, False),
  ("123456789012.0", 123456789012, True),
  ("1.23456789012e11", 123456789012, True),
  ("1,411,750,000.00", 1411750000, True),
  ("246913578024/2", 123456789012, True),
  ("246913578026/2", 123456789012, False),
  ("42000000000/1000000000", 42, True),
  # Nor is a non-whole number, however close: '.5' appended to a wrong integer of ten digits
  # or more passed at 1e-9 relative, and 1e-10 passed for 0 at 1e-9 absolute.
  ("123456789100.5", 123456789012, False),
  ("123456789012.5", "123456789012", False),
  ("42.0000000001", 42, False),
  ("42000000001/1000000000", 42, False),
  ("1e-10", 0, False),
  ("-0.0", 0, True),
  ("0/7", "0", True),
])
def test_an_integer_answer_compares_exactly_however_written(given, expected, ok):
  """'10000000001' was refused for 10**10 but '10000000001.0' accepted (relative 1e-9 of 10**10 is
  10): appending '.0' turned a wrong integer answer of ten digits or more into reward 1."""
  assert answers.answers_match(given, expected) is ok


def test_a_whole_number_with_a_huge_exponent_stays_fast():
  start = time.monotonic()
  assert answers.answers_match("0e99999999", 0)
  assert not answers.answers_match("1e-99999999", 5)
  assert not answers.answers_match("1e300", 10**300 + 1)
  assert time.monotonic() - start < 1.0


def test_the_length_cap_counts_the_expected_answer():
  """Catches `>=` for `>`, and a cap that ignores the expected answer's own length."""
  assert answers.answers_match(" " * 1000 + "42", "42")  # 1002 characters: 1000 more than "42"
  assert not answers.answers_match(" " * 1001 + "42", "42")
  assert answers.answers_match(" " * 999 + "1" * 20, "1" * 20)
