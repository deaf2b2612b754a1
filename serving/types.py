"""The data shared by the chat renderer, the engine, the output parser and both APIs.

The OpenAI and Anthropic front-ends translate their JSON into these types and
back; RL rollouts build them directly. Nothing here depends on JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

Role = Literal["system", "user", "assistant", "tool"]
Effort = Literal["low", "high", "max"]
EFFORTS: tuple[str, ...] = ("low", "high", "max")


@dataclasses.dataclass(frozen=True)
class TextPart:
  text: str


@dataclasses.dataclass(frozen=True, eq=False)
class ImagePart:
  """An image already decoded and resized: float32 [H, W, C] in [0, 1]."""
  pixels: np.ndarray


Part = TextPart | ImagePart


def _reject_constant(name: str):
  raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):
    raise ValueError(f"the number {text[:40]} is out of a double's range")
  return value


def loads_json(text: str) -> Any:
  """json.loads for tool-call arguments, refusing what is not JSON though Python reads it: NaN,
  Infinity, and numbers past a double (1e999 would become inf, which json.dumps writes back as
  `Infinity` and strict encoders refuse). Raises ValueError (or RecursionError when too deep)."""
  return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A call the model made: `arguments` is a JSON object as text.

  truncated: generation stopped inside the call (max_tokens or the context), so
  `arguments` is an unfinished prefix of the JSON (and `name` may be cut too);
  the APIs return it with finish_reason 'length' / stop_reason 'max_tokens'.
  """
  id: str
  name: str
  arguments: str
  truncated: bool = False


@dataclasses.dataclass(frozen=True)
class Tool:
  """A tool the model may call: `parameters` is its JSON schema (an object schema).

  strict: every call to it is constrained to `parameters` (OpenAI `function.strict`,
  Anthropic `strict`), also when the model chooses to call it (tool_choice auto).
  """
  name: str
  description: str = ""
  parameters: dict[str, Any] = dataclasses.field(default_factory=lambda: {"type": "object"})
  strict: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class ResponseFormat:
  """The answer must be one JSON document: valid under `schema`, or any object when None.

  OpenAI `response_format` json_schema / json_object, Anthropic `output_config.format`.
  """
  schema: dict[str, Any] | None = None


@dataclasses.dataclass
class Message:
  """One turn. system/user: content. assistant: thinking, content, tool_calls.

  tool: content is the result of the call `tool_call_id` (to the tool `name`).
  """
  role: Role
  content: list[Part] = dataclasses.field(default_factory=list)
  thinking: str | None = None
  tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
  tool_call_id: str | None = None
  name: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolChoice:
  """none: never call; auto: the model decides; required: at least one call; named: call `name`.

  parallel=False (OpenAI `parallel_tool_calls: false`, Anthropic `disable_parallel_tool_use`):
  at most one call per turn; the turn ends when it closes. (required / named make one anyway.)
  """
  mode: Literal["none", "auto", "required", "named"] = "auto"
  name: str | None = None
  parallel: bool = True


# ---- what generation produces, in order, per request -------------------------
@dataclasses.dataclass(frozen=True)
class ThinkingDelta:
  text: str


@dataclasses.dataclass(frozen=True)
class TextDelta:
  text: str


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
  """A complete, valid tool call (emitted once its closing marker arrived); index counts calls."""
  index: int
  call: ToolCall


Delta = ThinkingDelta | TextDelta | ToolCallDelta

# Why a request ended. 'stop': end of turn / EOS / a stop string; 'length':
# max_tokens or the slot's context; 'tool_calls': the turn ended after tool
# calls; 'cancelled': the client went away; 'error': the engine failed.
FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]


class TokenProcessor(Protocol):
  """Per-request logic the engine consults around every sampled token.

  The engine is agnostic of chat structure: `serving.output.OutputProcessor`
  implements this (thinking budget, tool-call parsing, stop strings,
  constrained tool calls).
  """

  def next_constraint(self) -> int | np.ndarray | None:
    """A forced token id, or a bool [vocab] mask of allowed tokens, or None (free)."""

  def feed(self, token_id: int) -> tuple[list[Delta], str | None]:
    """Consumes the token just generated: (deltas to deliver, finish reason or None)."""

  def close(self, reason: str) -> list[Delta]:
    """The request ended (any reason): flushes held-back text; never raises."""

  # Optional: `free_run() -> FreeRun | None` lets the engine decode several tokens per device call
  # (serving/decode_loop.py); a processor without it gets one token per call.


class FreeRun(NamedTuple):
  """A token processor's promise for its next tokens (`free_run()`, serving/decode_loop.py): up to
  `max_tokens` tokens, as long as none is in `pause_ids`, are sampled under `mask` (bool [<= V];
  None = free) and feeding them does not change that. A token in `pause_ids` is sampled under
  `mask` too; then the engine stops the run so the processor sees it before the next constraint."""
  mask: np.ndarray | None
  pause_ids: frozenset[int]
  max_tokens: int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 = greedy. top_k 0 and top_p 1 disable those filters.

  seed: same seed + same request -> same output, whatever else the engine is
  running, when the engine is batch-invariant (config.serving.batch_invariant; otherwise the
  last bits of the logits, rarely a token, depend on how many rows decode together; None: the
  engine draws one). max_tokens counts every generated
  token, thinking included (both APIs define it so).
  """
  max_tokens: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None
  stop_token_ids: Sequence[int] = ()


@dataclasses.dataclass(frozen=True)
class Usage:
  """cached_tokens: prompt tokens loaded from the prefix cache instead of prefilled (a part of
  prompt_tokens; OpenAI's prompt_tokens_details.cached_tokens)."""
  prompt_tokens: int
  completion_tokens: int
  thinking_tokens: int = 0
  cached_tokens: int = 0
