"""serving/errors.py, api_common.generation_failure, run.py and handle.py edge cases that mutation testing
found unchecked: each vendor's error type and code by status, the overload status per API, the SSE
framing of one event, and the Handle / stream plumbing that gives an engine slot back."""

import asyncio
import json
import threading
import types

import numpy as np
import pytest
from starlette.requests import ClientDisconnect

from serving import run
from serving.api_common import generation_failure
from serving.errors import engine_error, error_response, is_anthropic_path, validation_message
from serving.handle import Event, Handle, OverloadedError, Request, RequestError
from serving.types import SamplingParams, Usage


def _body(path, status, **kw):
  r = error_response(path, status, "went wrong", **kw)
  return r.status_code, json.loads(r.body)


@pytest.mark.parametrize(
  "status, etype, code",
  [
    (400, "invalid_request_error", None),
    (401, "authentication_error", "invalid_api_key"),
    (404, "not_found_error", "not_found"),
    (405, "invalid_request_error", "method_not_allowed"),
    (413, "invalid_request_error", "request_too_large"),
    (429, "rate_limit_error", "overloaded"),
    (500, "server_error", None),
    (503, "server_error", "unavailable"),
    (418, "invalid_request_error", None),
    (499, "invalid_request_error", None),
    (502, "server_error", None),
  ],
)
def test_openai_error_type_and_code_by_status(status, etype, code):
  assert _body("/v1/chat/completions", status, param="n") == (
    status,
    {"error": {"message": "went wrong", "type": etype, "param": "n", "code": code}},
  )


@pytest.mark.parametrize(
  "status, etype",
  [
    (400, "invalid_request_error"),
    (401, "authentication_error"),
    (404, "not_found_error"),
    (405, "invalid_request_error"),
    (413, "request_too_large"),
    (429, "rate_limit_error"),
    (500, "api_error"),
    (503, "overloaded_error"),
    (418, "invalid_request_error"),
    (499, "invalid_request_error"),
    (502, "api_error"),
  ],
)
def test_anthropic_error_type_by_status(status, etype):
  assert _body("/v1/messages", status) == (
    status,
    {"type": "error", "error": {"type": etype, "message": "went wrong"}},
  )


def test_the_raisers_type_code_and_param():
  assert _body("/v1/completions", 400, code="context_length_exceeded", type_="x_error")[1]["error"] == {
    "message": "went wrong",
    "type": "x_error",
    "param": None,
    "code": "context_length_exceeded",
  }
  # Anthropic has no param: it leads the message, once.
  assert _body("/v1/messages/count_tokens", 400, param="max_tokens")[1]["error"]["message"] == (
    "max_tokens: went wrong"
  )
  assert _body("/v1/messages", 400, param="wrong")[1]["error"]["message"] == "went wrong"
  # Overload: OpenAI's 429 is Anthropic's 529 overloaded_error.
  assert _body("/v1/chat/completions", 429, code="overloaded")[0] == 429
  assert _body("/v1/messages", 429, code="overloaded") == (
    529,
    {"type": "error", "error": {"type": "overloaded_error", "message": "went wrong"}},
  )


@pytest.mark.parametrize(
  "path, anthropic",
  [
    ("/v1/messages", True),
    ("/v1/messages/count_tokens", True),
    ("/v1/messagesx", False),
    ("/v1/messages_batches", False),
    ("/v1/chat/completions", False),
    ("/v1/models", False),
  ],
)
def test_which_paths_answer_in_anthropics_shape(path, anthropic):
  assert is_anthropic_path(path) is anthropic


def test_engine_errors_become_api_errors():
  over = engine_error(OverloadedError("4 waiting"))
  assert (over.status, over.code, over.param, over.message) == (
    429,
    "overloaded",
    None,
    "The server is overloaded: 4 waiting. Retry later.",
  )
  bad = engine_error(RequestError("top_k must be <= 5", "top_k"))
  assert (bad.status, bad.param, bad.message, bad.code) == (400, "top_k", "top_k must be <= 5", None)
  plain = engine_error(ValueError("odd"))
  assert (plain.status, plain.param, plain.message) == (400, None, "odd")


def test_validation_messages():
  errs = [
    {"type": "int_type", "loc": ("body", "n"), "msg": "Input should be a valid integer"},
    {"type": "missing", "loc": ("body", "model"), "msg": "Field required"},
    {"type": "missing", "loc": ("body", "messages"), "msg": "Field required"},
  ]
  assert validation_message(errs, anthropic=False) == (
    "n: Input should be a valid integer (and 2 more errors)",
    "n",
  )
  assert validation_message(errs[:1], anthropic=False) == ("n: Input should be a valid integer", "n")
  assert validation_message(errs, anthropic=True) == ("n: Input should be a valid integer", "n")
  bad_json = [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error"}]
  assert validation_message(bad_json, anthropic=False) == (
    "The request body is not valid JSON: JSON decode error.",
    None,
  )
  whole = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be an object"}]
  assert validation_message(whole, anthropic=False) == (
    "The request body must be a JSON object sent with Content-Type: application/json (Input should be an "
    "object).",
    None,
  )
  typed = [{"type": "model_type", "loc": ("body", "messages", 0), "msg": "Input should be ChatMessage"}]
  assert validation_message(typed, anthropic=True) == (
    "messages.0: Input should be a valid dictionary",
    "messages.0",
  )
  assert validation_message([], anthropic=True) == ("Invalid request body.", None)


@pytest.mark.parametrize(
  "reason, status",
  [
    ("stop", None),
    ("length", None),
    ("tool_calls", None),
    ("cancelled", 503),
    ("error", 500),
    (None, 500),
    ("timeout", 500),
  ],
)
def test_generation_failure(reason, status):
  err = generation_failure(reason)
  assert (None if err is None else err.status) == status


def test_tool_call_arguments_are_streamed_whole():
  from serving.openai_api import _delta_json
  from serving.types import ToolCall, ToolCallDelta

  out = _delta_json(ToolCallDelta(0, ToolCall("call_1", "f", '{"a": 1234567890}')))  # 17 characters
  assert [d["tool_calls"][0]["function"]["arguments"] for d in out] == ["", '{"a": 1234567890', "}"]


def test_sse_framing():
  assert run.sse({"a": "é ✓", "b": [1, 2]}) == 'data: {"a":"é ✓","b":[1,2]}\n\n'
  assert run.sse("[DONE]") == "data: [DONE]\n\n"
  assert run.sse({"type": "ping"}, event="ping") == 'event: ping\ndata: {"type":"ping"}\n\n'


# ---- Handle and the stream plumbing ------------------------------------------------------------
class _Engine:
  def __init__(self):
    self.wakes = 0

  def _wake(self):
    self.wakes += 1


def _ev(text=None, finish=None):
  return Event(
    token_ids=[1],
    deltas=[],
    finish_reason=finish,
    usage=Usage(3, 1) if finish else None,
    time=0.0,
    logprobs=[] if text is None else [float(len(text))],
  )


def test_cancel_wakes_the_engine_only_while_running():
  engine = _Engine()
  h = Handle(engine, Request([1]), None)
  h.cancel()
  assert h.cancelled and engine.wakes == 1
  done = Handle(engine, Request([1]), None)
  done._deliver(_ev(finish="stop"))
  done.cancel()
  assert done.done and not done.cancelled and engine.wakes == 1


def test_sync_events_stop_at_the_final_event_and_leaving_early_cancels():
  engine = _Engine()
  h = Handle(engine, Request([1]), None)
  for ev in (_ev("a"), _ev(finish="length"), _ev("late")):
    h._deliver(ev)
  assert [e.finish_reason for e in h.events(timeout=1)] == [None, "length"]
  assert not h.cancelled
  h2 = Handle(engine, Request([1]), None)
  h2._deliver(_ev("a"))
  for _ in h2.events(timeout=1):
    break
  assert h2.cancelled


def test_async_delivery_binding_and_a_closed_loop():
  engine = _Engine()
  h = Handle(engine, Request([1]), None)
  h._deliver(_ev("a"))  # before the consumer arrives: kept, then handed over

  async def consume():
    loop = asyncio.get_running_loop()
    threading.Thread(target=lambda: h._deliver(_ev(finish="stop"))).start()
    got = [e.finish_reason async for e in h.aevents()]
    with pytest.raises(RuntimeError, match="delivers to an asyncio loop"):
      next(h.events(timeout=1))
    return got, loop

  got, loop = asyncio.run(asyncio.wait_for(consume(), 5))
  assert got == [None, "stop"] and not h.cancelled
  with pytest.raises(RuntimeError, match="already bound"):
    asyncio.run(asyncio.wait_for(_first(h), 2))
  late = Handle(engine, Request([1]), loop)  # the loop is closed now: nobody will read
  late._deliver(_ev("x"))
  assert late.cancelled


async def _first(h):
  async for e in h.aevents():
    return e


def test_leaving_an_async_stream_early_cancels():
  engine = _Engine()

  async def main():
    h = Handle(engine, Request([1]), asyncio.get_running_loop())
    h._deliver(_ev("a"))
    await _first(h)
    return h

  assert asyncio.run(main()).cancelled


def _handle(engine, loop, *events):
  h = Handle(engine, Request([1]), loop)
  for e in events:
    h._deliver(e)
  return h


def test_merge_streams_yields_every_choice_and_cancels_the_rest_when_closed():
  engine = _Engine()

  async def main():
    loop = asyncio.get_running_loop()
    a = _handle(engine, loop, _ev("a0"), _ev("a1"), _ev(finish="stop"))
    b = _handle(engine, loop, _ev("b0"), _ev(finish="length"))
    got = [(i, e.finish_reason, e.logprobs) async for i, e in run.merge_streams([a, b])]
    c, d = _handle(engine, loop, _ev("c0")), _handle(engine, loop, _ev("d0"))
    gen = run.merge_streams([c, d])
    await gen.__anext__()
    await gen.aclose()
    assert c.cancelled and d.cancelled  # at once, not when the pumps next run
    single = _handle(engine, loop, _ev("s"))
    gen1 = run.stream_events(single)
    await gen1.__anext__()
    await gen1.aclose()
    assert single.cancelled
    return got, (a, b)

  got, (a, b) = asyncio.run(main())
  assert [g[1:] for g in got if g[0] == 0] == [(None, [2.0]), (None, [2.0]), ("stop", [])]
  assert [g[1:] for g in got if g[0] == 1] == [(None, [2.0]), ("length", [])]
  assert not a.cancelled and not b.cancelled


def test_collect_all_and_the_disconnect_watcher_cancel():
  engine = _Engine()

  async def main():
    loop = asyncio.get_running_loop()
    done = _handle(engine, loop, _ev(finish="stop"))
    hang = _handle(engine, loop, _ev("x"))
    messages = [{"type": "http.request"}, {"type": "http.disconnect"}]

    async def receive():
      return messages.pop(0)

    await run.watch_disconnect(types.SimpleNamespace(receive=receive), [done, hang])
    assert hang.cancelled and not done.cancelled
    # a gather that fails (here: a handle whose events cannot be read) cancels the others
    other, waiting = _handle(engine, None, _ev("y")), _handle(engine, loop, _ev("z"))
    foreign = asyncio.new_event_loop()
    other._bind(foreign)
    with pytest.raises(RuntimeError, match="already bound"):
      await asyncio.wait_for(run.collect_all([waiting, other]), 5)
    foreign.close()
    assert waiting.cancelled

  asyncio.run(main())


def test_an_event_stream_response_that_fails_to_send_cancels_its_handles():
  engine = _Engine()

  async def main():
    h = _handle(engine, asyncio.get_running_loop(), _ev("x"))
    closed = []

    async def body():
      try:
        yield "data: 1\n\n"
        yield "data: 2\n\n"
      finally:
        closed.append(True)

    async def send(message):
      if message.get("body"):
        raise OSError("the client is gone")

    async def receive():
      await asyncio.sleep(30)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/"}
    with pytest.raises((OSError, ClientDisconnect)):  # Starlette reports a failed send as a disconnect
      await run.EventStreamResponse(body(), [h])(scope, receive, send)
    assert h.cancelled and closed == [True]

  asyncio.run(main())


# ---- the body guard (serving/server._Guard) as plain ASGI ------------------------------------------
def _guard_call(messages, method="POST", headers=(), limit=10):
  """Runs _Guard over a fake app; returns (what the app received, what the guard sent itself)."""
  from serving.server import _Guard

  inbox, sent, seen = list(messages), [], []

  async def receive():
    return inbox.pop(0) if inbox else {"type": "http.disconnect"}

  async def send(message):
    sent.append(message)

  async def app(scope, receive, send):
    seen.append(await receive())
    seen.append(await receive())  # after the replayed body: the client's own messages

  scope = {"type": "http", "path": "/v1/completions", "method": method, "headers": list(headers)}
  asyncio.run(_Guard(app, api_key="", max_body_bytes=limit)(scope, receive, send))
  return seen, sent


def _part(body, more):
  return {"type": "http.request", "body": body, "more_body": more}


def test_guard_replays_the_whole_body_once_then_hands_over_to_the_client():
  seen, sent = _guard_call([_part(b"ab", True), _part(b"cd", True), _part(b"", False)])
  assert sent == [] and seen == [_part(b"abcd", False), {"type": "http.disconnect"}]
  seen, _ = _guard_call([{"type": "http.request", "body": b"xyz"}])  # more_body absent: the last part
  assert seen == [_part(b"xyz", False), {"type": "http.disconnect"}]
  seen, _ = _guard_call([_part(b"0123456789", False)])  # exactly the limit
  assert seen[0] == _part(b"0123456789", False)


def test_guard_refuses_past_the_limit_and_stops_on_a_disconnect():
  seen, sent = _guard_call([_part(b"012345", True), _part(b"67890", False)])
  assert seen == [] and sent[0]["status"] == 413
  assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
  seen, sent = _guard_call([], headers=[(b"content-length", b"11")])
  assert seen == [] and sent[0]["status"] == 413
  seen, sent = _guard_call([_part(b"01", True)])  # the client left while sending
  assert seen == [] and sent == []
  seen, sent = _guard_call([], method="GET")  # no body read: the app gets the client's messages
  assert seen == [{"type": "http.disconnect"}] * 2 and sent == []


def test_collected_results_take_the_processors_finish_reason_and_stop_sequence():
  engine = _Engine()
  proc = types.SimpleNamespace(stop_sequence="##", finish_reason=lambda r: {"stop": "tool_calls"}.get(r, r))

  async def main():
    h = Handle(engine, Request([1], processor=proc), asyncio.get_running_loop())
    h._deliver(_ev("a"))
    h._deliver(_ev(finish="stop"))
    return await run.collect_all([h])

  (r,) = asyncio.run(main())
  assert (r.finish_reason, r.stop_sequence, r.usage) == ("tool_calls", "##", Usage(3, 1))


def test_submit_stacks_every_image():
  ctx = types.SimpleNamespace(engine=types.SimpleNamespace(submit=lambda request, loop: request))
  images = [np.zeros((2, 2, 1)), np.ones((2, 2, 1))]

  async def main():
    return (
      run.submit(ctx, (7, 8), images, None, SamplingParams(seed=3)),
      run.submit(ctx, [7], None, None, SamplingParams()),
    )

  both, none = asyncio.run(main())
  assert both.images.dtype == np.float32 and both.images.shape == (2, 2, 2, 1)
  assert both.images[0].sum() == 0 and both.images[1].sum() == 4
  assert both.prompt_ids == [7, 8] and both.params.seed == 3 and none.images is None


def test_a_choice_whose_stream_fails_fails_the_merged_stream():
  """With n > 1 choices, an exception in one choice's stream (here its processor's finish_reason)
  reaches the consumer as it does with one choice; it used to end that choice without a final event,
  and the response went on as if it had finished."""
  engine = _Engine()

  class Broken:
    def finish_reason(self, reason):
      raise RuntimeError("processor failed")

  async def main():
    loop = asyncio.get_running_loop()
    a = _handle(engine, loop, _ev("a0"), _ev(finish="stop"))
    b = _handle(engine, loop, _ev("b0"), _ev(finish="stop"))
    b.request.processor = Broken()
    got = []
    with pytest.raises(RuntimeError, match="processor failed"):
      async for i, e in run.merge_streams([a, b]):
        got.append((i, e.finish_reason))
    return got, a, b

  got, _, _ = asyncio.run(main())
  assert (1, "stop") not in got and (1, None) in got
