"""HTTP policies against scripted endpoints (httpx.MockTransport), references written out here: the
request bodies each API gets (thinking kept across turns, per-tier budgets, seeds), how responses
become completions, and how retries, context-full answers and broken 200s are handled."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rl.agent import http
from rl.agent.policy import Sampling
from serving.types import Message, TextPart, Tool, ToolCall

ECHO = Tool("echo", "Repeats.", {"type": "object", "properties": {"text": {"type": "string"}}})
USER = Message("user", [TextPart("hi")])


@pytest.fixture
def endpoint(monkeypatch):
  """serve(*responses): each request gets the next response (a Response or an exception to raise);
  returns the list of (path, headers, body) requests. Retry sleeps are recorded, not slept."""
  real = httpx.AsyncClient
  seen, sleeps = [], []

  def serve(*responses):
    queue = list(responses)
    seen.clear()

    def handler(request):
      seen.append((request.url.path, request.headers, json.loads(request.content)))
      r = queue.pop(0)
      if isinstance(r, Exception):
        raise r
      return r

    monkeypatch.setattr(http.httpx, "AsyncClient",
                        lambda timeout: real(timeout=timeout, transport=httpx.MockTransport(handler)))
    return seen

  async def no_sleep(s):
    sleeps.append(s)

  monkeypatch.setattr(http.asyncio, "sleep", no_sleep)
  serve.sleeps = sleeps
  return serve


def _complete(policy, messages=(USER,), tier=None, sampling=None, turn=0, tools=(ECHO,)):
  session = policy.session(None, [USER], list(tools), tier, sampling or Sampling())
  return asyncio.run(session.complete(list(messages), turn))


def _openai_reply(message, finish="stop", usage=None):
  return httpx.Response(200, json={"choices": [{"message": message, "finish_reason": finish}],
                                   "usage": usage or {}})


def test_openai_body_and_reply():
  """Catches a wrong seed formula, effort map, token-limit field, dropped tools; reasoning read from
  `reasoning` when `reasoning_content` is absent; finish reason, token counts and calls as returned."""
  seen = []

  def handler(request):
    seen.append(json.loads(request.content))
    call = {"id": "c1", "function": {"name": "echo", "arguments": '{"text": "a"}'}}
    return _openai_reply({"content": "ok", "reasoning": "mull", "tool_calls": [call]},
                         "tool_calls", {"completion_tokens": 17, "total_tokens": 90,
                                        "completion_tokens_details": {"reasoning_tokens": 5}})

  real = httpx.AsyncClient
  policy = http.OpenAIPolicy("http://h:1/v1/", "m", "k")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(http.httpx, "AsyncClient", lambda timeout: real(transport=httpx.MockTransport(handler)))
    sampling = Sampling(0.5, 0.9, 7, seed=3, max_tokens_per_turn=40)
    comp = _complete(policy, tier="max", sampling=sampling, turn=2)
  body = seen[0]
  assert body["seed"] == 3 * 1_000_003 + 2 and body["reasoning_effort"] == "xhigh"
  assert body["max_completion_tokens"] == 40 and "max_tokens" not in body
  assert (body["temperature"], body["top_p"], body["model"]) == (0.5, 0.9, "m")
  assert body["tools"] == [{"type": "function", "function": {"name": "echo", "description": "Repeats.",
                                                             "parameters": ECHO.parameters}}]
  assert comp.message.thinking == "mull"
  assert comp.message.tool_calls == [ToolCall("c1", "echo", '{"text": "a"}')]
  assert (comp.finish_reason, comp.thinking_tokens, comp.generated_tokens) == ("tool_calls", 5, 17)


def test_openai_seed_wraps_and_thinking_off_drops_reasoning(endpoint):
  seen = endpoint(_openai_reply({"content": "x", "reasoning_content": "r"}, None))
  comp = _complete(http.OpenAIPolicy("http://h", "m"), sampling=Sampling(seed=2**31), turn=1)
  assert seen[0][2]["seed"] == (2**31 * 1_000_003 + 1) % 2**31 and seen[0][2]["reasoning_effort"] == "none"
  assert comp.message.thinking is None and comp.finish_reason == "stop"  # a null finish reason is 'stop'
  assert seen[0][1].get("authorization") is None  # no key: no header


def test_openai_history_keeps_thinking_and_tool_ids():
  """A turn's thinking is resent with every later turn, tool results by their call id."""
  call = ToolCall("call_0_0", "echo", "{}")
  msgs = [Message("system", [TextPart("s")]), USER,
          Message("assistant", [TextPart("a")], thinking="plan", tool_calls=[call]),
          Message("tool", [TextPart("R")], tool_call_id="call_0_0", name="echo"),
          Message("assistant", [TextPart("b")], thinking="more")]
  out = http.openai_messages(msgs)
  assert out[0] == {"role": "system", "content": "s"}
  assert out[2]["reasoning_content"] == "plan" and out[3] == {"role": "tool", "tool_call_id": "call_0_0",
                                                             "content": "R"}
  assert out[4] == {"role": "assistant", "content": "b", "reasoning_content": "more"}


def _anthropic_reply(blocks, stop="end_turn", usage=None):
  return httpx.Response(200, json={"type": "message", "content": blocks, "stop_reason": stop,
                                   "usage": usage or {"input_tokens": 50, "output_tokens": 9}})


def test_anthropic_body_budget_and_reply(endpoint):
  """Per-tier budget clamped below max_tokens; top_k sent; systems joined; blocks read in full."""
  blocks = [{"type": "thinking", "thinking": "a", "signature": "s1"}, {"type": "text", "text": "x"},
            {"type": "thinking", "thinking": "b", "signature": "s2"}, {"type": "text", "text": "y"},
            {"type": "tool_use", "id": "t1", "name": "echo", "input": {"text": "z"}}]
  seen = endpoint(_anthropic_reply(blocks, "tool_use"), _anthropic_reply([]))
  policy = http.AnthropicPolicy("http://h", "m", "key", thinking_budgets={"low": 30, "high": 500},
                                count_tokens=len)
  msgs = [Message("system", [TextPart("one")]), Message("system", [TextPart("two")]), USER]
  comp = _complete(policy, msgs, tier="high", sampling=Sampling(top_k=5, max_tokens_per_turn=100))
  path, headers, body = seen[0]
  assert path == "/v1/messages" and headers["x-api-key"] == "key" and "authorization" not in headers
  assert body["thinking"] == {"type": "enabled", "budget_tokens": 99} and body["max_tokens"] == 100
  assert body["output_config"] == {"effort": "high"} and body["top_k"] == 5 and body["system"] == "one\n\ntwo"
  assert (comp.message.thinking, comp.message.content[0].text) == ("ab", "xy")
  assert comp.message.tool_calls == [ToolCall("t1", "echo", '{"text": "z"}')]
  assert (comp.finish_reason, comp.thinking_tokens, comp.generated_tokens) == ("tool_calls", 2, 9)
  seen.clear()
  _complete(policy, [USER], tier="low", sampling=Sampling(max_tokens_per_turn=100))
  assert seen[0][2]["thinking"] == {"type": "enabled", "budget_tokens": 30} and "top_k" not in seen[0][2]


@pytest.mark.parametrize("stop,want", [("max_tokens", "length"), ("end_turn", "stop"), ("other", "stop")])
def test_anthropic_stop_reasons(endpoint, stop, want):
  endpoint(_anthropic_reply([{"type": "text", "text": "x"}], stop))
  assert _complete(http.AnthropicPolicy("http://h", "m")).finish_reason == want


def test_anthropic_resends_its_blocks_and_groups_tool_results(endpoint):
  """Turn 2 sends turn 1's blocks as returned (thinking and signature kept); the two tool results
  go back in one user message, a later user text in its own."""
  blocks = [{"type": "thinking", "thinking": "t", "signature": "sig"},
            {"type": "tool_use", "id": "u1", "name": "echo", "input": {}},
            {"type": "tool_use", "id": "u2", "name": "echo", "input": {}}]
  seen = endpoint(_anthropic_reply(blocks, "tool_use"), _anthropic_reply([{"type": "text", "text": "done"}]))
  session = http.AnthropicPolicy("http://h", "m").session(None, [USER], [ECHO], "low", Sampling())

  async def two_turns():
    first = await session.complete([USER], 0)
    msgs = [USER, first.message,
            Message("tool", [TextPart("r1")], tool_call_id="u1", name="echo"),
            Message("tool", [TextPart("r2")], tool_call_id="u2", name="echo"),
            Message("user", [TextPart("go")])]
    await session.complete(msgs, 1)

  asyncio.run(two_turns())
  sent = seen[1][2]["messages"]
  assert sent[1] == {"role": "assistant", "content": blocks}
  assert sent[2] == {"role": "user", "content": [
    {"type": "tool_result", "tool_use_id": "u1", "content": "r1"},
    {"type": "tool_result", "tool_use_id": "u2", "content": "r2"}]}
  assert sent[3] == {"role": "user", "content": [{"type": "text", "text": "go"}]}


def _error(status, message, code=None):
  return httpx.Response(status, json={"error": {"message": message, **({"code": code} if code else {})}})


def test_retries_back_off_and_give_up(endpoint):
  """429 and 5xx are retried with doubling waits, `retries` times; a timeout too; a 404 is not."""
  seen = endpoint(httpx.Response(429, text="slow down"), _openai_reply({"content": "ok"}))
  assert _complete(http.OpenAIPolicy("http://h", "m")).message.content[0].text == "ok"
  assert len(seen) == 2 and endpoint.sleeps == [1.0]
  endpoint.sleeps.clear()
  seen = endpoint(*[httpx.Response(503, text="busy")] * 3)
  with pytest.raises(http.EndpointError, match="answered 503: busy"):
    _complete(http.OpenAIPolicy("http://h", "m", retries=2))
  assert len(seen) == 3 and endpoint.sleeps == [1.0, 2.0]
  seen = endpoint(httpx.Response(404, text="no such route"))
  with pytest.raises(http.EndpointError, match="answered 404"):
    _complete(http.OpenAIPolicy("http://h", "m", retries=3))
  assert len(seen) == 1
  seen = endpoint(httpx.ReadTimeout("slow"), httpx.ReadTimeout("slow"))
  with pytest.raises(http.EndpointError, match="ReadTimeout"):
    _complete(http.AnthropicPolicy("http://h", "m", retries=1))
  assert len(seen) == 2


def test_context_full_asks_again_with_the_room_named_or_half(endpoint):
  full = "max_completion_tokens=100 plus the prompt exceeds this model's context of 256 tokens; at most {}."
  ok = _openai_reply({"content": "k"})
  seen = endpoint(_error(400, full.format(61)), _error(400, full.format(500)), ok)
  comp = _complete(http.OpenAIPolicy("http://h", "m"), sampling=Sampling(max_tokens_per_turn=100))
  assert [b["max_completion_tokens"] for _, _, b in seen] == [100, 61, 30] and comp.finish_reason == "stop"
  assert endpoint.sleeps == []  # a context error is not a retry
  seen = endpoint(_error(400, full.format(1)), _openai_reply({"content": "k"}))
  _complete(http.OpenAIPolicy("http://h", "m"), sampling=Sampling(max_tokens_per_turn=100))
  assert [b["max_completion_tokens"] for _, _, b in seen] == [100, 1]
  seen = endpoint(_error(400, full.format(0)))
  comp = _complete(http.OpenAIPolicy("http://h", "m"), sampling=Sampling(max_tokens_per_turn=100))
  assert len(seen) == 1 and comp.finish_reason == "length" and comp.message.content[0].text == ""
  # our server's prompt-too-long leaves no room: the turn ends 'length' after one request (it was
  # asked again with 50, 25, ... tokens, each failing the same way)
  prompt = "The prompt is 300 tokens, but this model's context is 256 tokens; shorten the input."
  seen = endpoint(_error(400, prompt, "context_length_exceeded"), ok)
  comp = _complete(http.OpenAIPolicy("http://h", "m"), sampling=Sampling(max_tokens_per_turn=100))
  assert [b["max_completion_tokens"] for _, _, b in seen] == [100] and comp.finish_reason == "length"
  # a context error naming no room is halved
  seen = endpoint(_error(400, "the request is past the context window", "context_length_exceeded"), ok)
  _complete(http.OpenAIPolicy("http://h", "m"), sampling=Sampling(max_tokens_per_turn=100))
  assert [b["max_completion_tokens"] for _, _, b in seen] == [100, 50]
  seen = endpoint(_error(400, "temperature must be >= 0"))  # a 400 about anything else fails the turn
  with pytest.raises(http.EndpointError, match="answered 400"):
    _complete(http.OpenAIPolicy("http://h", "m"))


def test_anthropic_context_full_keeps_the_budget_below_the_limit(endpoint):
  """exceed context limit: P + M > C leaves C - P; thinking needs max_tokens >= 2."""
  seen = endpoint(_error(400, "input length and `max_tokens` exceed context limit: 150 + 100 > 200"),
                  _error(400, "input length and `max_tokens` exceed context limit: 199 + 50 > 200"))
  policy = http.AnthropicPolicy("http://h", "m", thinking_budgets={"low": 80})
  comp = _complete(policy, tier="low", sampling=Sampling(max_tokens_per_turn=100))
  assert [(b["max_tokens"], b["thinking"]["budget_tokens"]) for _, _, b in seen] == [(100, 80), (50, 49)]
  assert comp.finish_reason == "length"  # room 1: no thinking turn fits
  # A prompt alone past the context: the turn ends 'length' at once (it failed the turn, so the
  # episode ended 'error', which evaluation leaves out and replays on resume, failing again).
  too_long = {"type": "error", "error": {"type": "invalid_request_error",
                                         "message": "prompt is too long: 208310 tokens > 200000 maximum"}}
  seen = endpoint(httpx.Response(400, json=too_long))
  comp = _complete(policy, tier="low", sampling=Sampling(max_tokens_per_turn=100))
  assert len(seen) == 1 and comp.finish_reason == "length" and comp.message.content[0].text == ""
  seen = endpoint(_error(400, "input length and `max_tokens` exceed context limit: 199 + 50 > 200"),
                  _anthropic_reply([{"type": "text", "text": "k"}]))
  _complete(policy, sampling=Sampling(max_tokens_per_turn=50))
  assert [b["max_tokens"] for _, _, b in seen] == [50, 1] and seen[1][2]["thinking"] == {"type": "disabled"}


@pytest.mark.parametrize("reply", [
  httpx.Response(200, text="<html>bad gateway</html>"),
  httpx.Response(200, json={"error": {"type": "overloaded_error", "message": "overloaded"}}),
  httpx.Response(200, json={"type": "error", "error": {"message": "overloaded"}}),
  httpx.Response(200, json={"choices": []}),
  httpx.Response(200, json={"choices": ["x"], "content": "x"}),
  httpx.Response(200, json=[]),
])
@pytest.mark.parametrize("cls", [http.OpenAIPolicy, http.AnthropicPolicy])
def test_a_broken_200_is_an_endpoint_error_not_an_empty_answer(endpoint, cls, reply):
  """An Anthropic 200 without `content` (a proxy's error page as JSON) read as an empty answer: the
  episode ended 'answer' and scored 0 as if the policy had played it; OpenAI's failed with a bare
  KeyError('choices'). Both are EndpointErrors naming the body now, so the episode ends 'error'."""
  endpoint(reply)
  with pytest.raises(http.EndpointError, match="answered 200"):
    _complete(cls("http://h", "m"))


def test_base_url_and_headers():
  urls = ("http://h:8/", "http://h:8/v1", "http://h:8/v1/", "http://h/api/v1")
  assert [http._base_url(u) for u in urls] == ["http://h:8", "http://h:8", "http://h:8", "http://h/api"]
  assert http.api_headers("anthropic", "k") == {"anthropic-version": "2023-06-01", "x-api-key": "k"}
  assert http.api_headers("openai", "k") == {"Authorization": "Bearer k"}


def test_one_policy_serves_successive_event_loops():
  """Each asyncio.run gets a client of its own loop: a kept-alive connection of a closed loop fails."""
  import threading
  from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

  class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_POST(self):
      self.rfile.read(int(self.headers["Content-Length"]))
      body = json.dumps({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *a):
      pass

  server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    policy = http.OpenAIPolicy(f"http://127.0.0.1:{server.server_address[1]}", "m", retries=0)
    assert [_complete(policy).message.content[0].text for _ in range(3)] == ["hi"] * 3
  finally:
    server.shutdown()
    server.server_close()


def test_an_unknown_tier_is_refused_when_the_session_opens(endpoint):
  """A tier with no reasoning_effort (OpenAI) or no thinking budget (Anthropic) failed every turn
  with a KeyError, and every episode ended 'error'; it is refused up front, as EnginePolicy does."""
  seen = endpoint()
  with pytest.raises(ValueError, match=r"tier 'medium' has no OpenAI reasoning_effort"):
    http.OpenAIPolicy("http://h", "m").session(None, [USER], [ECHO], "medium", Sampling())
  with pytest.raises(ValueError, match=r"tier 'max' has no thinking budget; configured tiers: \['low'\]"):
    http.AnthropicPolicy("http://h", "m", thinking_budgets={"low": 8}).session(None, [USER], [ECHO], "max",
                                                                               Sampling())
  assert seen == []
  for tier in (None, "low", "high", "max"):
    http.OpenAIPolicy("http://h", "m").session(None, [USER], [ECHO], tier, Sampling())
  http.AnthropicPolicy("http://h", "m", thinking_budgets={"low": 8}).session(None, [USER], [ECHO], None,
                                                                             Sampling())


def test_aclose_closes_the_loops_client_and_run_episodes_calls_it(endpoint):
  """The client of a finished asyncio.run was left to the garbage collector with its connections."""
  from rl.agent.loop import run_episodes

  endpoint(_openai_reply({"content": "a"}), _openai_reply({"content": "b"}))
  policy = http.OpenAIPolicy("http://x", "m", retries=0)

  async def turn_then_close():
    session = policy.session(None, [USER], [ECHO], None, Sampling())
    text = (await session.complete([USER], 0)).message.content[0].text
    client = policy._client
    await run_episodes([], policy, executor=None)
    return text, client

  text, client = asyncio.run(turn_then_close())
  assert text == "a" and client.is_closed and policy._client is None
  assert _complete(policy).message.content[0].text == "b"  # usable again: a new client
  asyncio.run(policy.aclose())  # another loop's client is not this loop's to close
  assert policy._client is not None and not policy._client.is_closed
