"""The math environment: one question, no tools, the final answer compared exactly.

The answer is the last `<answer>...</answer>` of the final text (rl/tasks/answers.py);
an integer answer compares exactly (any written form of that value: `1,234`, `1234.0`), other
numbers at `MATH_REL_TOL` (1e-9 relative), anything else as normalised text. Reward is 1 or 0:
partial credit for a near miss would teach rounding, not arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

from rl.envs.base import Environment, Grade, register
from rl.tasks.answers import MATH_REL_TOL, answers_match, extract_answer
from serving.types import Tool


@register
class MathEnvironment(Environment):
  """A math episode: no tools; graded on the final answer."""

  domain = "math"

  def tools(self) -> Sequence[Tool]:
    return ()

  def grade(self, final_text: str) -> Grade:
    given = extract_answer(final_text)
    expected = self.task["answer"]
    ok = answers_match(given, expected, MATH_REL_TOL)
    return Grade(float(ok), ok, {"given": given.strip()[:200], "expected": expected})
