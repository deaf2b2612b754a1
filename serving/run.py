"""Running generations for the API front-ends: submit to the engine, collect or stream the events.

A prepared request (serving/prepare.py: rendered off the event loop, its
processor built) is submitted as one engine `Request` per choice; the
front-end then either collects each handle's events into one `Result`
(non-streaming) or forwards them as they come (`stream_events`,
`merge_streams`) in server-sent events (`sse`, `EventStreamResponse`).

Cancellation: a streaming client that goes away must free its slot at once
(issue 5). Starlette neither closes a response's body iterator when the
client disconnects nor when sending fails, so `EventStreamResponse` wraps the
ASGI call in `try/finally` and cancels its handles there; `stream_events`
also cancels when its consumer closes it early. A non-streaming request
listens for the disconnect while it waits (`collect_all(..., request=...)`,
`watch_disconnect`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from starlette.responses import StreamingResponse

from serving.context import ServerContext
from serving.errors import APIError
from serving.handle import Handle, Request
from serving.output import OutputProcessor
from serving.types import (
  SamplingParams,
  TextDelta,
  ThinkingDelta,
  ToolCall,
  ToolCallDelta,
  Usage,
)


@dataclasses.dataclass
class Result:
  """One finished generation (non-streaming)."""
  thinking: str
  text: str
  tool_calls: list[ToolCall]
  finish_reason: str
  usage: Usage
  stop_sequence: str | None


def submit(ctx: ServerContext, prompt_ids: Sequence[int], images: Sequence[np.ndarray] | None,
           processor: OutputProcessor, params: SamplingParams) -> Handle:
  """Submits one request to the engine; returns its Handle (RequestError/OverloadedError propagate)."""
  pixels = np.stack([np.asarray(im, np.float32) for im in images]) if images else None
  request = Request(prompt_ids=list(prompt_ids), params=params, images=pixels, processor=processor)
  return ctx.engine.submit(request, loop=asyncio.get_running_loop())


async def watch_disconnect(request, handles: Sequence[Any]) -> None:
  """Cancels `handles` when the HTTP client disconnects (the body was already read)."""
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      for h in handles:
        h.cancel()
      return


async def _gather(handle) -> Result:
  thinking, text, calls = [], [], []
  last = None
  async for event in stream_events(handle):
    for d in event.deltas:
      if isinstance(d, ThinkingDelta):
        thinking.append(d.text)
      elif isinstance(d, TextDelta):
        text.append(d.text)
      elif isinstance(d, ToolCallDelta):
        calls.append(d.call)
    last = event
  if last is None or last.finish_reason is None:
    raise APIError(500, "The engine ended the request without a final event.")
  return Result(thinking="".join(thinking), text="".join(text), tool_calls=calls,
                finish_reason=last.finish_reason, usage=last.usage,
                stop_sequence=getattr(handle.request.processor, "stop_sequence", None))


async def collect_all(handles: Sequence[Any], request=None) -> list[Result]:
  """Waits for generations to finish and gathers their deltas (non-streaming responses).

  Args:
    handles: engine Handles.
    request: the Starlette request; when given, a client disconnect cancels every handle.
  """
  watcher = asyncio.ensure_future(watch_disconnect(request, handles)) if request is not None else None
  try:
    return list(await asyncio.gather(*(_gather(h) for h in handles)))
  finally:
    if watcher is not None:
      watcher.cancel()
    for h in handles:
      h.cancel()  # no-op for finished ones


def final_reason(handle, reason: str) -> str:
  """The engine's finish reason as the API reports it (`OutputProcessor.finish_reason`:
  'stop' at end of turn after >= 1 valid tool call becomes 'tool_calls')."""
  proc = handle.request.processor
  return proc.finish_reason(reason) if proc is not None else reason


async def stream_events(handle) -> AsyncIterator[Any]:
  """Yields a handle's events (deltas per step, then the final event with finish_reason and usage).

  Cancels the handle when the consumer stops before the final event (closes
  this generator, or the task running it is cancelled). The final event's
  finish_reason goes through `final_reason`.
  """
  try:
    async for event in handle.aevents():
      if event.finish_reason is not None:
        event = dataclasses.replace(event, finish_reason=final_reason(handle, event.finish_reason))
      yield event
  finally:
    handle.cancel()  # a no-op once the final event was delivered


async def merge_streams(handles: Sequence[Any]) -> AsyncIterator[tuple[int, Any]]:
  """(index, event) of several handles' events, interleaved as they arrive (n > 1 choices)."""
  if len(handles) == 1:
    async for event in stream_events(handles[0]):
      yield 0, event
    return
  queue: asyncio.Queue = asyncio.Queue()
  done = object()

  async def pump(i: int, handle) -> None:
    end = done
    try:
      async for event in stream_events(handle):
        await queue.put((i, event))
    except Exception as e:  # raised to the consumer, as with one handle (was: that choice just ended)
      end = e
    finally:
      await queue.put((i, end))

  tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
  try:
    remaining = len(handles)
    while remaining:
      i, event = await queue.get()
      if event is done:
        remaining -= 1
      elif isinstance(event, Exception):
        raise event
      else:
        yield i, event
  finally:
    for t in tasks:
      t.cancel()
    for h in handles:
      h.cancel()


class EventStreamResponse(StreamingResponse):
  """`text/event-stream` whose handles are cancelled however the response ends.

  Starlette leaves the body iterator suspended when the client disconnects
  (the send fails or the disconnect listener cancels the task); the finally
  here closes it and cancels the handles, so the engine frees the slots at
  its next step. Cancelling a finished handle does nothing.
  """

  def __init__(self, content: AsyncIterator[str], handles: Sequence[Any]):
    super().__init__(content, media_type="text/event-stream",
                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    self._handles = list(handles)

  async def __call__(self, scope, receive, send) -> None:
    try:
      await super().__call__(scope, receive, send)
    finally:
      for h in self._handles:
        h.cancel()
      close = getattr(self.body_iterator, "aclose", None)
      if close is not None:
        await close()


def sse(data: Any, event: str | None = None) -> str:
  """One server-sent event: compact JSON data (and an event name for Anthropic)."""
  text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
  return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"
