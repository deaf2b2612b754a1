"""The answer grader on written-out forms (each case names the convention it checks), beside
tests/rl/test_envs_mutants.py and tests/rl/test_schema.py."""

import pytest

from rl.tasks import answers


@pytest.mark.parametrize(("text", "expected"), [
  ('" Paris "', "paris"),  # the spaces inside the quotes go with them
  ("' 42. '", "42"),  # quotes, then spaces, then the full stop
  ("\u201c Rome \u201d.", "rome"),
  ("'  '", ""),
])
def test_normalize_strips_inside_the_quotes(text, expected):
  """Catches the text between the quotes kept with its spaces (`" Paris "` was not `Paris`)."""
  assert answers.normalize(text) == expected


@pytest.mark.parametrize(("given", "expected", "ok"), [
  ('" Paris "', "Paris", True),
  ("' utf-8 '", "utf-8", True),
  ('"Par is"', "Paris", False),
  ("1,234", "1234", True), ("-1,234.5", "-1234.5", True), ("1,23", "123", False), ("1,2345", "12345", False),
  ("- 3/4", "-0.75", True), ("3 / -4", "-0.75", True), ("3/4", "4/3", False),
  ("1.5e3", "1500", True), ("1.5E+3", "1500", True), ("15e-1", "1.5", True), ("1.5e3", "1501", False),
  ("\u22127", "-7", True), ("7", "-7", False),
  ("42 apples", "42", False), ("\\boxed{42}", "42", False),  # only <answer> content is read, no LaTeX
])
def test_equivalent_forms_accepted_and_others_refused(given, expected, ok):
  assert answers.answers_match(given, expected) is ok
