"""Response building of both API front-ends: usage, finish/stop reasons, content blocks and the
order of streamed events (OpenAI chat.completion docs; Anthropic Messages + streaming docs)."""

import asyncio
import json
import types

import pytest

from serving import anthropic_api, openai_api, run, signing
from serving.errors import APIError
from serving.types import TextDelta, ThinkingDelta, ToolCall, ToolCallDelta, Usage

KEY = b"k3y"
LIMITS = types.SimpleNamespace(max_context=50, default_max_tokens=20)


# ---- OpenAI ------------------------------------------------------------------
def test_openai_usage_over_choices():
  usage = openai_api.usage_json(13, [Usage(13, 7, 3, 5), Usage(13, 11, 2, 9)])
  assert usage == {"prompt_tokens": 13, "completion_tokens": 18, "total_tokens": 31,
                   "completion_tokens_details": {"reasoning_tokens": 5},
                   "prompt_tokens_details": {"cached_tokens": 5}}


def test_openai_max_tokens_against_the_context():
  with pytest.raises(APIError, match="The prompt is 50 tokens"):
    openai_api.max_tokens_for(LIMITS, 50, None, "max_tokens", "messages")
  assert openai_api.max_tokens_for(LIMITS, 49, None, "max_tokens", "messages") == 1  # cut to the room
  assert openai_api.max_tokens_for(LIMITS, 10, None, "max_tokens", "messages") == 20  # the default
  assert openai_api.max_tokens_for(LIMITS, 49, 1, "max_tokens", "messages") == 1  # exactly the room
  with pytest.raises(APIError, match="ask for at most 1"):
    openai_api.max_tokens_for(LIMITS, 49, 2, "max_completion_tokens", "messages")


def test_openai_choices_are_seeded_seed_plus_index():
  body = types.SimpleNamespace(temperature=None, top_p=None, top_k=None, seed=41)
  params = openai_api.sampling_params(body, 9, 2)
  got = (params.seed, params.max_tokens, params.temperature, params.top_p, params.top_k)
  assert got == (43, 9, 1.0, 1.0, 0)


def _result(text, calls=(), thinking=""):
  return run.Result(thinking=thinking, text=text, tool_calls=list(calls), finish_reason="stop",
                    usage=Usage(1, 1), stop_sequence=None)


def test_openai_message_content_is_null_with_only_tool_calls():
  call = ToolCall("call_1", "f", '{"a": 1}')
  msg = openai_api._message_json(_result("", [call]), thinking=False)
  assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
  assert openai_api._message_json(_result(""), thinking=False)["content"] == ""
  assert openai_api._message_json(_result("t", [call]), thinking=True)["content"] == "t"


def test_openai_tool_call_delta_header_then_fragments():
  args = json.dumps({"city": "Zürich", "days": [1, 2, 3], "note": "x" * 9})
  out = openai_api._delta_json(ToolCallDelta(2, ToolCall("call_9", "f", args)))
  assert out[0] == {"tool_calls": [{"index": 2, "id": "call_9", "type": "function",
                                    "function": {"name": "f", "arguments": ""}}]}
  assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in out[1:]) == args
  assert all(d["tool_calls"][0]["index"] == 2 and "id" not in d["tool_calls"][0] for d in out[1:])


# ---- Anthropic -----------------------------------------------------------------
@pytest.mark.parametrize("finish, stop_seq, reason", [
    ("stop", None, "end_turn"), ("stop", "##", "stop_sequence"), ("length", None, "max_tokens"),
    ("tool_calls", None, "tool_use"), ("length", "##", "max_tokens")])
def test_anthropic_stop_reason(finish, stop_seq, reason):
  assert anthropic_api.stop_reason(types.SimpleNamespace(stop_sequence=stop_seq), finish) == reason


def test_anthropic_usage():
  assert anthropic_api.usage_json(Usage(17, 29, 11, 5)) == {
      "input_tokens": 17, "output_tokens": 29, "cache_creation_input_tokens": 0,
      "cache_read_input_tokens": 0, "output_tokens_details": {"thinking_tokens": 11}}


def _feed(builder, deltas):
  return [e for d in deltas for e in builder.feed(d)] + builder.finish()


def _kinds(events):
  return [(name, data.get("index"), (data.get("delta") or {}).get("type")) for name, data in events]


def test_anthropic_blocks_and_events_in_order():
  args = '{"a":1,"b":"' + "y" * 30 + '"}'
  builder = anthropic_api.ContentBuilder(KEY, thinking=True)
  events = _feed(builder, [ThinkingDelta("ab"), ThinkingDelta("c"), TextDelta("x"), TextDelta("y"),
                           ToolCallDelta(0, ToolCall("toolu_1", "f", args))])
  assert builder.content == [
      {"type": "thinking", "thinking": "abc", "signature": signing.sign_thinking(KEY, "abc")},
      {"type": "text", "text": "xy"},
      {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1, "b": "y" * 30}}]
  start, delta, stop = "content_block_start", "content_block_delta", "content_block_stop"
  assert _kinds(events) == [
      (start, 0, None), (delta, 0, "thinking_delta"), (delta, 0, "thinking_delta"),
      (delta, 0, "signature_delta"), (stop, 0, None),
      (start, 1, None), (delta, 1, "text_delta"), (delta, 1, "text_delta"), (stop, 1, None),
      (start, 2, None), (delta, 2, "input_json_delta"), (delta, 2, "input_json_delta"), (stop, 2, None)]
  partial = "".join(d["delta"]["partial_json"] for n, d in events if n == delta and d["index"] == 2)
  assert json.loads(partial) == {"a": 1, "b": "y" * 30}


def test_anthropic_thinking_block_is_owed_even_when_empty():
  builder = anthropic_api.ContentBuilder(KEY, thinking=True)
  events = _feed(builder, [TextDelta("x")])
  assert [b["type"] for b in builder.content] == ["thinking", "text"]
  assert builder.content[0]["thinking"] == "" and events[0][0] == "content_block_start"
  builder = anthropic_api.ContentBuilder(KEY, thinking=True)
  _feed(builder, [])
  empty = {"type": "thinking", "thinking": "", "signature": signing.sign_thinking(KEY, "")}
  assert builder.content == [empty]


def test_anthropic_omitted_display_seals_and_streams_no_thinking_text():
  builder = anthropic_api.ContentBuilder(KEY, thinking=True, display="omitted")
  events = _feed(builder, [ThinkingDelta("secret"), TextDelta("x")])
  assert builder.content[0]["thinking"] == ""
  assert signing.unseal_thinking(KEY, builder.content[0]["signature"]) == "secret"
  assert "thinking_delta" not in [k for _, _, k in _kinds(events)]


def _stream_lines(monkeypatch, events):
  async def fake(handle):
    for e in events:
      yield e
  monkeypatch.setattr(anthropic_api, "_events_or_pings", fake)
  builder = anthropic_api.ContentBuilder(KEY, thinking=False)

  async def collect():
    gen = anthropic_api._stream(None, types.SimpleNamespace(stop_sequence=None), builder, "msg_1", "m", 7)
    return [line async for line in gen]
  return [json.loads(s.split("data: ", 1)[1]) for s in asyncio.run(collect())]


def test_anthropic_stream_event_order(monkeypatch):
  ev = types.SimpleNamespace
  lines = _stream_lines(monkeypatch, [ev(deltas=[TextDelta("hi")], finish_reason=None, usage=None), None,
                                      ev(deltas=[], finish_reason="length", usage=Usage(7, 3))])
  assert [x["type"] for x in lines] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                        "ping", "content_block_stop", "message_delta", "message_stop"]
  assert lines[0]["message"]["usage"]["input_tokens"] == 7
  assert lines[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
  assert lines[-2]["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("finish, kind", [("cancelled", "overloaded_error"), ("error", "api_error")])
def test_anthropic_stream_failure_event(monkeypatch, finish, kind):
  ev = types.SimpleNamespace(deltas=[], finish_reason=finish, usage=Usage(7, 0))
  lines = _stream_lines(monkeypatch, [ev])
  assert [x["type"] for x in lines] == ["message_start", "ping", "error"]
  assert lines[-1]["error"]["type"] == kind
