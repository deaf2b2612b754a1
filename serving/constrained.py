"""Constrained tool calls and structured answers: serving/grammar.py matchers in the chat format.

Three constraints, each a small state machine the output processor (serving/output.py) asks
for the next token's constraint (a forced id or a bool [V] mask) and feeds every token:

  * `ToolCallConstraint` -- tool_choice 'required' / 'named' (serving_spec.md, "Constrained
    tool calls"; Anthropic tool_choice any/tool): the answer is exactly

        <|tool_call|>{"name": "NAME", "arguments": {...}}<|/tool_call|><|end_of_turn|>

    with the markers as special ids, the JSON as ordinary text tokens valid under the tool's
    parameter schema; 'none' bans <|tool_call|>.
  * `CallConstraint` -- one call's JSON between the markers, then <|/tool_call|> forced. Under
    tool_choice 'auto' it constrains every call the model opens itself when some tool is
    strict (OpenAI `tools[].function.strict`, Anthropic `tools[].strict`): strict tools'
    arguments follow their schema, the others' are any JSON object.
  * `AnswerConstraint` -- OpenAI `response_format` json_object / json_schema, Anthropic
    `output_config.format`: the answer text is one JSON document (any object, or valid under
    the schema); <|end_of_turn|> is allowed once it is complete. Under tool_choice 'auto'
    the model may still open tool calls before the document starts.

The call JSON is `{"name": ..., "arguments": ...}` with ", " / ": " separators, the form
serving.chat.tool_call_json writes back into history. Numbers and non-ASCII text are not
forced into json.dumps' spelling (`1.50` and a raw `u` + umlaut are valid JSON); the parser
re-serialises arguments, so history then holds json.dumps' text.

Caveat: the mask admits every tokenization of valid text, not only the one
`tokenizer.encode` would produce; a model trained on rendered calls prefers the latter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from serving.grammar import Grammar, JsonMatcher, check_schema, compile_schema, validate_arguments
from serving.types import ResponseFormat, Tool, ToolChoice
from training.tokenizer import Tokenizer

__all__ = ["AnswerConstraint", "CallConstraint", "ToolCallConstraint", "build_constraints",
           "tool_call_schema", "validate_arguments"]

ANY_OBJECT = {"type": "object", "additionalProperties": True}


def _rebase_refs(schema: Any, base: str) -> Any:
  """`schema` with local `$ref`s ("#/...") pointing into its new place `base` in a bigger schema."""
  if isinstance(schema, list):
    return [_rebase_refs(s, base) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = {k: _rebase_refs(v, base) for k, v in schema.items()}
  ref = out.get("$ref")
  if isinstance(ref, str) and ref.startswith("#"):
    out["$ref"] = "#" + base + ref[1:]
  return out


def check_parameters(tool: Tool, field: str) -> None:
  """ValueError naming `field` unless the tool's parameters are a compilable object schema."""
  params = tool.parameters
  if not isinstance(params, dict) or params.get("type", "object") != "object":
    raise ValueError(f"{field} must be an object schema ({{'type': 'object', 'properties': ...}}), "
                     f"got {params!r}.")
  check_schema({**params, "type": "object"}, field)


def tool_call_schema(tools: Sequence[tuple[Tool, bool]]) -> dict[str, Any]:
  """One JSON schema for `{"name": NAME, "arguments": ARGS}` calling one of `tools`.

  tools: (tool, constrained) pairs; unconstrained tools take any JSON object as arguments.
  """
  branches = []
  for j, (tool, constrained) in enumerate(tools):
    base = ("/anyOf/%d" % j if len(tools) > 1 else "") + "/properties/arguments"
    # Arguments are an object even when the schema leaves `type` out (properties alone allow null).
    args = _rebase_refs({**tool.parameters, "type": "object"}, base) if constrained else ANY_OBJECT
    branches.append({"type": "object", "properties": {"name": {"const": tool.name}, "arguments": args},
                     "required": ["name", "arguments"], "additionalProperties": False})
  return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _forced_or_mask(mask: np.ndarray) -> int | np.ndarray:
  """A single allowed id as an int (the engine forces it), else the read-only mask."""
  n = np.count_nonzero(mask)
  if n == 0:
    raise RuntimeError("constrained decoding reached a state with no allowed token (a bug).")
  if n == 1:
    return int(mask.argmax())
  mask.flags.writeable = False
  return mask


class CallConstraint:
  """One call's JSON under `grammar`, then <|/tool_call|> (forced); `reset` for the next call."""

  def __init__(self, tokenizer: Tokenizer, grammar: Grammar):
    self._matcher = JsonMatcher(grammar)
    self._close = tokenizer.special_id("/tool_call")
    self.done = False

  @property
  def text(self) -> str:
    return self._matcher.text

  def reset(self) -> None:
    self._matcher.reset()
    self.done = False

  def next(self) -> int | np.ndarray | None:
    if self.done:
      return None
    if self._matcher.complete:
      return self._close
    return _forced_or_mask(self._matcher.mask())

  def advance(self, token_id: int) -> None:
    if self.done:
      raise ValueError(f"advance({token_id}): the call is complete.")
    if self._matcher.complete:
      if token_id != self._close:
        raise ValueError(f"advance({token_id}): the call {self.text!r} is complete; expected <|/tool_call|>.")
      self.done = True
      return
    try:
      self._matcher.consume(token_id)
    except ValueError as e:
      raise ValueError(f"advance({token_id}): {e}") from None


class ToolCallConstraint:
  """Forces one schema-valid tool call ('required' / 'named') or bans calls ('none').

  Phases: <|tool_call|> (forced), the JSON (masks) and <|/tool_call|> (a CallConstraint),
  <|end_of_turn|> (forced), done. 'none' never finishes: every step bans <|tool_call|> only.
  """

  def __init__(self, tokenizer: Tokenizer, tools: Sequence[Tool], choice: ToolChoice):
    tools = list(tools)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
      raise ValueError(f"tools: names must be distinct, got {names}.")
    self.mode = choice.mode
    self._open = tokenizer.special_id("tool_call")
    self._end = tokenizer.special_id("end_of_turn")
    self._phase = 0
    if choice.mode == "none":
      self._ban = np.ones(tokenizer.vocab_size, bool)
      self._ban[self._open] = False
      self._ban.flags.writeable = False
      return
    if choice.mode == "required":
      if not tools:
        raise ValueError("tool_choice 'required' needs at least one tool in `tools`.")
      chosen = list(enumerate(tools))
    elif choice.mode == "named":
      if choice.name not in names:
        raise ValueError(f"tool_choice.name={choice.name!r} is not one of the tools {names}; name one of "
                         "them or use tool_choice 'required'.")
      chosen = [(names.index(choice.name), tools[names.index(choice.name)])]
    else:
      raise ValueError(f"tool_choice.mode={choice.mode!r} is not constrained: ToolCallConstraint serves "
                       "'required', 'named' and 'none' ('auto' leaves the model free).")
    for i, tool in chosen:
      check_parameters(tool, f"tools[{i}].parameters")
    schema = tool_call_schema([(t, True) for _, t in chosen])
    self._call = CallConstraint(tokenizer, compile_schema(tokenizer, schema, "tools"))

  @property
  def done(self) -> bool:
    """The whole call, <|end_of_turn|> included, has been advanced ('none': never)."""
    return self.mode != "none" and self._phase == 3

  @property
  def text(self) -> str:
    """The JSON text advanced so far."""
    return "" if self.mode == "none" else self._call.text

  def next(self) -> int | np.ndarray | None:
    """The forced id, or a read-only bool [vocab_size] mask of allowed ids, or None when done."""
    if self.mode == "none":
      return self._ban
    if self._phase == 1:
      return self._call.next()
    return (self._open, None, self._end, None)[self._phase]

  def advance(self, token_id: int) -> None:
    """Consumes the generated token; ValueError (state unchanged) if it was not allowed."""
    tid = int(token_id)
    if self.mode == "none":
      if tid == self._open:
        raise ValueError("advance(<|tool_call|>): tool_choice 'none' bans tool calls.")
      return
    if self._phase == 1:
      self._call.advance(tid)
      self._phase += self._call.done
      return
    if self._phase == 3 or tid != self.next():
      raise ValueError(f"advance({tid}): not allowed here; expected {self.next()!r}.")
    self._phase += 1


class AnswerConstraint:
  """The answer is one JSON document (response_format); tool calls may open before it starts."""

  def __init__(self, tokenizer: Tokenizer, grammar: Grammar, *, calls_allowed: bool):
    self._matcher = JsonMatcher(grammar)
    self._open = tokenizer.special_id("tool_call")
    self._end = tokenizer.special_id("end_of_turn")
    self._calls_allowed = calls_allowed

  @property
  def text(self) -> str:
    return self._matcher.text

  def next(self, *, called: bool = False) -> int | np.ndarray:
    """called: the turn has made a tool call, so it may end before any document."""
    mask = self._matcher.mask()
    if not self._matcher.ids:
      mask[self._open] |= self._calls_allowed
      mask[self._end] |= called
    return _forced_or_mask(mask)

  def advance(self, token_id: int) -> None:
    if token_id == self._open and self._calls_allowed and not self._matcher.ids:
      return  # a tool call opens; the document has not started
    self._matcher.consume(token_id)


@dataclasses.dataclass
class Constraints:
  """What constrains one request's output (each None when that part is free)."""
  forced: ToolCallConstraint | None = None
  calls: CallConstraint | None = None
  answer: AnswerConstraint | None = None


def build_constraints(tokenizer: Tokenizer, tools: Sequence[Tool], choice: ToolChoice,
                      response_format: ResponseFormat | None) -> Constraints:
  """The constraints of a request; ValueError (naming the field) for a schema that cannot compile."""
  out = Constraints()
  if choice.mode in ("required", "named"):
    out.forced = ToolCallConstraint(tokenizer, tools, choice)
    return out  # the answer is the call: nothing else to constrain
  strict = [t.strict for t in tools]
  if choice.mode == "auto" and any(strict):
    for i, tool in enumerate(tools):
      if tool.strict:
        check_parameters(tool, f"tools[{i}].parameters")
    schema = tool_call_schema(list(zip(tools, strict, strict=True)))
    out.calls = CallConstraint(tokenizer, compile_schema(tokenizer, schema, "tools"))
  if response_format is not None:
    closed = response_format.schema is not None
    schema = response_format.schema if closed else ANY_OBJECT
    grammar = compile_schema(tokenizer, schema, "response_format", closed=closed)
    out.answer = AnswerConstraint(tokenizer, grammar, calls_allowed=choice.mode == "auto" and bool(tools))
  return out
