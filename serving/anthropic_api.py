"""Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Follows https://docs.anthropic.com/en/api/messages and its streaming spec
(https://docs.anthropic.com/en/docs/build-with-claude/streaming) so that code
written for the official `anthropic` SDK works by changing only `base_url`.
The request is translated by `serving.anthropic_request` into Horizon's chat
types, generated through the shared glue (`serving.prepare`, `serving.run`),
and the engine's deltas (thinking, text, complete tool calls) become content blocks:

  * `thinking` first whenever thinking is on (even when empty), closed with a
    `signature` (HMAC-SHA256, serving/signing.py) the server checks when the
    block comes back (`thinking.display: "omitted"`: empty text, the sealed
    thinking as signature); `redacted_thinking` only for Anthropic's
    documented test trigger (see serving/signing.py for why never otherwise);
  * `text` for answer text; a new block whenever the kind changes, so the
    content keeps the order the model wrote it in;
  * `tool_use` {id toolu_..., name, input} per complete call; streamed as
    `input_json_delta` fragments of the arguments JSON (the engine emits a call
    only once its closing marker arrived, so fragments never need repair).
    A forced call (tool_choice any/tool) cut by max_tokens is the exception:
    its JSON so far streams as is, `input` holds the members of it that are
    whole (`partial_object`), and stop_reason is `max_tokens`.

Streaming order: message_start, ping, then per block content_block_start,
content_block_delta*, content_block_stop, then message_delta (stop_reason,
stop_sequence, usage) and message_stop. A `ping` also goes out whenever no
event was due for `PING_INTERVAL_S` (queueing, long prefill), so proxies keep
the connection open. An engine failure mid-stream sends Anthropic's `error`
event. The non-streaming body is built from the same block builder, so a
streamed message accumulated by the SDK equals the non-streamed one.

Errors are raised as `serving.errors.APIError`; serving/server.py shapes
them (and auth, body size, engine refusals) as `{"type": "error", "error":
{"type", "message"}}` for these paths.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import fastapi
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from serving import images, prepare, run, signing
from serving.anthropic_request import InvalidRequest, ParsedRequest, parse_request
from serving.api_common import generation_failure
from serving.context import Context, ServerContext
from serving.errors import APIError
from serving.run import EventStreamResponse, sse
from serving.types import Delta, TextDelta, ThinkingDelta, ToolCallDelta, Usage, loads_json

router = fastapi.APIRouter()

PING_INTERVAL_S = 5.0  # idle seconds before a keep-alive `ping` event
_JSON_FRAGMENT = 24  # characters per input_json_delta
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}

Event = tuple[str, dict[str, Any]]  # (SSE event name, data)


class ContentBuilder:
  """Turns a request's deltas into Anthropic content blocks and their stream events.

  Args:
    key: the signing key (ServerContext.signing_key).
    thinking: thinking is on: the content starts with a thinking block.
    display: "summarized": thinking text + HMAC signature; "omitted": empty
      text, the sealed thinking as signature; "redacted": `redacted_thinking`
      blocks (Anthropic's test trigger was sent). See serving/signing.py.
  """

  def __init__(self, key: bytes, *, thinking: bool, display: str = "summarized"):
    if display not in ("summarized", "omitted", "redacted"):
      raise ValueError(f"display={display!r}: expected 'summarized', 'omitted' or 'redacted'.")
    self.content: list[dict[str, Any]] = []
    self._key, self._display = key, display
    self._owed = thinking  # a thinking block is still due (it comes first, even when empty)
    self._open: str | None = None  # kind of the open block: "thinking" | "text"
    self._thinking: list[str] = []

  def feed(self, delta: Delta) -> list[Event]:
    out: list[Event] = []
    if isinstance(delta, ThinkingDelta):
      if self._open != "thinking":
        out += self._close() + self._open_thinking()
      self._thinking.append(delta.text)
      if delta.text and self._display == "summarized":
        out.append(self._delta({"type": "thinking_delta", "thinking": delta.text}))
      return out
    out += self._owed_thinking()
    if isinstance(delta, TextDelta):
      if delta.text:
        if self._open != "text":
          out += self._close() + self._start({"type": "text", "text": ""}, "text")
        self.content[-1]["text"] += delta.text
        out.append(self._delta({"type": "text_delta", "text": delta.text}))
    elif isinstance(delta, ToolCallDelta):
      out += self._close() + self._tool_use(delta)
    return out

  def finish(self) -> list[Event]:
    """Closes the open block (the thinking block, if still owed, is emitted empty)."""
    return self._owed_thinking() + self._close()

  # -- blocks --
  def _delta(self, delta: dict[str, Any]) -> Event:
    return "content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                   "delta": delta}

  def _start(self, block: dict[str, Any], kind: str | None) -> list[Event]:
    self.content.append(block)
    self._open = kind
    return [("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                     "content_block": dict(block)})]

  def _stop(self) -> Event:
    self._open = None
    return "content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1}

  def _open_thinking(self) -> list[Event]:
    self._owed = False
    if self._display == "redacted":  # sent whole at the end: the data covers the full text
      self._open = "thinking"
      return []
    return self._start({"type": "thinking", "thinking": "", "signature": ""}, "thinking")

  def _owed_thinking(self) -> list[Event]:
    return self._open_thinking() + self._close() if self._owed else []

  def _close(self) -> list[Event]:
    if self._open is None:
      return []
    if self._open == "text":
      return [self._stop()]
    text, self._thinking = "".join(self._thinking), []
    if self._display == "redacted":
      return self._start({"type": "redacted_thinking", "data": signing.seal_thinking(self._key, text)},
                         None) + [self._stop()]
    if self._display == "omitted":
      signature = signing.seal_thinking(self._key, text)
    else:
      signature = signing.sign_thinking(self._key, text)
      self.content[-1]["thinking"] = text
    self.content[-1]["signature"] = signature
    return [self._delta({"type": "signature_delta", "signature": signature}), self._stop()]

  def _tool_use(self, delta: ToolCallDelta) -> list[Event]:
    call = delta.call
    if call.truncated:  # cut by max_tokens: the JSON so far streams as is, `input` is what of it is whole
      args, text = partial_object(call.arguments), call.arguments
    else:
      args = json.loads(call.arguments)
      text = json.dumps(args, ensure_ascii=False)
    out = self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}}, None)
    for i in range(0, len(text), _JSON_FRAGMENT):
      out.append(self._delta({"type": "input_json_delta", "partial_json": text[i:i + _JSON_FRAGMENT]}))
    self.content[-1]["input"] = args
    return out + [self._stop()]


def _cut_points(text: str) -> list[tuple[int, str]]:
  """(length, closers) of each prefix of `text` that ends a whole JSON value or opens a container,
  outside strings (the whole text last); the closers complete it."""
  points, stack, in_string, escaped = [], [], False, False
  for i, ch in enumerate(text):
    if in_string:
      if escaped:
        escaped = False
      elif ch == "\\":
        escaped = True
      elif ch == '"':
        in_string = False
    elif ch == '"':
      in_string = True
    elif ch in "{[":
      stack.append("}" if ch == "{" else "]")
      points.append((i + 1, "".join(reversed(stack))))
    elif ch in "}]" and stack:
      stack.pop()
      points.append((i + 1, "".join(reversed(stack))))
    elif ch == ",":
      points.append((i, "".join(reversed(stack))))
  if not in_string:
    points.append((len(text), "".join(reversed(stack))))
  return points


def partial_object(text: str) -> dict[str, Any]:
  """The whole members of a JSON object cut short (`{"a": 1, "b": "x` -> {"a": 1}); {} if none.

  Read as tool-call arguments are (serving.types.loads_json): a number past a double (the
  grammar of a `number` admits 1e400) is no whole member, since the response could not encode it."""
  for n, closers in reversed(_cut_points(text)):
    try:
      value = loads_json(text[:n] + closers)
    except ValueError:
      continue
    return value if isinstance(value, dict) else {}
  return {}


def stop_reason(processor, finish_reason: str) -> str:
  """Final finish reason (run.stream_events: a turn that called tools ended 'tool_calls')
  -> Anthropic stop_reason."""
  if finish_reason == "stop" and processor.stop_sequence is not None:
    return "stop_sequence"
  return _STOP_REASONS.get(finish_reason, "end_turn")


def usage_json(usage: Usage) -> dict[str, Any]:
  """Anthropic usage. The cache counts are 0: they count Anthropic's explicit prompt caching
  (cache_control breakpoints), which this server does not have; its automatic prefix cache does
  not change input_tokens (OpenAI's usage reports it as cached_tokens).

  output_tokens counts every generated token (thinking included, as on
  Anthropic); output_tokens_details.thinking_tokens counts the tokens inside
  the thinking block (the closing marker not included).
  """
  return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
          "output_tokens_details": {"thinking_tokens": usage.thinking_tokens}}


def _message(msg_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
             stop_seq: str | None, usage: dict[str, Any]) -> dict[str, Any]:
  return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
          "stop_reason": reason, "stop_sequence": stop_seq, "usage": usage}


# ---- request handling ----------------------------------------------------------
def _image_decoder(ctx: ServerContext):
  """Base64 image -> float32 [H, W, C] at the loaded model's image size, within the size limits."""
  vision, limits = ctx.model_cfg.vision, ctx.limits
  size, channels = int(vision.image_size), int(vision.num_channels)
  return lambda data: images.decode_image(data, size, channels, max_bytes=limits.max_image_bytes,
                                          max_pixels=limits.max_image_pixels)


async def _parse(request: fastapi.Request, ctx: ServerContext, *, count_only: bool) -> ParsedRequest:
  """The validated request (serving/anthropic_request.py); its InvalidRequest becomes an APIError."""
  try:
    body = await request.json()
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise APIError(400, f"The request body is not valid JSON: {e}.") from None
  except RecursionError:  # deeper than the JSON decoder goes (about 1000 levels)
    raise APIError(400, "The request body nests values too deeply for the JSON decoder; nest them at "
                   "most a few hundred levels deep.") from None
  try:  # off the event loop: image decoding and HMACs over long histories take a while
    req = await run_in_threadpool(parse_request, body, serving=ctx.limits, key=ctx.signing_key,
                                  decode_image=_image_decoder(ctx), count_only=count_only)
  except InvalidRequest as e:
    raise APIError(e.status, e.message) from None
  prepare.check_model(ctx, req.model)
  return req


async def _render(ctx: ServerContext, req: ParsedRequest):
  """The prompt, tokenized off the event loop (prepare.render refuses one too long by its length)."""
  return await run_in_threadpool(prepare.render, ctx, req.messages, tools=req.tools, thinking=req.thinking,
                                 effort=req.effort, continue_final=req.prefill)


async def _start(ctx: ServerContext, req: ParsedRequest):
  rendered = await _render(ctx, req)
  prepare.check_images(ctx, len(rendered.images), "messages")
  processor = prepare.make_processor(
      ctx, thinking=req.thinking and not req.prefill, thinking_budget=req.thinking_budget, stop=req.stop,
      tools=req.tools, tool_choice=req.tool_choice, call_id_prefix="toolu_",
      response_format=req.response_format)
  handle = run.submit(ctx, rendered.ids, rendered.images, processor, req.params)
  return handle, len(rendered.ids), processor


@router.post("/v1/messages")
async def create_message(request: fastapi.Request, ctx: Context):
  req = await _parse(request, ctx, count_only=False)
  handle, n_prompt, processor = await _start(ctx, req)
  msg_id = "msg_" + secrets.token_hex(12)
  builder = ContentBuilder(ctx.signing_key, thinking=req.thinking, display=req.thinking_display)
  if req.stream:
    return EventStreamResponse(_stream(handle, processor, builder, msg_id, ctx.model_name, n_prompt),
                               [handle])
  watcher = asyncio.ensure_future(run.watch_disconnect(request, [handle]))
  last = None
  try:
    async for event in run.stream_events(handle):
      for delta in event.deltas:
        builder.feed(delta)
      last = event
  finally:
    watcher.cancel()
  error = generation_failure(last.finish_reason if last else None)
  if error is not None:
    raise error
  builder.finish()
  return JSONResponse(_message(msg_id, ctx.model_name, builder.content,
                               stop_reason(processor, last.finish_reason), processor.stop_sequence,
                               usage_json(last.usage)))


async def _events_or_pings(handle) -> AsyncIterator[Any]:
  """The handle's events, with None whenever PING_INTERVAL_S passed without one."""
  events = run.stream_events(handle).__aiter__()
  pending = None
  try:
    while True:
      pending = pending or asyncio.ensure_future(events.__anext__())
      done, _ = await asyncio.wait({pending}, timeout=PING_INTERVAL_S)
      if not done:
        yield None
        continue
      task, pending = pending, None
      try:
        event = task.result()
      except StopAsyncIteration:
        return
      yield event
  finally:
    if pending is not None:
      pending.cancel()
    handle.cancel()  # no-op once finished


async def _stream(handle, processor, builder: ContentBuilder, msg_id: str, model: str,
                  n_prompt: int) -> AsyncIterator[str]:
  start = _message(msg_id, model, [], None, None, {"input_tokens": n_prompt, "output_tokens": 0,
                                                     "cache_creation_input_tokens": 0,
                                                     "cache_read_input_tokens": 0})
  yield sse({"type": "message_start", "message": start}, "message_start")
  yield sse({"type": "ping"}, "ping")
  last = None
  async for event in _events_or_pings(handle):
    if event is None:
      yield sse({"type": "ping"}, "ping")
      continue
    for delta in event.deltas:
      for name, data in builder.feed(delta):
        yield sse(data, name)
    last = event
  error = generation_failure(last.finish_reason if last else None)
  if error is not None:  # Anthropic's mid-stream error event
    kind = "overloaded_error" if error.status == 503 else "api_error"
    yield sse({"type": "error", "error": {"type": kind, "message": error.message}}, "error")
    return
  for name, data in builder.finish():
    yield sse(data, name)
  delta = {"stop_reason": stop_reason(processor, last.finish_reason),
           "stop_sequence": processor.stop_sequence}
  yield sse({"type": "message_delta", "delta": delta, "usage": usage_json(last.usage)}, "message_delta")
  yield sse({"type": "message_stop"}, "message_stop")


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: fastapi.Request, ctx: Context):
  """The prompt's token count: exactly `usage.input_tokens` of the same messages.create."""
  req = await _parse(request, ctx, count_only=True)
  rendered = await _render(ctx, req)
  return JSONResponse({"input_tokens": len(rendered.ids)})
