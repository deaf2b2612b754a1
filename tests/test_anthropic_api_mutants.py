"""serving/anthropic_api.py's content blocks and stream events against Anthropic's streaming spec
(https://docs.anthropic.com/en/docs/build-with-claude/streaming), written out event by event: a
block starts empty and fills only through its deltas, each block is started and stopped once,
redacted thinking is one whole block, tool input streams as canonical JSON fragments, and a
forced call cut short keeps its whole members. Each test names the mistake it catches; no server."""

import asyncio
import json
import types

from serving import anthropic_api, signing
from serving.anthropic_api import ContentBuilder, partial_object
from serving.types import TextDelta, ThinkingDelta, ToolCall, ToolCallDelta, Usage

KEY = b"k3y"
START, DELTA, STOP = "content_block_start", "content_block_delta", "content_block_stop"


def _start(index, block):
  return START, {"type": START, "index": index, "content_block": block}


def _delta(index, delta):
  return DELTA, {"type": DELTA, "index": index, "delta": delta}


def _stop(index):
  return STOP, {"type": STOP, "index": index}


def _run(builder, deltas):
  return [e for d in deltas for e in builder.feed(d)] + builder.finish()


def test_a_text_block_starts_empty():
  """The start event is a copy: later text must not show up in the already-built start event."""
  builder = ContentBuilder(KEY, thinking=False)
  events = builder.feed(TextDelta("hi"))
  assert events == [_start(0, {"type": "text", "text": ""}),
                    _delta(0, {"type": "text_delta", "text": "hi"})]
  assert builder.finish() == [_stop(0)]
  assert builder.content == [{"type": "text", "text": "hi"}]


def test_owed_empty_thinking_block_is_started_and_stopped_once():
  """Thinking on, but the answer came first: one empty signed thinking block, then the text."""
  builder = ContentBuilder(KEY, thinking=True)
  events = _run(builder, [TextDelta("x")])
  sig = signing.sign_thinking(KEY, "")
  assert events == [
      _start(0, {"type": "thinking", "thinking": "", "signature": ""}),
      _delta(0, {"type": "signature_delta", "signature": sig}), _stop(0),
      _start(1, {"type": "text", "text": ""}), _delta(1, {"type": "text_delta", "text": "x"}), _stop(1)]
  assert builder.content == [{"type": "thinking", "thinking": "", "signature": sig},
                             {"type": "text", "text": "x"}]


def test_owed_thinking_before_a_tool_call():
  builder = ContentBuilder(KEY, thinking=True)
  events = _run(builder, [ToolCallDelta(0, ToolCall("toolu_1", "f", '{"a": 1}'))])
  assert [(name, data["index"]) for name, data in events] == [
      (START, 0), (DELTA, 0), (STOP, 0), (START, 1), (DELTA, 1), (STOP, 1)]
  assert events[3] == _start(1, {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}})


def test_redacted_thinking_is_one_whole_block():
  builder = ContentBuilder(KEY, thinking=True, display="redacted")
  events = _run(builder, [ThinkingDelta("ab"), ThinkingDelta("c"), TextDelta("x")])
  data = builder.content[0]["data"]
  assert signing.unseal_thinking(KEY, data) == "abc"
  assert events == [_start(0, {"type": "redacted_thinking", "data": data}), _stop(0),
                    _start(1, {"type": "text", "text": ""}),
                    _delta(1, {"type": "text_delta", "text": "x"}), _stop(1)]
  assert builder.content == [{"type": "redacted_thinking", "data": data}, {"type": "text", "text": "x"}]


def _tool_events(arguments, truncated=False):
  builder = ContentBuilder(KEY, thinking=False)
  events = _run(builder, [ToolCallDelta(0, ToolCall("toolu_9", "g", arguments, truncated))])
  assert events[0] == _start(0, {"type": "tool_use", "id": "toolu_9", "name": "g", "input": {}})
  assert events[-1] == _stop(0)
  fragments = [d["delta"]["partial_json"] for name, d in events[1:-1]]
  assert all(name == DELTA and d["delta"]["type"] == "input_json_delta" for name, d in events[1:-1])
  return builder.content[0]["input"], fragments


def test_tool_input_streams_as_canonical_json_in_24_character_fragments():
  # json.dumps(ensure_ascii=False) of {"k": 16 x's} is 25 characters: a last fragment of one.
  value, fragments = _tool_events('{"k":"' + "x" * 16 + '"}')
  assert value == {"k": "x" * 16}
  assert fragments == ['{"k": "' + "x" * 16 + '"', "}"]
  value, fragments = _tool_events('{"city":"Z\\u00fcrich","n":[1,2]}')
  assert value == {"city": "Zürich", "n": [1, 2]}
  assert "".join(fragments) == '{"city": "Zürich", "n": [1, 2]}'  # raw UTF-8, the history's form


def test_a_forced_call_cut_short_streams_as_is_and_keeps_whole_members():
  cut = '{"a": 1, "b": [tr'
  value, fragments = _tool_events(cut, truncated=True)
  assert "".join(fragments) == cut
  assert value == {"a": 1, "b": []}


def test_partial_object_cuts_at_the_last_whole_value():
  assert partial_object('{"a": [tr') == {"a": []}  # an open array is whole once closed
  assert partial_object('{"a": {"b') == {"a": {}}
  assert partial_object('{"a": [1, {"b": 2}], "c": "x') == {"a": [1, {"b": 2}]}
  assert partial_object("[1, 2") == {}  # not an object: nothing
  assert partial_object('"abc"') == {}


def test_a_cut_call_with_a_number_past_a_double_keeps_only_encodable_members():
  """A `number`'s grammar admits 1e400; json.loads read it as inf, and the non-streamed response
  (JSON without NaN/Infinity) then failed with a 500 after the whole generation."""
  builder = ContentBuilder(KEY, thinking=False)
  _run(builder, [ToolCallDelta(0, ToolCall("toolu_1", "f", '{"y": 2, "x": 1e400, "z": "a', truncated=True))])
  assert builder.content[0]["input"] == {"y": 2}
  json.dumps(builder.content, allow_nan=False)  # what JSONResponse does
  assert partial_object('{"x": -1e999') == {}


def test_start_counts_the_rendered_prompt(monkeypatch):
  """message_start and the usage count the prompt ids the engine got."""
  calls = {}

  async def render(ctx, req):
    return types.SimpleNamespace(ids=[5, 6, 7, 8], images=[])

  def make_processor(ctx, **kw):
    calls.update(kw)
    return "processor"

  monkeypatch.setattr(anthropic_api, "_render", render)
  monkeypatch.setattr(anthropic_api.prepare, "check_images", lambda ctx, n, param: calls.update(n=n))
  monkeypatch.setattr(anthropic_api.prepare, "make_processor", make_processor)
  monkeypatch.setattr(anthropic_api.run, "submit", lambda ctx, ids, images, proc, params: ("handle", ids))
  req = types.SimpleNamespace(thinking=True, prefill=False, thinking_budget=3, stop=["##"], tools=[],
                              tool_choice=None, response_format=None, params="params")
  handle, n_prompt, processor = asyncio.run(anthropic_api._start(None, req))
  assert (handle, n_prompt, processor) == (("handle", [5, 6, 7, 8]), 4, "processor")
  assert calls["n"] == 0 and calls["call_id_prefix"] == "toolu_"
  assert (calls["thinking"], calls["thinking_budget"], calls["stop"]) == (True, 3, ["##"])


def _stream(monkeypatch, events, stop_sequence):
  async def fake(handle):
    for e in events:
      yield e
  monkeypatch.setattr(anthropic_api, "_events_or_pings", fake)

  async def collect():
    gen = anthropic_api._stream(None, types.SimpleNamespace(stop_sequence=stop_sequence),
                                ContentBuilder(KEY, thinking=False), "msg_1", "m", 3)
    return [line async for line in gen]
  return [json.loads(s.split("data: ", 1)[1]) for s in asyncio.run(collect())]


def test_stream_message_delta_names_the_stop_sequence(monkeypatch):
  lines = _stream(monkeypatch, [types.SimpleNamespace(deltas=[TextDelta("a")], finish_reason="stop",
                                                      usage=Usage(3, 2))], "##")
  usage = {"input_tokens": 3, "output_tokens": 2, "cache_creation_input_tokens": 0,
           "cache_read_input_tokens": 0, "output_tokens_details": {"thinking_tokens": 0}}
  assert lines[-2] == {"type": "message_delta", "usage": usage,
                       "delta": {"stop_reason": "stop_sequence", "stop_sequence": "##"}}
  assert lines[-1] == {"type": "message_stop"}


def test_idle_waits_yield_pings_then_the_events(monkeypatch):
  """None (a ping) for each idle interval, the events in order, and the handle cancelled at the end."""
  async def slow(handle):
    await asyncio.sleep(0.25)
    yield "e1"
    yield "e2"
  monkeypatch.setattr(anthropic_api.run, "stream_events", slow)
  monkeypatch.setattr(anthropic_api, "PING_INTERVAL_S", 0.1)
  cancelled = []
  handle = types.SimpleNamespace(cancel=lambda: cancelled.append(True))

  async def collect():
    return [e async for e in anthropic_api._events_or_pings(handle)]
  got = asyncio.run(collect())
  assert got[-2:] == ["e1", "e2"] and set(got[:-2]) == {None} and len(got) >= 3
  assert cancelled == [True]


def test_count_tokens_is_the_rendered_prompts_length(monkeypatch):
  async def parse(request, ctx, *, count_only):
    assert count_only
    return "req"

  async def render(ctx, req):
    return types.SimpleNamespace(ids=[1, 2, 3], images=[])
  monkeypatch.setattr(anthropic_api, "_parse", parse)
  monkeypatch.setattr(anthropic_api, "_render", render)
  response = asyncio.run(anthropic_api.count_tokens(None, None))
  assert json.loads(response.body) == {"input_tokens": 3}
