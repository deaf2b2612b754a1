"""Ready means warm: compile the engine's programs before `/health` answers 200.

XLA compiles a jitted program on its first call, so without a warm-up the
first request a load balancer routes to a new server pays for compiling the
prefill and decode programs (seconds on CPU, minutes for a large model on
TPU). `Warmup` runs dummy requests through the public engine API
(`Engine.submit`) in a background thread at server start, phase by phase,
and logs what it compiles and how long each phase took; `/health` answers 503
`{"status": "warming", "reason": ...}` until it is done
(serving/server.py).

What has to run for every program a real request can reach to be compiled
(serving/batch.py `compile_programs`; each has one shape whatever the
request, so one call each is enough):

  * text: `reset` (admission), `prefill` at each of its widths (a whole chunk,
    then a last chunk of each width: `Engine.prefill_buckets`; the second call
    sees the decode state the first one wrote), `decode_loop` (one program
    whatever the steps per call, per row bucket: `Engine.decode_buckets`, the
    smallest met by a lone request, each larger one by that many at once, all
    slots by the full batch) and `sample`; with the prefix cache, its
    copies out of a row (the first requests) and into one (the steady-state
    request, which finds the first one's prompt cached);
  * images (models with vision only): `encode`, and a prefill chunk that
    carries image patches (same program, other inputs);
  * a forced tool call: `sample` with a constraint mask, and the host-side
    constraint tables (serving/constrained.py) of the tokenizer;
  * a full batch: every slot admitted and prefilled in one iteration, so the
    eager ops that gather the finished rows' logits meet the largest batch.

Requests that arrive while warming are not refused: they queue in the engine
behind the warm-up's requests and run once the programs are compiled, so a
client that ignores `/health` only sees one slow first response. The warm-up's
requests count in the engine's metrics like any other (`/metrics`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from serving import prepare
from serving.context import ServerContext
from serving.handle import Request
from serving.types import ImagePart, Message, SamplingParams, TextPart, Tool, ToolChoice

_log = logging.getLogger(__name__)

_TOOL = Tool(name="warmup", description="", parameters={
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})


class Warmup:
  """Runs the warm-up phases in a daemon thread; `health()` says whether the server is ready.

  Args:
    ctx: the server's context (engine, renderer, tokenizer, model config).
    enabled: False: ready at once (config.serving.warmup).
  """

  def __init__(self, ctx: ServerContext, *, enabled: bool = True):
    self.ctx = ctx
    self.state = "warming" if enabled else "ready"
    self.phase = "waiting for the engine to start"
    self.phase_seconds: dict[str, float] = {}
    self.error: str | None = None
    self.seconds = 0.0
    self._start = time.monotonic()
    self._done = threading.Event()
    self._thread: threading.Thread | None = None
    if not enabled:
      self._done.set()

  def start(self) -> Warmup:
    """Starts the warm-up thread (no-op when disabled or started)."""
    if self._thread is None and not self._done.is_set():
      self._thread = threading.Thread(target=self._run, name="horizon-warmup", daemon=True)
      self._thread.start()
    return self

  def wait(self, timeout: float | None = None) -> bool:
    """Blocks until the warm-up ended (done or failed); False on timeout."""
    return self._done.wait(timeout)

  @property
  def ready(self) -> bool:
    return self.state == "ready"

  def health(self) -> tuple[int, dict[str, Any]]:
    """(status code, body) of /health: 200 only once warm and with the engine running."""
    model = self.ctx.model_name
    if not self.ctx.engine.running:
      return 503, {"status": "engine stopped", "model": model,
                   "reason": "the engine's loop is not running; restart the server."}
    if self.state == "ready":
      return 200, {"status": "ok", "model": model, "warmup_seconds": round(self.seconds, 2)}
    if self.state == "failed":
      return 503, {"status": "warm-up failed", "model": model,
                   "reason": f"warming up failed in phase {self.phase!r}: {self.error} (see the log)."}
    waited = time.monotonic() - self._start
    return 503, {"status": "warming", "model": model,
                 "reason": f"compiling the engine's programs: {self.phase} ({waited:.1f} s so far); "
                           "requests sent now wait until it is done."}

  # ---- the phases -------------------------------------------------------------------
  def _run(self) -> None:
    try:
      while not self.ctx.engine.running:
        time.sleep(0.05)
      for name, fn in self._phases():
        self.phase = name
        t0 = time.monotonic()
        _log.info("warm-up: %s ...", name)
        fn()
        self.phase_seconds[name] = time.monotonic() - t0
        _log.info("warm-up: %s took %.2f s", name, self.phase_seconds[name])
      self.seconds = time.monotonic() - self._start
      self.state = "ready"
      _log.info("warm-up done in %.1f s; /health answers 200", self.seconds)
    except Exception as e:  # the server stays up, /health says why it is not ready
      self.error = f"{type(e).__name__}: {e}"
      self.state = "failed"
      _log.exception("warm-up failed in phase %r", self.phase)
    finally:
      self._done.set()

  def _phases(self) -> list[tuple[str, Callable[[], None]]]:
    phases = [("text request: compiling reset, prefill, decode_loop and sample", self._text),
              ("forced tool call: constraint masks", self._tool_call)]
    vision = self.ctx.model_cfg.vision
    if vision is not None and vision.enabled:
      phases.insert(1, ("image request: compiling the vision encoder", self._image))
    for rows in self.ctx.engine.decode_buckets[1:-1]:
      phases.append((f"{rows} requests at once: the decode program for {rows} rows",
                     lambda rows=rows: self._batch(rows)))
    phases.append((f"full batch: {self.ctx.engine.slots} requests at once", self._batch))
    phases.append(("warm text request (steady state)", self._text))
    return phases

  def _prompt(self, extra: Sequence[Message] = (), last: int = 1) -> tuple[list[int], list[np.ndarray]]:
    """A chat prompt of one prefill chunk and `last` tokens (two prefill calls), within the context."""
    engine = self.ctx.engine
    rendered = self.ctx.renderer.render([*extra, Message("user", [TextPart("warm up")])])
    ids = rendered.ids
    pad = min(engine.prefill_chunk + last, engine.max_context - 8) - len(ids)
    filler = self.ctx.tokenizer.encode(" up")[-1]
    return ids[:1] + [filler] * max(0, pad) + ids[1:], rendered.images  # after <|bos|>

  def _generate(self, requests: list[Request]) -> None:
    handles = [self.ctx.engine.submit(r) for r in requests]
    for h in handles:
      for event in h.events():
        if event.finish_reason in ("error", "cancelled"):
          raise RuntimeError(f"the warm-up request ended with {event.finish_reason!r}")

  def _request(self, ids, images=(), max_tokens: int = 4, processor=None) -> Request:
    pixels = np.stack([np.asarray(im, np.float32) for im in images]) if len(images) else None
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    return Request(prompt_ids=list(ids), params=params, images=pixels, processor=processor)

  def _text(self) -> None:
    for width in self.ctx.engine.prefill_buckets:  # the last chunk runs at this width
      ids, _ = self._prompt(last=width)
      self._generate([self._request(ids)])

  def _image(self) -> None:
    v = self.ctx.model_cfg.vision
    gray = np.full((v.image_size, v.image_size, v.num_channels), 0.5, np.float32)
    ids, images = self._prompt([Message("user", [ImagePart(gray)])])
    self._generate([self._request(ids, images)])

  def _tool_call(self) -> None:
    ids, _ = self._prompt()
    processor = prepare.make_processor(self.ctx, thinking=False, thinking_budget=None, tools=[_TOOL],
                                       tool_choice=ToolChoice("required"))
    self._generate([self._request(ids, max_tokens=6, processor=processor)])

  def _batch(self, rows: int | None = None) -> None:
    ids, _ = self._prompt()
    self._generate([self._request(ids, max_tokens=2) for _ in range(rows or self.ctx.engine.slots)])
