"""HTTP policies against the real server: the same greedy episodes as the in-process engine.

The session's server (tests/conftest.py) serves the session's engine, so a greedy episode
played through the OpenAI or the Anthropic API must equal the one played on the engine
directly (thinking on and off).
"""

from __future__ import annotations

import asyncio

import pytest

from rl.agent.executor import ThreadExecutor
from rl.agent.http import AnthropicPolicy, EndpointError, OpenAIPolicy, openai_messages
from rl.agent.loop import run_episodes
from rl.agent.policy import EnginePolicy, Sampling
from rl.tasks.schema import parse_task
from serving.chat import ChatRenderer
from serving.types import Message, TextPart, ToolCall

GREEDY = Sampling(temperature=0.0, max_tokens_per_turn=24)


def _tasks():
  return [parse_task({"id": f"m{i}", "domain": "math", "prompt": f"{i} + {i} =", "answer": str(2 * i)})
          for i in range(3)]


@pytest.fixture(scope="module")
def engine_policy(engine, serve_config):
  return EnginePolicy(engine, ChatRenderer(engine.tokenizer, 0), dict(serve_config.serving.thinking_budgets))


def _play(policy, tasks, tiers):
  jobs = [(t, tier, GREEDY) for t in tasks for tier in tiers]
  executor = ThreadExecutor(workers=2)
  try:
    return asyncio.run(run_episodes(jobs, policy, executor, concurrency=4))
  finally:
    executor.shutdown()


@pytest.mark.parametrize("cls", [OpenAIPolicy, AnthropicPolicy])
def test_http_policy_equals_engine_policy(cls, engine_policy, server_url, serve_config):
  tasks, tiers = _tasks(), [None, "low"]
  want = _play(engine_policy, tasks, tiers)
  policy = cls(server_url, serve_config.serving.model_name, "test-key",
               thinking_budgets=dict(serve_config.serving.thinking_budgets))
  got = _play(policy, tasks, tiers)
  for a, b in zip(want, got, strict=True):
    assert b.error is None and a.task_id == b.task_id and a.tier == b.tier
    assert b.final_text() == a.final_text()
    assert b.messages[-1].thinking == a.messages[-1].thinking
    assert (b.reward, b.success, b.end) == (a.reward, a.success, a.end)


def test_endpoint_errors_end_the_episode_not_the_run(server_url, serve_config):
  bad_key = OpenAIPolicy(server_url, serve_config.serving.model_name, "wrong", retries=0)
  eps = _play(bad_key, _tasks()[:2], [None])
  assert all(ep.end == "error" and "401" in ep.error for ep in eps)
  with pytest.raises(ValueError, match="expected 'openai' or 'anthropic'"):
    from rl.agent.http import make_http_policy
    make_http_policy("gemini", server_url, "m")
  assert issubclass(EndpointError, RuntimeError)


@pytest.mark.parametrize("cls", [OpenAIPolicy, AnthropicPolicy])
def test_a_turn_near_the_end_of_the_context_asks_for_less(cls, engine_policy, server_url, serve_config):
  """The engine policy clamps a turn's limit to the context left; the HTTP policies sent the full
  limit, got a 400 and recorded the episode as an error (which evaluation and RL then leave out)."""
  long = [parse_task({"id": "long", "domain": "math", "prompt": "1 + " * 48 + "1 =", "answer": "49"})]
  sampling = Sampling(temperature=0.0, max_tokens_per_turn=200)
  jobs = [(t, tier, sampling) for t in long for tier in (None, "low")]
  policy = cls(server_url, serve_config.serving.model_name, "test-key",
               thinking_budgets=dict(serve_config.serving.thinking_budgets))
  executor = ThreadExecutor(workers=2)
  try:
    want = asyncio.run(run_episodes(jobs, engine_policy, executor))
    got = asyncio.run(run_episodes(jobs, policy, executor))
  finally:
    executor.shutdown()
  for a, b in zip(want, got, strict=True):
    # the context (256 tokens), not the turn's limit, ended it
    assert 24 < len(a.token_ids) - a.turns[0].gen_start < 200 and a.end == "length"
    assert b.error is None and (b.end, b.final_text(), b.messages[-1].thinking) == (
        a.end, a.final_text(), a.messages[-1].thinking)


def test_context_errors_are_read_in_each_servers_wording():
  import json

  from rl.agent.http import context_full

  def openai_error(message):
    return json.dumps({"error": {"message": message, "code": "context_length_exceeded"}})

  ours = openai_error("max_completion_tokens=200 plus the prompt's 195 tokens exceeds this model's "
                      "context of 256 tokens; ask for at most 61.")
  openai = openai_error("This model's maximum context length is 8192 tokens. However, you requested 9000 "
                        "tokens (7000 in the messages, 2000 in the completion).")
  anthropic = json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": (
      "input length and `max_tokens` exceed context limit: 197000 + 8192 > 200000, decrease input length")}})
  assert [context_full(400, t).room for t in (ours, openai, anthropic)] == [61, 1192, 3000]
  # Our prompt-alone refusals leave no room (the "at most 4 bytes" was read as room for 4 tokens,
  # and the client asked again with 4, 2, 1 tokens before giving up).
  prompt_alone = openai_error("The prompt is 300 tokens, but this model's context is 256 tokens "
                              "(config.serving.max_context) and must leave room for at least one generated "
                              "token; shorten the input.")
  chars = openai_error("The prompt has 4000 characters, so at least 1000 tokens (one token covers at most "
                       "4 bytes), but this model's context is 256 tokens (config.serving.max_context) and "
                       "must leave room for at least one generated token; shorten the input.")
  equal = openai_error("The prompt is 256 tokens, but this model's context is 256 tokens (...)")
  assert [context_full(400, t).room for t in (prompt_alone, chars, equal)] == [-44, -744, 0]
  assert context_full(400, '{"error": {"message": "temperature must be >= 0"}}') is None
  assert context_full(429, ours) is None and context_full(400, "not json") is None


def test_openai_messages_keep_thinking_and_calls():
  call = ToolCall("call_1", "shell", '{"command": "ls"}')
  msgs = [Message("user", [TextPart("q")]),
          Message("assistant", [TextPart("")], thinking="let me look", tool_calls=[call]),
          Message("tool", [TextPart("a.txt")], tool_call_id="call_1", name="shell")]
  out = openai_messages(msgs)
  assert out[1] == {"role": "assistant", "content": "", "reasoning_content": "let me look",
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "shell", "arguments": '{"command": "ls"}'}}]}
  assert out[2] == {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}


def test_the_served_model_is_asked_for_when_none_is_named(server_url, monkeypatch, caplog):
  """evaluate --endpoint without --model sent the config's name (horizon-agent) to a server serving
  another model, and every episode 404ed; the server's /v1/models list decides now."""
  import httpx

  from rl.agent import http

  for api in ("openai", "anthropic"):
    assert http.served_model(api, server_url, "test-key", "horizon-agent") == "horizon-tiny"
    assert http.served_model(api, server_url + "/v1/", "test-key", "horizon-tiny") == "horizon-tiny"
  with caplog.at_level("WARNING"):  # cannot be asked (here: no key): the config's name, with a warning
    assert http.served_model("openai", server_url, None, "horizon-agent") == "horizon-agent"
  assert "/v1/models" in caplog.text and "--model" in caplog.text

  def listing(*ids):
    return lambda url, headers, timeout: httpx.Response(200, json={"data": [{"id": i} for i in ids]},
                                                        request=httpx.Request("GET", url))

  monkeypatch.setattr(http.httpx, "get", listing("a", "b"))
  assert http.served_model("openai", "http://x", None, "b") == "b"
  with pytest.raises(ValueError, match=r"lists \['a', 'b'\], not 'c'; choose one with --model"):
    http.served_model("openai", "http://x", None, "c")
  monkeypatch.setattr(http.httpx, "get", listing())
  with pytest.raises(ValueError, match="choose one with --model"):
    http.served_model("anthropic", "http://x", None, "c")
