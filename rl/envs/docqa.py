"""The docqa domain: answer a question about a long document given in the first message.

No tools: the document is the context. The grade is the final answer against the task's
`answer` within its relative `tolerance` (absolute when the answer is 0), as
rl.tasks.answers fixes it: reward 1 or 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from rl.envs.base import Environment, Grade, register
from rl.tasks.answers import answers_match, extract_answer
from serving.types import Tool


@register
class DocQAEnvironment(Environment):
  """One episode: the document and question are the first message; only the answer is graded."""

  domain = "docqa"

  def tools(self) -> Sequence[Tool]:
    return ()

  def grade(self, final_text: str) -> Grade:
    given = extract_answer(final_text)
    ok = answers_match(given, self.task["answer"], self.task["tolerance"])
    return Grade(reward=float(ok), success=ok, details={"given": given, "expected": self.task["answer"],
                                                        "tolerance": self.task["tolerance"]})
