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
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from rl.agent.policy import Completion, Policy, Sampling, Session
from serving.types import Message, TextPart, Tool, ToolCall

_log = logging.getLogger(__name__)

# tier -> OpenAI reasoning_effort (our server maps xhigh to max; None = thinking off)
OPENAI_EFFORT = {None: "none", "low": "low", "high": "high", "max": "xhigh"}
_RETRY_STATUS = (408, 409, 429, 500, 502, 503, 504, 529)


class EndpointError(RuntimeError):
  """The endpoint refused or failed a request (after retries)."""


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
    base = base_url.rstrip("/")
    self.base_url = base[:-3] if base.endswith("/v1") else base
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
          return r.json()
        if r.status_code not in _RETRY_STATUS or attempt == self.retries:
          raise EndpointError(f"{self.base_url}{path} answered {r.status_code}: {r.text[:500]}")
      await asyncio.sleep(delay)
      delay *= 2
    raise AssertionError("unreachable")


class OpenAIPolicy(HTTPPolicy):
  """`POST /v1/chat/completions`."""

  api = "openai"

  def session(self, task, first, tools, tier, sampling) -> Session:
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
    headers = {"Authorization": f"Bearer {p.api_key}"} if p.api_key else {}
    data = await p.post("/v1/chat/completions", body, headers)
    choice = data["choices"][0]
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
    return _AnthropicSession(self, tools, tier, sampling)


_STOP = {
  "end_turn": "stop",
  "stop_sequence": "stop",
  "tool_use": "tool_calls",
  "max_tokens": "length",
  "refusal": "stop",
  "pause_turn": "stop",
}


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
    headers = {"anthropic-version": "2023-06-01"}
    if p.api_key:
      headers["x-api-key"] = p.api_key
    data = await p.post("/v1/messages", body, headers)
    blocks = data.get("content") or []
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


def make_http_policy(api: str, base_url: str, model: str, api_key: str | None = None, **kw) -> HTTPPolicy:
  """api = 'openai' | 'anthropic'."""
  if api == "openai":
    return OpenAIPolicy(base_url, model, api_key, **kw)
  if api == "anthropic":
    return AnthropicPolicy(base_url, model, api_key, **kw)
  raise ValueError(f"--api={api!r}: expected 'openai' or 'anthropic'")
