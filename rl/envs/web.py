"""The web domain: answer a question by searching and reading an offline site.

The site is the task's own `pages` or a built-in `corpus` (rl/tools/corpora.py); the tools are
`search`, `open`, `find` (rl/tools/search.py). The grade is the final answer against the
task's `answer` under rl.tasks.answers' conventions (numbers exactly, text case-insensitively):
reward 1 or 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rl.envs.base import EnvContext, Environment, Grade, register
from rl.tasks.answers import answers_match, extract_answer
from rl.tasks.schema import Task
from rl.tools import corpora, search
from serving.types import Tool


def site_of(task: Task) -> search.Site:
  """The indexed site of a web task (shared, via the content-hash cache, by all its episodes)."""
  if task.fields.get("pages") is not None:
    return search.site_for(task["pages"])
  name = task["corpus"]
  return search.site_for(corpora.load_corpus(name), key=f"corpus:{name}:{corpora.corpus_version()}")


@register
class WebEnvironment(Environment):
  """One episode: a browser (the open document) over the task's site."""

  domain = "web"

  def __init__(self, task: Task, ctx: EnvContext):
    super().__init__(task, ctx)
    self.browser = search.Browser(site_of(task))

  def tools(self) -> Sequence[Tool]:
    return search.TOOLS

  def _call(self, name: str, arguments: dict[str, Any]) -> str:
    return self.browser.call(name, arguments)

  def grade(self, final_text: str) -> Grade:
    given = extract_answer(final_text)
    ok = answers_match(given, self.task["answer"])
    return Grade(reward=float(ok), success=ok, details={"given": given, "expected": self.task["answer"]})
