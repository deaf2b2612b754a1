"""Final answers: extraction from the assistant's text, normalisation, comparison.

The conventions every task file relies on (math, web, docqa, cad):
  * the answer is the content of the LAST `<answer>...</answer>` in the final assistant
    text (never the thinking), else the whole final text;
  * surrounding whitespace, quotes and one trailing full stop are dropped, case is ignored;
  * numbers (thousands separators, `$`, `%` removed; `3/4` = 0.75) compare numerically:
    math exactly: an integer answer only to a number of exactly that value, however written
    (`1234`, `1,234`, `1234.0`, `1.234e3`, `2468/2`; `1234.5` is wrong however large 1234
    is), any other numeric answer within relative 1e-9; docqa within the task's relative
    tolerance (absolute when the expected answer is 0);
  * spaces are dropped only next to `$`, `%` and a sign (`$ 12`, `45 %`, `- 3`): `12 34` is not
    1234;
  * an extracted answer longer than the expected one by more than MAX_ANSWER_CHARS is wrong
    (parsing a number of thousands of digits is slow, or refused by `int`).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction

MATH_REL_TOL = 1e-9
MAX_ANSWER_CHARS = 1000
_OPEN, _CLOSE = "<answer>", "</answer>"
_SYMBOL_SPACE = re.compile(r"(?<=[$+-])\s+|\s+(?=%)")
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_DECIMAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_FRACTION = re.compile(r"^([+-]?\d+)\s*/\s*([+-]?\d+)$")


def extract_answer(final_text: str) -> str:
  """The content of the last <answer>...</answer> in `final_text`, else the whole text.

  Tags pair as a non-greedy regex would pair them (each <answer> with the first </answer> after
  it, scanning on from there), in one linear pass: the regex took seconds on a final text of
  many unclosed tags.
  """
  text = final_text or ""
  found, pos = None, 0
  while (start := text.find(_OPEN, pos)) >= 0:
    end = text.find(_CLOSE, start + len(_OPEN))
    if end < 0:
      break
    found, pos = text[start + len(_OPEN):end], end + len(_CLOSE)
  return text if found is None else found


def normalize(text: str) -> str:
  """Whitespace, surrounding quotes and a trailing full stop dropped; lower case; a Unicode minus
  sign (U+2212, as typeset maths writes it) read as '-'."""
  s = str(text).strip().replace("\u2212", "-")
  while True:
    before = s
    if s.endswith("."):
      s = s[:-1].rstrip()
    if len(s) >= 2 and s[0] in _QUOTES and s[-1] in _QUOTES:
      s = s[1:-1].strip()
    if s == before:
      break
  return s.lower()


def _bare(text: str) -> str:
  """`normalize`d, then the spaces next to `$`, `%` or a sign and those symbols dropped."""
  return _SYMBOL_SPACE.sub("", normalize(text)).replace("$", "").replace("%", "")


def parse_number(text: str | int | float) -> float | None:
  """A number written as '1,234.5', '$12', '45%', '3/4', '-2e3' (after `normalize`); else None."""
  if isinstance(text, bool):
    return None
  if isinstance(text, (int, float)):
    return float(text) if math.isfinite(text) else None
  exact = _exact_value(text)
  if exact is None:
    return None
  try:
    value = float(exact)
  except OverflowError:  # a fraction of hundreds of digits: past the largest float, like '1e400'
    return None
  return value if math.isfinite(value) else None


def _exact_value(text: str) -> Decimal | Fraction | None:
  """The exact value of the number `text` writes (see `parse_number`), or None."""
  s = _bare(text)
  if _THOUSANDS.match(s):
    s = s.replace(",", "")
  m = _FRACTION.match(s)
  if m:
    den = int(m.group(2))
    return Fraction(int(m.group(1)), den) if den != 0 else None
  return Decimal(s) if _DECIMAL.match(s) else None


def _is_integer(text: str | int | float) -> bool:
  if isinstance(text, bool):
    return False
  if isinstance(text, int):
    return True
  if isinstance(text, float):
    return False
  s = _bare(text)
  return bool(re.fullmatch(r"[+-]?\d+", s) or _THOUSANDS.match(s) and "." not in s)


def _as_int(text: str | int) -> int:
  if isinstance(text, int):
    return text
  return int(_bare(text).replace(",", ""))


def numbers_close(given: float, expected: float, rel_tol: float) -> bool:
  """Relative comparison; absolute (|given| <= rel_tol) when the expected value is 0."""
  if expected == 0:
    return abs(given) <= rel_tol
  return abs(given - expected) <= rel_tol * abs(expected)


def answers_match(given: str, expected: str | int | float, rel_tol: float = MATH_REL_TOL) -> bool:
  """True iff the extracted answer `given` equals `expected` under the conventions above.

  When `expected` is a number (or a string that parses as one), the given answer must parse
  as a number within `rel_tol`; otherwise the normalised strings must be equal.
  """
  if len(given) > MAX_ANSWER_CHARS + len(str(expected)):
    return False
  want = parse_number(expected)
  if want is not None:
    got = parse_number(given)
    if got is not None:
      if rel_tol <= MATH_REL_TOL and _is_integer(expected):
        # "Exactly": 10**10 + 1, 10000000001.0 or 10000000000.5 is not 10**10, though each is
        # within 1e-9 of it. Compared as Decimal or Fraction, never converted to int:
        # '0e99999999' must stay cheap.
        return _exact_value(given) == _as_int(expected)
      return numbers_close(got, want, rel_tol)
  return normalize(given) == normalize(str(expected))
