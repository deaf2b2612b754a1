"""The meaning both API front-ends give to effort, tool_choice and a failed generation.

OpenAI (serving/openai_request.py, openai_api.py) and Anthropic
(serving/anthropic_request.py, anthropic_api.py) spell these fields their own
way; what they map to in serving/types.py is decided once here. Each
front-end only translates its spelling and shapes the error its way (OpenAI:
`APIError` with `param`; Anthropic: `InvalidRequest` naming the field path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from serving.errors import APIError
from serving.types import Tool, ToolChoice

# Effort name -> thinking tier (None = thinking off), issue 5 / serving_spec.md. OpenAI's
# reasoning_effort and Anthropic's output_config.effort use the same names.
EFFORT_TIERS: dict[str, str | None] = {"none": None, "minimal": None, "low": "low", "medium": "high",
                                       "high": "high", "xhigh": "max", "max": "max"}


@dataclasses.dataclass(frozen=True)
class ThinkingSettings:
  """on: the model thinks first; budget: most thinking tokens; effort: the prompt's tier line;
  display: "summarized" (thinking text returned) or "omitted" (Anthropic: empty text, sealed signature)."""
  on: bool
  budget: int | None = None
  effort: str | None = None
  display: str = "summarized"


def effort_thinking(effort: str | None, serving: Any) -> ThinkingSettings:
  """Thinking for an effort name (serving_spec.md): none/minimal -> off; low -> tier low;
  medium/high -> high; xhigh/max -> max, with the tier's `config.serving.thinking_budgets`.

  Args:
    effort: a key of EFFORT_TIERS (each front-end validates its request field first), or None
      for `config.serving.default_effort`.
    serving: `config.serving` or the server's `Limits` (thinking_budgets, default_effort).
  Raises:
    APIError: 500, a default_effort that is not an effort name.
  """
  name = effort or serving.default_effort
  if name not in EFFORT_TIERS:
    raise APIError(500, f"config.serving.default_effort={name!r} is not one of {list(EFFORT_TIERS)}.")
  tier = EFFORT_TIERS[name]
  if tier is None:
    return ThinkingSettings(False)
  return ThinkingSettings(True, int(serving.thinking_budgets[tier]), tier)


def resolve_tool_choice(mode: str | None, tools: Sequence[Tool], name: str | None = None,
                        parallel: bool = True) -> ToolChoice:
  """The ToolChoice of a request: mode none / auto / required / named (`name`), None when not given;
  parallel=False: at most one call per turn.

  Not given, or auto without tools, is 'none' (nothing can be called).

  Raises:
    ValueError: required / named without tools, or a name that is not among the tools.
  """
  if mode is None or mode == "auto":
    return ToolChoice("auto", parallel=parallel) if tools else ToolChoice("none")
  if mode == "none":
    return ToolChoice("none")
  if not tools:
    raise ValueError("this tool_choice needs at least one tool in `tools`.")
  names = [t.name for t in tools]
  if mode == "named" and name not in names:
    raise ValueError(f"tool_choice names the tool {name!r}, which is not among `tools` ({', '.join(names)}).")
  return ToolChoice(mode, name if mode == "named" else None)


def generation_failure(finish_reason: str | None) -> APIError | None:
  """The error for a generation that did not end normally (None when it did).

  'cancelled' reaches a client only when the server shuts down (a client that
  went away gets nothing); 'error' or no final event is an engine failure.
  """
  if finish_reason == "cancelled":
    return APIError(503, "The request was cancelled because the server is shutting down; retry.")
  if finish_reason not in ("stop", "length", "tool_calls"):
    return APIError(500, "Generation failed inside the engine (see the server log); retry the request.")
  return None
