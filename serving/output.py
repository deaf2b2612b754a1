"""Turns a request's generated token ids into thinking, text and tool calls.

`OutputProcessor` implements `serving.types.TokenProcessor`: the engine asks
it for a constraint before sampling each token and feeds it every sampled
token. It is a small state machine over Horizon's chat format
(serving/chat.py):

    [<|think|>] thinking <|/think|>  answer text  <|tool_call|>{json}<|/tool_call|> ... <|end_of_turn|>

Why each piece exists:
  * Thinking budgets (the issue's low/high/max tiers, Anthropic's
    budget_tokens): once the budget is spent, `next_constraint` forces
    <|/think|>, and the answer continues. Thinking cannot run away with
    max_tokens.
  * Incremental detokenization holds back an incomplete UTF-8 tail: byte-level
    BPE may split one character over several tokens, and a client must never
    see a U+FFFD that later turns into a real character.
  * Stop strings are matched on the answer text across token boundaries; text
    that could still become a stop string is held back, so nothing after (or
    part of) a stop string ever reaches the client.
  * Tool calls are buffered between their markers and only emitted once
    complete and valid, so streaming never leaks markers or partial JSON.
    Model output is untrusted: malformed calls (bad JSON, an unknown tool,
    another special token inside, no closing marker) become plain text plus a
    `logging.warning`, never an exception that would kill the request.
  * tool_choice 'required'/'named' hands the answer to
    `serving.constrained.ToolCallConstraint` (llguidance token masks that
    force one schema-valid call); 'none' bans <|tool_call|>. Strict tools
    constrain the calls the model opens itself, and a response_format
    constrains the answer text to one JSON document (serving/constrained.py).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Sequence

import numpy as np

from serving.types import (
  Delta,
  FreeRun,
  ResponseFormat,
  TextDelta,
  ThinkingDelta,
  Tool,
  ToolCall,
  ToolCallDelta,
  ToolChoice,
  loads_json,
)

_log = logging.getLogger(__name__)

AUTO = ToolChoice()  # the default tool_choice: the model decides

REPLACEMENT = "\ufffd"  # what decoding makes of bytes that are not (yet) valid UTF-8


class IncrementalDetokenizer:
  """Token ids in, text out, never splitting a UTF-8 character.

  Decoding is byte-level, so text can be emitted at any point where the bytes
  so far end on a complete character. When the decoded pending ids end with
  U+FFFD the tail may be an incomplete character; it is held back until a
  later token completes it (or `flush`). An incomplete tail is at most 3
  bytes, so it lies within the last 3 tokens: earlier text is emitted when
  it is unchanged by what follows, which bounds the pending ids even for
  garbage (lone continuation bytes).
  """

  def __init__(self, tokenizer):
    self._tok = tokenizer
    self._pending: list[int] = []

  @property
  def has_pending(self) -> bool:
    return bool(self._pending)

  def add(self, token_id: int) -> str:
    """Appends one (non-special) token; returns the text that is now final ('' if none)."""
    self._pending.append(int(token_id))
    text = self._tok.decode(self._pending)
    if not text.endswith(REPLACEMENT):
      self._pending = []
      return text
    for k in range(1, min(3, len(self._pending) - 1) + 1):
      head = self._tok.decode(self._pending[:-k])
      # Emit a head that is final: it ends on a complete character (or, at the
      # 3-token bound, is invalid whatever follows) and the full text agrees.
      if head and (k == 3 or not head.endswith(REPLACEMENT)) and text.startswith(head):
        self._pending = self._pending[-k:]
        return head
    return ""

  def flush(self) -> str:
    """All held-back text (an incomplete character decodes to U+FFFD)."""
    text = self._tok.decode(self._pending) if self._pending else ""
    self._pending = []
    return text


class _StopMatcher:
  """Finds stop strings in streamed text, holding back what could start one.

  The first stop string to complete wins (the earliest, then the longest, if
  several complete within one pushed piece).
  """

  def __init__(self, stops: Sequence[str]):
    self.stops = tuple(stops)
    self._longest = max((len(s) for s in self.stops), default=0)
    self._held = ""

  def push(self, text: str) -> tuple[str, str | None]:
    """(text safe to emit, the stop string matched or None)."""
    if not self.stops:
      return text, None
    buf = self._held + text
    hits = [(buf.find(s), -len(s), s) for s in self.stops if s in buf]
    if hits:
      pos, _, stop = min(hits)
      self._held = ""
      return buf[:pos], stop
    keep = 0
    for k in range(min(len(buf), self._longest - 1), 0, -1):
      if any(s.startswith(buf[-k:]) for s in self.stops):
        keep = k
        break
    self._held = buf[len(buf) - keep:]
    return buf[:len(buf) - keep], None

  def flush(self) -> str:
    held, self._held = self._held, ""
    return held


def _emit(out: list[Delta], cls: type, text: str) -> None:
  """Appends a ThinkingDelta/TextDelta, merging with the previous one of the same kind."""
  if not text:
    return
  if out and type(out[-1]) is cls:
    out[-1] = cls(out[-1].text + text)
  else:
    out.append(cls(text))


def parse_tool_call(raw: str, tools: dict[str, Tool]) -> tuple[str, str]:
  """The (name, arguments JSON text) of a tool call's content; ValueError says what is wrong."""
  try:
    obj = loads_json(raw)
  except (ValueError, RecursionError) as e:
    raise ValueError(f"not valid JSON ({str(e)[:100]})") from None
  if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
    raise ValueError("expected a JSON object with exactly the keys 'name' and 'arguments'")
  name, args = obj["name"], obj["arguments"]
  if not isinstance(name, str) or name not in tools:
    raise ValueError(f"unknown tool {name!r} (tools: {sorted(tools)[:10]})")
  if isinstance(args, str):
    try:
      args = loads_json(args)
    except (ValueError, RecursionError) as e:
      raise ValueError(f"'arguments' is a string but not JSON ({str(e)[:100]})") from None
  if not isinstance(args, dict):
    raise ValueError(f"'arguments' must be a JSON object, got {type(args).__name__}")
  return name, json.dumps(args, ensure_ascii=False)


_CALL_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"]*)(?:"\s*,\s*"arguments"\s*:\s*(?P<args>.*))?',
                          re.DOTALL)


def split_call_prefix(raw: str) -> tuple[str, str]:
  """(name, arguments text) of the start of a constrained call's JSON (either may be cut short)."""
  m = _CALL_PREFIX.match(raw)
  return (m["name"], m["args"] or "") if m else ("", "")


class OutputProcessor:
  """Per-request output state machine (serving.types.TokenProcessor).

  Args:
    tokenizer: the model's `training.tokenizer.Tokenizer`.
    thinking: the prompt ended with <|think|> (thinking on), so output starts
      in thinking; else it starts in the answer.
    thinking_budget: most thinking tokens before <|/think|> is forced (None:
      unlimited). With thinking off, a <|think|> the model emits itself before
      any answer gets this budget, or 0 (closed at once) when None.
    stop: stop strings, matched on the answer text (not thinking).
    tools: the tools a call may name.
    tool_choice: none (ban calls) / auto / required / named (constrained).
    call_id_prefix: prefix of generated call ids ("call_" OpenAI, "toolu_" Anthropic).
    response_format: the answer must be one JSON document (None: free text).

  Attributes (read after or during generation): thinking_tokens,
  stop_sequence, tool_calls, text, thinking_text, malformed_calls (how many
  calls were delivered as text because they were broken).
  """

  def __init__(self, tokenizer, *, thinking: bool, thinking_budget: int | None,
               stop: Sequence[str] = (), tools: Sequence[Tool] = (),
               tool_choice: ToolChoice = AUTO, call_id_prefix: str = "call_",
               response_format: ResponseFormat | None = None):
    _check_args(thinking_budget, stop, tools, tool_choice)
    self._tok = tokenizer
    self._tools = {t.name: t for t in tools}
    self._choice = tool_choice
    self._prefix = call_id_prefix
    self._budget = thinking_budget
    sp = tokenizer.special_ids
    self._specials = frozenset(sp.values())
    self._id = {name: tokenizer.special_id(name)
                for name in ("eos", "end_of_turn", "think", "/think", "tool_call", "/tool_call")}
    self._not_thinking = frozenset((self._id["/think"], self._id["eos"], self._id["end_of_turn"]))
    self._phase = "think" if thinking else "answer"
    self._may_open_think = not thinking  # until the first answer token
    self._think_detok = IncrementalDetokenizer(tokenizer)
    self._text_detok = IncrementalDetokenizer(tokenizer)
    self._matcher = _StopMatcher(stop)
    self._call_ids: list[int] = []
    self._finish: str | None = None
    self._closed = False
    self._ban = None
    if tool_choice.mode == "none":
      self._ban = np.ones(tokenizer.vocab_size, bool)
      self._ban[self._id["tool_call"]] = False
    self._constraint = self._calls = self._answer = None
    strict = any(t.strict for t in tools)
    if tool_choice.mode in ("required", "named") or response_format is not None or strict:
      from serving.constrained import build_constraints  # heavy: built only when needed
      built = build_constraints(tokenizer, tools, tool_choice, response_format)
      self._constraint, self._calls, self._answer = built.forced, built.calls, built.answer
    self.thinking_tokens = 0
    self.stop_sequence: str | None = None
    self.tool_calls: list[ToolCall] = []
    self.malformed_calls = 0
    self._text: list[str] = []
    self._thinking: list[str] = []

  @property
  def text(self) -> str:
    """All answer text delivered so far."""
    return "".join(self._text)

  @property
  def thinking_text(self) -> str:
    """All thinking text delivered so far."""
    return "".join(self._thinking)

  def finish_reason(self, reason: str) -> str:
    """The API-level finish reason for the engine's `reason`.

    The engine ends on a stop token (end of turn / EOS) itself without feeding
    it here, and reports 'stop'; a turn that made >= 1 valid tool call (and
    was not cut by a stop string) finished with 'tool_calls'. Text cut at a stop string finished
    with 'stop', also when the string completed only in what `close` flushed (an unclosed call's
    text at 'length'), so the reason agrees with `stop_sequence`.
    """
    if self.stop_sequence is not None and reason in ("stop", "length"):
      return "stop"
    if reason == "stop" and self.tool_calls:
      return "tool_calls"
    return reason

  # ---------------------------------------------------------- TokenProcessor --

  def next_constraint(self) -> int | np.ndarray | None:
    """<|/think|> when the budget is spent; the tool-call constraint's next step; the ban mask."""
    if self._finish is not None or self._closed:
      return None
    if self._phase == "think":
      if self._budget is not None and self.thinking_tokens >= self._budget:
        return self._id["/think"]
      return self._ban
    if self._constraint is not None and not self._constraint.done:
      return self._constraint.next()
    if self._one_call_made():
      return self._id["end_of_turn"]
    if self._phase == "call" and self._calls is not None:
      return self._calls.next()
    if self._phase == "answer" and self._answer is not None:
      return self._answer.next(called=bool(self.tool_calls))
    return self._ban

  def free_run(self) -> FreeRun | None:
    """Tokens the engine may decode without asking again (serving.types.FreeRun): in thinking, up
    to the budget, and in a free answer, under the ban mask until a special token (every phase
    change starts with one); None while a grammar or tool-call constraint steps with each token."""
    if self._finish is not None or self._closed:
      return None
    if self._phase == "think":
      left = (1 << 30) if self._budget is None else self._budget - self.thinking_tokens
      return FreeRun(self._ban, self._specials, left) if left > 0 else None
    free = (self._constraint is None or self._constraint.done) and not self._one_call_made()
    if self._phase == "answer" and free and self._answer is None:
      return FreeRun(self._ban, self._specials, 1 << 30)
    return None

  def feed(self, token_id: int) -> tuple[list[Delta], str | None]:
    """Consumes one generated token: (deltas, finish reason or None).

    Malformed model output never raises. The one exception: while a
    constraint is active (forced or strict tool calls, response_format), a
    token it did not allow (the engine ignored `next_constraint`) raises
    ValueError from its `advance` -- an engine bug, which the engine turns
    into finish reason 'error'.
    """
    token_id = int(token_id)
    if self._finish is not None or self._closed:
      return [], self._finish
    out: list[Delta] = []
    if self._phase != "think" and self._constraint is not None and not self._constraint.done:
      self._constraint.advance(token_id)
    elif self._phase == "call" and self._calls is not None:
      self._calls.advance(token_id)
    elif self._phase == "answer" and self._answer is not None:
      self._answer.advance(token_id)
    elif self._phase == "think" and token_id not in self._not_thinking:
      self.thinking_tokens += 1  # every token inside the block counts, dropped specials too
    if token_id in self._specials:
      self._special(token_id, out)
    elif self._phase == "think":
      self._deliver(out, ThinkingDelta, self._think_detok.add(token_id))
    elif self._phase == "call":
      self._call_ids.append(token_id)
    else:
      self._may_open_think = False
      self._answer_text(out, self._text_detok.add(token_id))
    return out, self._finish

  def close(self, reason: str) -> list[Delta]:
    """Flushes held-back thinking/text. Never raises.

    An unclosed tool call becomes text, except a forced one (tool_choice
    required/named) cut by 'length': it is delivered as a truncated ToolCall.
    """
    if self._closed:
      return []
    out: list[Delta] = []
    if self.stop_sequence is None:
      if self._phase == "think":
        self._deliver(out, ThinkingDelta, self._think_detok.flush())
      elif self._phase == "call" and self._constraint is not None and reason == "length":
        self._truncated_call(out)
      elif self._phase == "call":
        self._malformed(out, "no closing <|/tool_call|> before the end of generation "
                        f"(finish reason {reason!r})")
      self._end_text_run(out)
    self._closed = True
    return out

  # ---------------------------------------------------------------- internals --

  def _one_call_made(self) -> bool:
    """tool_choice.parallel False and a call has closed: the turn ends now (OpenAI
    parallel_tool_calls=false, Anthropic disable_parallel_tool_use)."""
    return not self._choice.parallel and self._phase == "answer" and bool(self.tool_calls)

  def _deliver(self, out: list[Delta], cls: type, text: str) -> None:
    if text:
      (self._thinking if cls is ThinkingDelta else self._text).append(text)
      _emit(out, cls, text)

  def _answer_text(self, out: list[Delta], text: str) -> None:
    """Answer text through the stop-string matcher."""
    if not text or self.stop_sequence is not None:
      return
    safe, stop = self._matcher.push(text)
    self._deliver(out, TextDelta, safe)
    if stop is not None:
      self.stop_sequence = stop
      self._finish = "stop"

  def _end_text_run(self, out: list[Delta]) -> None:
    """Text cannot continue (a tool call opens, or the request ended): deliver everything held back."""
    self._answer_text(out, self._text_detok.flush())
    if self.stop_sequence is None:
      self._deliver(out, TextDelta, self._matcher.flush())

  def _special(self, token_id: int, out: list[Delta]) -> None:
    ids = self._id
    if token_id in (ids["eos"], ids["end_of_turn"]):
      self._finish = "tool_calls" if self.tool_calls else "stop"
    elif self._phase == "call":
      if token_id == ids["/tool_call"]:
        self._finish_call(out)
        return
      self._malformed(out, f"special token {self._tok.decode([token_id])} inside the call")
      if self._finish is None:
        self._special(token_id, out)  # now in the answer: e.g. a new <|tool_call|> opens a call
    elif self._phase == "think" and token_id == ids["/think"]:
      self._deliver(out, ThinkingDelta, self._think_detok.flush())
      self._phase = "answer"
    elif self._phase == "answer" and token_id == ids["tool_call"]:
      self._may_open_think = False
      self._end_text_run(out)
      if self._finish is None:
        self._phase, self._call_ids = "call", []
        if self._calls is not None:
          self._calls.reset()
    elif self._phase == "answer" and token_id == ids["think"] and self._may_open_think:
      # thinking off, but the model opened a thinking block itself before any
      # answer: it gets the budget (0 = forced closed at the next step).
      self._may_open_think = False
      self._phase = "think"
      self._budget = self._budget if self._budget is not None else 0
    else:
      _log.debug("dropped special token %s in phase %s", self._tok.decode([token_id]), self._phase)

  def _finish_call(self, out: list[Delta]) -> None:
    try:
      name, args = parse_tool_call(self._tok.decode(self._call_ids), self._tools)
    except ValueError as e:
      self._malformed(out, str(e))
      return
    call = ToolCall(id=self._prefix + secrets.token_hex(12), name=name, arguments=args)
    out.append(ToolCallDelta(index=len(self.tool_calls), call=call))
    self.tool_calls.append(call)
    self._phase, self._call_ids = "answer", []

  def _truncated_call(self, out: list[Delta]) -> None:
    """A forced call cut by max_tokens: delivered as a truncated call (the constraint made its text
    a prefix of `{"name": "NAME", "arguments": {...}}`), as the vendors return one."""
    name, args = split_call_prefix(self._tok.decode(self._call_ids))
    if self._choice.mode == "named":
      name = self._choice.name
    call = ToolCall(id=self._prefix + secrets.token_hex(12), name=name, arguments=args, truncated=True)
    out.append(ToolCallDelta(index=len(self.tool_calls), call=call))
    self.tool_calls.append(call)
    self._phase, self._call_ids = "answer", []

  def _malformed(self, out: list[Delta], why: str) -> None:
    """A broken tool call: its raw content becomes answer text, with a warning."""
    raw = self._tok.decode(self._call_ids)
    _log.warning("malformed tool call from the model (%s); delivered as text: %.200r", why, raw)
    self.malformed_calls += 1
    self._phase, self._call_ids = "answer", []
    self._answer_text(out, raw)


def _check_args(thinking_budget, stop, tools, tool_choice) -> None:
  if thinking_budget is not None and (isinstance(thinking_budget, bool) or
                                      not isinstance(thinking_budget, int) or thinking_budget < 0):
    raise ValueError(f"thinking_budget={thinking_budget!r}: expected an int >= 0 or None.")
  if isinstance(stop, str) or any(not isinstance(s, str) or not s for s in stop):
    raise ValueError(f"stop={stop!r}: expected a list of non-empty strings.")
  names = [t.name for t in tools]
  if len(set(names)) != len(names):
    raise ValueError(f"tools: duplicate tool names in {names}; names must be unique.")
  if not isinstance(tool_choice, ToolChoice) or tool_choice.mode not in ("none", "auto", "required",
                                                                          "named"):
    raise ValueError(f"tool_choice={tool_choice!r}: expected ToolChoice(mode=none|auto|required|named).")
  if tool_choice.mode in ("required", "named") and not tools:
    raise ValueError(f"tool_choice={tool_choice.mode!r} needs at least one tool in `tools`.")
  if tool_choice.mode == "named" and tool_choice.name not in names:
    raise ValueError(f"tool_choice names {tool_choice.name!r}, which is not among the tools {names}.")
