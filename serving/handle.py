"""What a caller of the engine holds: Request, Handle, Event and the submission errors.

`serving.engine` re-exports all of them. A Handle delivers events either to
a thread-safe queue (`events()`, sync) or to the consumer's asyncio loop
through `loop.call_soon_threadsafe` (`aevents()`): the engine thread never
blocks on a consumer and no thread is started per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np

from serving.types import Delta, SamplingParams, TokenProcessor, Usage


class RequestError(ValueError):
  """A request the engine cannot run as given; `param` names the offending field.

  param values: 'prompt' (empty, too long, bad ids, image placeholders),
  'max_tokens', 'images', 'temperature', 'top_p', 'top_k', 'seed', 'stop_token_ids'.
  """

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.message, self.param = message, param


class OverloadedError(RuntimeError):
  """The waiting queue is full (`max_queue`); retry later (HTTP 429 / 529)."""


@dataclasses.dataclass
class Request:
  """One generation: prompt token ids, sampling parameters, optional images and processor.

  images: float32 [m, H, W, C] in [0, 1]; the prompt must hold exactly
  m * num_patches image placeholder ids (the chat renderer writes them).
  record_routing: return, on the last event, the MoE experts every fed token
  (prompt and generated) was routed to (RL's routing replay).
  """
  prompt_ids: list[int]
  params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  images: np.ndarray | None = None
  processor: TokenProcessor | None = None
  record_routing: bool = False


@dataclasses.dataclass(frozen=True)
class Event:
  """What one engine iteration produced for one request.

  token_ids: the new token(s) (a stop token included); deltas: the
  processor's output for them; finish_reason and usage are set on the last
  event only. time: wall-clock seconds (time.time()). logprobs: per token,
  log-softmax of the model's raw logits (temperature 1, no filters).
  routing: on the last event of a `record_routing` request, int32 [n_fed,
  num_moe_layers, k]: the experts of every token fed to the model, in order
  (the prompt, then each generated token but the last).
  """
  token_ids: list[int]
  deltas: list[Delta]
  finish_reason: str | None
  usage: Usage | None
  time: float
  logprobs: list[float] = dataclasses.field(default_factory=list)
  routing: np.ndarray | None = None


class Handle:
  """A submitted request: iterate `events()` (sync) or `aevents()` (asyncio); `cancel()`."""

  def __init__(self, engine: Any, request: Request, loop: asyncio.AbstractEventLoop | None):
    self.id = f"gen-{uuid.uuid4().hex[:24]}"
    self.request = request
    self.submitted = time.monotonic()
    self.first_logits: np.ndarray | None = None  # set when asked via Engine.next_token_logits
    self._capture_logits = False
    self._engine = engine
    self._lock = threading.Lock()
    self._q: queue.SimpleQueue[Event] = queue.SimpleQueue()
    self._loop: asyncio.AbstractEventLoop | None = None
    self._aq: asyncio.Queue[Event] | None = None
    self._cancelled = threading.Event()
    self._done = threading.Event()
    if loop is not None:
      self._bind(loop)

  @property
  def cancelled(self) -> bool:
    return self._cancelled.is_set()

  @property
  def done(self) -> bool:
    """The final event was delivered (queued for the consumer)."""
    return self._done.is_set()

  def cancel(self) -> None:
    """Stops the request at the next engine iteration (final event: 'cancelled'); idempotent."""
    if not self._done.is_set():
      self._cancelled.set()
      self._engine._wake()

  def events(self, timeout: float | None = None) -> Iterator[Event]:
    """Blocks for each event until the final one. Leaving the loop early cancels the request.

    Raises queue.Empty when no event arrives within `timeout` seconds.
    """
    if self._loop is not None:
      raise RuntimeError(f"handle {self.id} delivers to an asyncio loop; iterate aevents() instead.")
    try:
      while True:
        ev = self._q.get(timeout=timeout)
        yield ev
        if ev.finish_reason is not None:
          return
    finally:
      self.cancel()  # a no-op once the final event was delivered

  async def aevents(self) -> AsyncIterator[Event]:
    """Async iterator of events on the running loop. Leaving early (or being cancelled) cancels."""
    self._bind(asyncio.get_running_loop())
    try:
      while True:
        ev = await self._aq.get()
        yield ev
        if ev.finish_reason is not None:
          return
    finally:
      self.cancel()  # a no-op once the final event was delivered

  def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
    with self._lock:
      if self._loop is loop:
        return
      if self._loop is not None:
        raise RuntimeError(f"handle {self.id} is already bound to another event loop.")
      self._loop, self._aq = loop, asyncio.Queue()
      while True:  # events delivered before the consumer arrived
        try:
          self._aq.put_nowait(self._q.get_nowait())
        except queue.Empty:
          break

  def _deliver(self, ev: Event) -> None:
    with self._lock:
      if ev.finish_reason is not None:
        self._done.set()
      if self._loop is None:
        self._q.put(ev)
        return
      loop, aq = self._loop, self._aq
    try:
      loop.call_soon_threadsafe(aq.put_nowait, ev)
    except RuntimeError:  # the consumer's loop is closed: nobody listens any more
      self._cancelled.set()
