"""Policies behind an HTTP endpoint speaking the OpenAI or the Anthropic API.

Any server works: ours (`experiments.serve`), vLLM, or a vendor. Each turn sends the whole
conversation, thinking included, the way each API expects it back:
  * OpenAI chat completions: assistant messages carry `reasoning_content` and `tool_calls`;
    tool results are `tool` messages with their `tool_call_id`.
  * Anthropic messages: assistant turns are resent as the exact content blocks the server
    returned (thinking blocks with their signatures, text, tool_use); tool results go back
    as `tool_result` blocks in one user message.
Token ids are not available over these APIs, so sessions are not token-level; the thinking
token count comes from OpenAI's `reasoning_tokens`, or for Anthropic (whose usage has no
such field) from `count_tokens` when the caller supplies one.

Near the end of the context a turn asks for less, as the engine policy clamps a turn to the
context left: when the endpoint refuses the turn's token limit as past its context (a 400), the
turn is asked again with the room the error names (ours, OpenAI's and Anthropic's wordings), or
else half the limit; when not one token fits, the turn ends 'length' with nothing generated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from model.config import ConfigError
from rl.agent.policy import Completion, Policy, Sampling, Session
from serving.types import Message, TextPart, Tool, ToolCall

_log = logging.getLogger(__name__)

# tier -> OpenAI reasoning_effort (our server maps xhigh to max; None = thinking off)
OPENAI_EFFORT = {None: "none", "low": "low", "high": "high", "max": "xhigh"}
_RETRY_STATUS = (408, 409, 429, 500, 502, 503, 504, 529)


class EndpointError(RuntimeError):
  """The endpoint refused or failed a request (after retries)."""


class ContextFull(EndpointError):
  """The endpoint refused a turn whose prompt plus token limit is past its context (a 400); `room`
  is the largest limit the error names, when it names one (negative: the prompt alone is too long)."""

  def __init__(self, message: str, room: int | None):
    super().__init__(message)
    self.room = room


# How servers say a request is past the context, and the room it leaves: ours ("... exceeds the
# context of 256 tokens; ... at most 61"; a prompt alone too long: "The prompt is P tokens, but this
# model's context is C tokens" or "... so at least P tokens (one token covers at most 4 bytes), but
# this model's context is C tokens", whose "at most" is no room), OpenAI's ("maximum context length
# is C tokens. However, you requested T tokens (P in the messages, ..."), Anthropic's ("... exceed
# context limit: P + M > C", or for a prompt alone past it "prompt is too long: P tokens > C maximum").
_CONTEXT_WORDS = re.compile(r"context (length|limit|window|of)|exceeds? (the )?context|prompt is too long",
                            re.IGNORECASE)
_ROOM = (
  (re.compile(r"(?:prompt is|at least) (\d+) tokens\b.*?context is (\d+) tokens", re.DOTALL),
   lambda m: int(m[2]) - int(m[1])),
  (re.compile(r"at most (\d+)"), lambda m: int(m[1])),
  (re.compile(r"context length is (\d+) tokens.*?\((\d+) in the messages", re.DOTALL),
   lambda m: int(m[1]) - int(m[2])),
  (re.compile(r"(\d+) \+ (\d+) > (\d+)"), lambda m: int(m[3]) - int(m[1])),
  (re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum"), lambda m: int(m[2]) - int(m[1])),
)


def context_full(status: int, text: str) -> ContextFull | None:
  """The error a 400 response means when it says the request is past the context, else None."""
  if status != 400:
    return None
  try:
    err = json.loads(text).get("error")
  except (ValueError, AttributeError):
    err = None
  err = err if isinstance(err, dict) else {}
  message = str(err.get("message", text))
  if err.get("code") != "context_length_exceeded" and not _CONTEXT_WORDS.search(message):
    return None
  room = next((get(m) for pattern, get in _ROOM if (m := pattern.search(message))), None)
  return ContextFull(f"the endpoint answered 400: {message[:300]}", room)


def _json_object(r: httpx.Response, where: str) -> dict[str, Any]:
  """A 200's body, which must be a JSON object: else an EndpointError naming the body."""
  try:
    data = r.json()
  except ValueError:
    data = None
  if not isinstance(data, dict):
    raise EndpointError(f"{where} answered 200 without a JSON object: {r.text[:500]}")
  return data


def _no_reply(where: str, what: str, data: dict[str, Any]) -> EndpointError:
  """A 200 whose body lacks the reply (a proxy's error as JSON): the turn fails, rather than reading
  as an empty answer that the episode would be graded on."""
  return EndpointError(f"{where} answered 200 without {what}: {json.dumps(data)[:500]}")


def _text(m: Message) -> str:
  return "".join(p.text for p in m.content if isinstance(p, TextPart))


class HTTPPolicy(Policy):
  """Shared transport: base URL, key, model, retries with backoff, one client per policy.

  Args:
    base_url: e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted).
    model: the model name the endpoint serves.
    api_key: sent as `Authorization: Bearer` (OpenAI) or `x-api-key` (Anthropic).
    thinking_budgets: tier -> tokens (Anthropic `budget_tokens`).
    count_tokens: text -> token count, for thinking-token statistics (optional).
  """

  api = ""

  def __init__(
    self,
    base_url: str,
    model: str,
    api_key: str | None = None,
    *,
    thinking_budgets: Mapping[str, int] | None = None,
    count_tokens: Callable[[str], int] | None = None,
    timeout_s: float = 600.0,
    retries: int = 3,
  ):
    self.base_url = _base_url(base_url)
    self.model, self.api_key = model, api_key
    self.budgets = dict(thinking_budgets or {"low": 1024, "high": 4096, "max": 16384})
    self.count_tokens = count_tokens
    self.timeout_s, self.retries = timeout_s, retries
    self._client: httpx.AsyncClient | None = None

  def _http(self) -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    if self._client is None or getattr(self, "_loop", None) is not loop:
      self._client, self._loop = httpx.AsyncClient(timeout=self.timeout_s), loop
    return self._client

  async def aclose(self) -> None:
    """Closes the connection pool of the running loop's client (left to the garbage collector, a
    closed loop's sockets stayed open)."""
    if self._client is not None and getattr(self, "_loop", None) is asyncio.get_running_loop():
      client, self._client = self._client, None
      await client.aclose()

  async def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    delay = 1.0
    for attempt in range(self.retries + 1):
      try:
        r = await self._http().post(self.base_url + path, json=body, headers=headers)
      except httpx.TransportError as e:
        if attempt == self.retries:
          raise EndpointError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
      else:
        if r.status_code == 200:
          return _json_object(r, self.base_url + path)
        full = context_full(r.status_code, r.text)
        if full is not None:
          raise full
        if r.status_code not in _RETRY_STATUS or attempt == self.retries:
          raise EndpointError(f"{self.base_url}{path} answered {r.status_code}: {r.text[:500]}")
      await asyncio.sleep(delay)
      delay *= 2
    raise AssertionError("unreachable")

  async def post_turn(self, path: str, body: dict[str, Any], headers: dict[str, str], key: str,
                      limited: Callable[[dict[str, Any], int], dict[str, Any] | None] | None = None):
    """`post` for one turn; past the context, asks again with a smaller body[key] (the turn's token
    limit; module docstring). Returns None when the context is full.

    limited(body, n): the body with limit n, or None when n tokens cannot make a turn (default:
    body[key] = n).
    """
    while True:
      try:
        return await self.post(path, body, headers)
      except ContextFull as e:
        n = e.room if e.room is not None and e.room < body[key] else body[key] // 2
        body = (limited(body, n) if limited else {**body, key: n}) if n >= 1 else None
        if body is None:
          return None


class OpenAIPolicy(HTTPPolicy):
  """`POST /v1/chat/completions`."""

  api = "openai"

  def session(self, task, first, tools, tier, sampling) -> Session:
    if tier not in OPENAI_EFFORT:  # every episode would fail on its first turn with a KeyError
      raise ValueError(f"tier {tier!r} has no OpenAI reasoning_effort; tiers: low, high, max or None (off)")
    return _OpenAISession(self, tools, tier, sampling)


def openai_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
  """serving Messages -> OpenAI chat messages (thinking as reasoning_content)."""
  out = []
  for m in messages:
    if m.role == "assistant":
      msg: dict[str, Any] = {"role": "assistant", "content": _text(m)}
      if m.thinking:
        msg["reasoning_content"] = m.thinking
      if m.tool_calls:
        msg["tool_calls"] = [
          {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
          for c in m.tool_calls
        ]
      out.append(msg)
    elif m.role == "tool":
      out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": _text(m)})
    else:
      out.append({"role": m.role, "content": _text(m)})
  return out


class _OpenAISession(Session):
  def __init__(self, policy: OpenAIPolicy, tools: Sequence[Tool], tier: str | None, sampling: Sampling):
    self.policy, self.tier, self.sampling = policy, tier, sampling
    self.tools = [
      {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
      }
      for t in tools
    ]

  async def complete(self, messages, turn) -> Completion:
    p, s = self.policy, self.sampling
    body: dict[str, Any] = {
      "model": p.model,
      "messages": openai_messages(messages),
      "max_completion_tokens": s.max_tokens_per_turn,
      "temperature": s.temperature,
      "top_p": s.top_p,
      "seed": (s.seed * 1_000_003 + turn) % (2**31),
      "reasoning_effort": OPENAI_EFFORT[self.tier],
    }
    if self.tools:
      body["tools"] = self.tools
    headers = api_headers(p.api, p.api_key)
    data = await p.post_turn("/v1/chat/completions", body, headers, "max_completion_tokens")
    if data is None:
      return _full_context_turn()
    choices = data.get("choices")
    if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)
            and isinstance(choices[0].get("message"), dict)):
      raise _no_reply(p.base_url + "/v1/chat/completions", "choices[0].message", data)
    choice = choices[0]
    msg = choice["message"]
    thinking = msg.get("reasoning_content") or msg.get("reasoning")
    calls = [
      ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
      for c in msg.get("tool_calls") or []
    ]
    usage = data.get("usage") or {}
    reasoning = ((usage.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0
    message = Message(
      "assistant",
      [TextPart(msg.get("content") or "")],
      thinking=thinking if self.tier is not None else None,
      tool_calls=calls,
    )
    return Completion(
      message,
      choice.get("finish_reason") or "stop",
      thinking_tokens=int(reasoning),
      generated_tokens=int(usage.get("completion_tokens") or 0),
    )


class AnthropicPolicy(HTTPPolicy):
  """`POST /v1/messages` (anthropic-version 2023-06-01)."""

  api = "anthropic"

  def session(self, task, first, tools, tier, sampling) -> Session:
    if tier is not None and tier not in self.budgets:  # as EnginePolicy: not a KeyError on every turn
      raise ValueError(f"tier {tier!r} has no thinking budget; configured tiers: {sorted(self.budgets)}")
    return _AnthropicSession(self, tools, tier, sampling)


_STOP = {
  "end_turn": "stop",
  "stop_sequence": "stop",
  "tool_use": "tool_calls",
  "max_tokens": "length",
  "refusal": "stop",
  "pause_turn": "stop",
}


def _full_context_turn() -> Completion:
  """The turn of a full context: nothing generated, ended at the token limit."""
  return Completion(Message("assistant", [TextPart("")]), "length")


def _anthropic_limited(body: dict[str, Any], n: int) -> dict[str, Any] | None:
  """An Anthropic body with max_tokens n (its thinking budget below it), or None without room."""
  thinking = body.get("thinking") or {}
  if thinking.get("type") != "enabled":
    return {**body, "max_tokens": n}
  if n < 2:
    return None  # a thinking turn needs budget_tokens >= 1 below max_tokens
  budget = min(thinking["budget_tokens"], n - 1)
  return {**body, "max_tokens": n, "thinking": {**thinking, "budget_tokens": budget}}


class _AnthropicSession(Session):
  def __init__(self, policy: AnthropicPolicy, tools: Sequence[Tool], tier: str | None, sampling: Sampling):
    self.policy, self.tier, self.sampling = policy, tier, sampling
    self.tools = [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in tools]
    self.blocks: dict[int, list[dict[str, Any]]] = {}  # id(assistant Message) -> blocks as returned

  def _messages(self, messages: Sequence[Message]) -> tuple[str | None, list[dict[str, Any]]]:
    system, out = None, []
    for m in messages:
      if m.role == "system":
        system = _text(m) if system is None else system + "\n\n" + _text(m)
      elif m.role == "assistant":
        blocks = self.blocks.get(id(m))
        if blocks is None:  # not ours (e.g. a scripted history): rebuild text + tool_use
          blocks = ([{"type": "text", "text": _text(m)}] if _text(m) else []) + [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
            for c in m.tool_calls
          ]
        out.append({"role": "assistant", "content": blocks})
      elif m.role == "tool":
        block = {"type": "tool_result", "tool_use_id": m.tool_call_id, "content": _text(m)}
        if (
          out
          and out[-1]["role"] == "user"
          and out[-1]["content"]
          and out[-1]["content"][-1].get("type") == "tool_result"
        ):
          out[-1]["content"].append(block)
        else:
          out.append({"role": "user", "content": [block]})
      else:
        out.append({"role": "user", "content": [{"type": "text", "text": _text(m)}]})
    return system, out

  async def complete(self, messages, turn) -> Completion:
    p, s = self.policy, self.sampling
    system, msgs = self._messages(messages)
    body: dict[str, Any] = {
      "model": p.model,
      "messages": msgs,
      "max_tokens": s.max_tokens_per_turn,
      "temperature": s.temperature,
      "top_p": s.top_p,
    }
    if s.top_k:
      body["top_k"] = s.top_k
    if system is not None:
      body["system"] = system
    if self.tools:
      body["tools"] = self.tools
    if self.tier is None:
      body["thinking"] = {"type": "disabled"}
    else:
      budget = min(p.budgets[self.tier], s.max_tokens_per_turn - 1)  # Anthropic: budget < max_tokens
      body["thinking"] = {"type": "enabled", "budget_tokens": max(1, budget)}
      body["output_config"] = {"effort": self.tier}  # the tier stated in the prompt, whatever the budget
    headers = api_headers(p.api, p.api_key)
    data = await p.post_turn("/v1/messages", body, headers, "max_tokens", _anthropic_limited)
    if data is None:
      return _full_context_turn()
    blocks = data.get("content")
    if not isinstance(blocks, list):
      raise _no_reply(p.base_url + "/v1/messages", "content", data)
    thinking = "".join(b.get("thinking", "") for b in blocks if b.get("type") == "thinking")
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
    calls = [
      ToolCall(id=b["id"], name=b["name"], arguments=json.dumps(b.get("input", {})))
      for b in blocks
      if b.get("type") == "tool_use"
    ]
    message = Message(
      "assistant", [TextPart(text)], thinking=thinking if self.tier is not None else None, tool_calls=calls
    )
    self.blocks[id(message)] = blocks
    usage = data.get("usage") or {}
    thinking_tokens = p.count_tokens(thinking) if (p.count_tokens and thinking) else 0
    return Completion(
      message,
      _STOP.get(data.get("stop_reason"), "stop"),
      thinking_tokens=thinking_tokens,
      generated_tokens=int(usage.get("output_tokens") or 0),
    )


def _base_url(url: str) -> str:
  """The server's root: 'http://h:8000', 'http://h:8000/' and 'http://h:8000/v1' alike."""
  base = url.rstrip("/")
  return base[:-3] if base.endswith("/v1") else base


def api_headers(api: str, api_key: str | None) -> dict[str, str]:
  """What a request to an `api` ('openai' | 'anthropic') endpoint sends: the key as
  `Authorization: Bearer` (OpenAI) or `x-api-key` with `anthropic-version` 2023-06-01."""
  if api == "anthropic":
    return {"anthropic-version": "2023-06-01", **({"x-api-key": api_key} if api_key else {})}
  return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(api: str, base_url: str, api_key: str | None, preferred: str,
                 timeout_s: float = 30.0) -> str:
  """The model to ask an endpoint for when none is named: `preferred` (the config's model name) if
  the server lists it at GET /v1/models (both APIs have the route), else the one model it lists.
  A server listing several others, or none, is a ValueError naming --model; one that cannot be
  asked (no such route, down) keeps `preferred`, with a warning."""
  base = _base_url(base_url)
  try:
    r = httpx.get(base + "/v1/models", headers=api_headers(api, api_key), timeout=timeout_s)
    r.raise_for_status()
    ids = [m["id"] for m in r.json()["data"]]
  except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
    _log.warning("%s/v1/models: %s; asking for model %r (set --model to choose)", base, e, preferred)
    return preferred
  if preferred in ids:
    return preferred
  if len(ids) == 1:
    return ids[0]
  raise ValueError(f"{base}/v1/models lists {ids}, not {preferred!r}; choose one with --model.")


def make_http_policy(api: str, base_url: str, model: str, api_key: str | None = None, **kw) -> HTTPPolicy:
  """api = 'openai' | 'anthropic'."""
  if api == "openai":
    return OpenAIPolicy(base_url, model, api_key, **kw)
  if api == "anthropic":
    return AnthropicPolicy(base_url, model, api_key, **kw)
  raise ConfigError(f"--api={api!r}: expected 'openai' or 'anthropic'")
