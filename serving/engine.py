"""The generation engine: continuous batching over fixed slots, chunked prefill, jitted decode steps.

Design (Orca-style iteration-level scheduling, Yu et al., OSDI 2022; chunked
prefill as in Sarathi-Serve, Agrawal et al., OSDI 2024): the engine owns one
decode state (`Horizon.init_cache`) of `slots` rows x `max_context` tokens.
One background thread loops:

  1. admit waiting requests (FIFO) into free slots: zero the slot's row
     (`reset_cache_rows`), encode the request's images once, and load the
     longest cached prefix of its prompt (serving/prefix_cache.py), so only
     the rest is prefilled;
  2. prefill ONE chunk for every slot still prefilling, one jitted [1, width] call per such row
     (its decode state sliced out and written back in place; width: the smallest of
     prefill_chunk, /2, /4 holding the chunk), so prefill costs what the prefilling rows need;
  3. one decode call for the decoding slots (serving/decode_loop.py; B rows: all S, or a bucket),
     up to `decode_steps` steps when no row needs the host between tokens, else one constrained;
  4. sample the rows whose prompt is complete, hand every new token to its request's processor
     and deliver events; finished slots are freed and refilled at the next iteration.

Steps 2 and 3 add to the prefix cache each block a row completes (with the delta layers' state).

Why prefill and decode are separate calls with fixed shapes (a request's numerics must not depend
on what else runs): serving/batch.py, which holds the per-slot state and the jitted programs. The
model is split once (`nnx.split`) so `update_weights` swaps weights without recompiling. Under
`jit` the model silently drops cache writes beyond `max_len`, so the engine bounds every row: a
request needs `len(prompt) + max_tokens <= max_context` (serving/admission.py) and a row finishes
with 'length' before it could overflow.

Sync and async consumers: `Handle.events()` blocks on a queue; `Handle.aevents()` receives events
through `loop.call_soon_threadsafe` on the caller's asyncio loop (no thread per request).

Shapes: S slots, C prefill chunk, V vocab, d model dim.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from serving import batch, decode_loop
from serving.admission import validate_engine_args, validate_request
from serving.batch import Slot
from serving.handle import Event, Handle, OverloadedError, Request, RequestError
from serving.metrics import EngineMetrics
from serving.prefix_cache import PrefixCache, build_prefixer
from serving.types import Delta, SamplingParams, Usage
from serving.weights import compute_dtype_state, engine_castable

__all__ = ["Engine", "Event", "Handle", "OverloadedError", "Request", "RequestError"]

_log = logging.getLogger(__name__)


class Engine:
  """Continuous-batching generation over `slots` rows of `max_context` tokens.

  Args:
    model: a `model.decoder.Horizon`.
    tokenizer: its `training.tokenizer.Tokenizer` (default stop ids: eos and end_of_turn).
    slots: batch rows decoded together.
    max_context: tokens per row (prompt + generated); <= model max_seq_len.
    prefill_chunk: prompt tokens prefilled per row per iteration.
    seed: draws the seeds of requests that give none.
    max_queue: waiting requests beyond this raise OverloadedError.
    prefix_cache_mb: memory for the prefix cache (serving/prefix_cache.py); 0 = off.
    prefix_cache_block: tokens per cached block; divides prefill_chunk.
    prefix_cache_exact: cache only what prefill chunks computed and resume only at multiples of
      prefill_chunk, so a resumed request is bit-identical to a cold one (RL's reproducibility);
      False also caches blocks decode steps complete (a completion is reused by the next turn).
    compute_dtype_weights: hold the weights the programs only use in the compute dtype in that dtype,
      converted once per weight update (serving/weights.py; the same bits, fewer bytes per step).
    decode_steps: most decode + sample steps per decode call (serving/decode_loop.py).
    batch_invariant: True: decode computes all S slots, so a request's tokens do not depend on what
      else runs; False: the fewest rows of `decode_loop.row_buckets` holding the decoding ones.
  """

  def __init__(self, model: Any, tokenizer: Any, *, slots: int, max_context: int, prefill_chunk: int,
               seed: int = 0, max_queue: int = 1024, prefix_cache_mb: float = 0.0,
               prefix_cache_block: int = 16, prefix_cache_exact: bool = False,
               compute_dtype_weights: bool = True, decode_steps: int = 8, batch_invariant: bool = True):
    cfg = model.cfg
    validate_engine_args(cfg, slots=slots, max_context=max_context, prefill_chunk=prefill_chunk,
                         max_queue=max_queue, decode_steps=decode_steps)
    slots, max_context, prefill_chunk, max_queue, decode_steps = (  # NumPy ints in, Python ints kept
        int(v) for v in (slots, max_context, prefill_chunk, max_queue, decode_steps))
    self.decode_steps = decode_steps
    self.decode_buckets = decode_loop.row_buckets(slots, batch_invariant)
    self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
    self.slots, self.max_context, self.prefill_chunk = slots, max_context, prefill_chunk
    self.max_queue, self.vocab_size = max_queue, cfg.vocab_size
    self.default_stop_ids = (tokenizer.eos_id, tokenizer.special_id("end_of_turn"))
    self.metrics = EngineMetrics(slots, max_context)
    self._graphdef, state = nnx.split(model)
    self._fns = {**batch.compile_programs(self._graphdef),
                 "decode_loop": decode_loop.compile_decode_loop(self._graphdef, decode_steps)}
    self._cache = model.init_cache(slots, max_context)
    self._castable = (engine_castable(self._fns, state, self._cache, cfg, prefill_chunk, self.decode_buckets,
                                      has_vision=model.vision is not None)
                      if compute_dtype_weights else None)
    self._state = self._serving_state(state)
    self._rows: list[Slot | None] = [None] * slots
    self._waiting: collections.deque[Handle] = collections.deque()
    self._rng = np.random.default_rng(seed)
    self._cond, self._step_lock = threading.Condition(), threading.Lock()
    self._thread: threading.Thread | None = None
    self._stopping = False
    # Constant inputs kept on the device: "no constraint" masks, and the image patches of chunks
    # without placeholders. The prefill always takes image_embeds [1, W, d] (the size of one
    # chunk's activations), so one program per width serves chunks with and without images.
    # Ids past the tokenizer's (a padded vocabulary: tiny_sharded's 332 for 331) are never sampled.
    self._open = ok = np.arange(self.vocab_size) < tokenizer.vocab_size
    self._all_allowed = {b: jax.device_put(batch.open_rows(b, len(ok), ok)) for b in self.decode_buckets}
    # A chunk runs at the smallest of these lengths that holds it (one program each), so the
    # short last chunk of a prompt (all that is left after a prefix-cache hit) costs its size,
    # not a whole chunk's. A request's chunks and shapes depend on its prompt alone.
    self.prefill_buckets = tuple(sorted({prefill_chunk // d for d in (1, 2, 4) if prefill_chunk // d}))
    self._no_images = {b: jnp.zeros((1, b, cfg.d_model), cfg.jnp_dtype) for b in self.prefill_buckets}
    self._no_logits = jnp.zeros((self.vocab_size,), jnp.float32)
    self._prefixer = build_prefixer(prefix_cache_mb, prefix_cache_block, prefill_chunk, prefix_cache_exact,
                                    cfg.image_token_id, self._cache)
    if self._prefixer is not None:
      self.metrics.prefix_capacity.set(self._prefixer.store.budget)

  def _serving_state(self, state: Any) -> Any:
    return state if self._castable is None else compute_dtype_state(state, self._castable, self.cfg.jnp_dtype)

  @property
  def prefix(self) -> PrefixCache | None:
    """The prefix cache's blocks (None when it is off)."""
    return self._prefixer.store if self._prefixer is not None else None

  # ---- lifecycle ------------------------------------------------------------------
  @property
  def running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def start(self) -> "Engine":
    """Starts the background loop thread (idempotent)."""
    with self._cond:
      if self.running:
        return self
      self._stopping = False
      self._thread = threading.Thread(target=self._loop, name="horizon-engine", daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    """Stops the loop; requests still waiting or running finish with 'cancelled'. `submit` refuses
    requests until the stop is complete; afterwards the engine is idle and `generate` drives it."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    with self._step_lock:
      for h in self._drain_waiting():
        self._finish_handle(h, "cancelled", 0)
      for i, s in enumerate(self._rows):
        if s is not None:
          self._finish(i, "cancelled")
      with self._cond:
        self._stopping = False

  def update_weights(self, model: Any | None = None) -> None:
    """Serve new weights (e.g. after an RL update) of the same architecture; no recompilation."""
    state = nnx.state(model if model is not None else self.model)
    with self._step_lock:
      self._state = self._serving_state(state)
      if self.prefix is not None:  # cached states belong to the old weights
        self.prefix.clear()
        self._update_gauges()

  def _wake(self) -> None:
    with self._cond:
      self._cond.notify_all()

  def _has_work(self) -> bool:
    return bool(self._waiting) or any(s is not None for s in self._rows)

  def _loop(self) -> None:
    while True:
      with self._cond:
        while not self._stopping and not self._has_work():
          self._cond.wait(timeout=1.0)
        if self._stopping:
          return
      try:
        self.step()
      except Exception:  # never let the loop die; step() already failed the affected requests
        _log.exception("engine iteration failed")

  # ---- submission -----------------------------------------------------------------
  def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> Handle:
    """Queues a request; raises RequestError (bad request) or OverloadedError (queue full).

    loop: deliver events to this asyncio loop (then iterate `aevents()`).
    """
    try:
      self._validate(request)
    except RequestError:
      self.metrics.count_request("rejected")
      raise
    handle = Handle(self, request, loop)
    with self._cond:
      if self._stopping:
        self.metrics.count_request("overloaded")
        raise OverloadedError("the engine is stopping; retry later.")
      if len(self._waiting) >= self.max_queue:
        self.metrics.count_request("overloaded")
        raise OverloadedError(f"the engine queue is full ({self.max_queue} waiting requests); retry "
                              "later or raise config.serving.max_queue.")
      self._waiting.append(handle)
      self.metrics.queue_length.set(len(self._waiting))
      self._cond.notify_all()
    return handle

  def _validate(self, request: Request) -> None:
    validate_request(request, max_context=self.max_context, vocab_size=self.vocab_size, model_cfg=self.cfg,
                     has_vision=self.model.vision is not None)

  # ---- sync conveniences (RL, evaluators, tests) ----------------------------------
  def generate(self, request: Request) -> tuple[list[int], str, Usage]:
    """Runs one request to the end: (token_ids, finish_reason, usage), with the loop thread running
    or not (then this thread drives the loop)."""
    handle = self.submit(request)
    ids, last = [], None
    for ev in self._drive(handle):
      ids += ev.token_ids
      last = ev
    return ids, last.finish_reason, last.usage

  def next_token_logits(self, prompt_ids: list[int], images: np.ndarray | None = None) -> np.ndarray:
    """f32 [vocab] logits after the whole prompt, through the serving path (chunked prefill)."""
    handle = Handle(self, Request(list(prompt_ids), SamplingParams(max_tokens=1, temperature=0.0),
                                  images), None)
    handle._capture_logits = True
    self._validate(handle.request)
    with self._cond:
      self._waiting.append(handle)
      self._cond.notify_all()
    for _ in self._drive(handle):
      pass
    if handle.first_logits is None:
      raise RuntimeError("the engine failed before producing logits (see the log).")
    return handle.first_logits

  def _drive(self, handle: Handle) -> Iterator[Event]:
    if self.running:
      yield from handle.events()
      return
    while not handle.done:
      self.step()
    yield from handle.events(timeout=0)

  # ---- one iteration --------------------------------------------------------------
  def step(self) -> bool:
    """One loop iteration (admit, prefill a chunk, decode, sample); False when idle."""
    with self._step_lock:
      self._reap_cancelled()
      try:
        self._admit()
        if not any(s is not None for s in self._rows):
          return False
        self._decode_and_sample(self._prefill())
      except Exception:  # a failed device call: end every running request, keep serving
        _log.exception("engine step failed; ending %d running requests with 'error'",
                       sum(s is not None for s in self._rows))
        self._fail_all()
      finally:
        self._update_gauges()
      return True

  def _drain_waiting(self) -> list[Handle]:
    with self._cond:
      out = list(self._waiting)
      self._waiting.clear()
    return out

  def _reap_cancelled(self) -> None:
    with self._cond:
      gone = [h for h in self._waiting if h.cancelled]
      for h in gone:
        self._waiting.remove(h)
    for h in gone:
      self._finish_handle(h, "cancelled", 0)
    for i, s in enumerate(self._rows):
      if s is not None and s.handle.cancelled:
        self._finish(i, "cancelled")

  def _admit(self) -> None:
    reset = np.zeros(self.slots, bool)
    admitted = []
    for i in range(self.slots):
      if self._rows[i] is not None:
        continue
      with self._cond:
        if not self._waiting:
          break
        handle = self._waiting.popleft()
      req = handle.request
      seed = req.params.seed if req.params.seed is not None else self._rng.integers(0, 2**63)
      try:  # a failure here (e.g. image encoding) ends this request only, not the others running
        # int(): numpy seeds and ids (`np.int64(3) % 2**64` overflows; an id array has no truth value)
        stop_ids = frozenset(int(t) for t in req.params.stop_token_ids) or frozenset(self.default_stop_ids)
        slot = Slot(handle, np.asarray(req.prompt_ids, np.int32), stop_ids, int(seed) % 2**64)
        slot.routing = [] if req.record_routing else None
        slot.patches = self._encode_images(req.images)
      except Exception:
        _log.exception("admitting %s failed", handle.id)
        self._finish_handle(handle, "error", 0)
        continue
      self._rows[i] = slot
      reset[i] = True
      admitted.append((i, slot))
      self.metrics.prompt_tokens.inc(len(slot.prompt))
    if reset.any():
      self._cache = self._fns["reset"](self._cache, jnp.asarray(reset))
    if self._prefixer is not None:  # load each new row's longest cached prefix
      for i, slot in admitted:
        self._cache, reused = self._prefixer.load(self._cache, i, slot)
        self.metrics.prefix_reused_tokens.inc(reused)

  def _encode_images(self, images: np.ndarray | None) -> np.ndarray | None:
    if images is None or len(images) == 0:
      return None
    # One image per call: one compiled program whatever the image count.
    out = [np.asarray(self._fns["encode"](self._state, jnp.asarray(img[None], jnp.float32))[0],
                      np.float32) for img in np.asarray(images, np.float32)]
    return np.concatenate(out, axis=0)

  def _prefill(self) -> tuple[jax.Array, np.ndarray] | None:
    """Prefills one chunk of every prefilling row; returns (last logits [S, V], rows now done)."""
    rows = [i for i, s in enumerate(self._rows) if s is not None and s.fed < len(s.prompt)]
    if not rows:
      return None
    c = self.prefill_chunk
    finished = []  # (row, last logits) of rows whose prompt is now complete: only they sample
    done = np.zeros(self.slots, bool)
    for i in rows:
      s = self._rows[i]
      chunk = s.prompt[s.fed:s.fed + c]
      width = next(b for b in self.prefill_buckets if b >= len(chunk))
      tokens, embeds = batch.chunk_inputs(s, chunk, width, self.cfg, self._no_images[width])
      logits, self._cache, routed = self._fns["prefill"](
          self._state, self._cache, np.int32(i), jnp.asarray(tokens), jnp.asarray([len(chunk)], np.int32),
          embeds)
      if s.routing is not None and routed is not None:
        s.routing.append(np.asarray(routed[:len(chunk)]))
      s.fed += len(chunk)
      s.cache_len += len(chunk)
      if self._prefixer is not None:
        self._prefixer.add_blocks(self._cache, i, s)
      done[i] = s.fed == len(s.prompt)
      if done[i]:
        finished.append((i, logits))
    # One stack of S rows whatever number of rows finished (one compiled op, not one per count).
    by_row = dict(finished)
    out = jnp.stack([by_row.get(i, self._no_logits) for i in range(self.slots)]).astype(jnp.float32)
    return out, done

  def _decode_and_sample(self, pre) -> None:
    """Samples the rows whose prompt just completed (from their prefill logits) and makes one
    decode call for the decoding rows: up to `decode_steps` steps when `decode_loop.run_ahead`
    allows, else one step under the constraints their processors ask for."""
    done = pre[1] if pre is not None else np.zeros(self.slots, bool)
    decoding = [i for i, s in enumerate(self._rows) if s is not None and s.pending is not None]
    pc, call = self._prefixer, None
    if decoding and not done.any():
      block = pc.store.block if pc is not None and not pc.exact else None
      call = decode_loop.run_ahead(self._rows, self._n_waiting(), block, self.max_context,
                                   self.vocab_size, self.decode_steps, self._open)
    asked = list(np.flatnonzero(done)) + ([] if call is not None else decoding)
    forced, masks, failed = batch.constraints(self._rows, asked, self.vocab_size, self._open)
    for i in failed:
      self._finish(i, "error")
    decoding = [i for i in decoding if i not in failed]
    if call is None and decoding:
      call = decode_loop.one_step(self._rows, decoding, masks, forced, self.vocab_size)
    if call is not None:
      self._decode(call)
    prefilled = [i for i in np.flatnonzero(done) if i not in failed]
    if prefilled:
      self._sample_prefilled(pre[0], prefilled, masks, forced)

  def _decode(self, call: decode_loop.Call) -> None:
    """One decode call (serving/decode_loop.py); delivers each row's tokens in order."""
    rows, call = decode_loop.select_rows(call, self.decode_buckets)
    mask = self._all_allowed[len(rows)] if call.mask is None else jax.device_put(call.mask)
    tokens, logprobs, counts, routed, self._cache = self._fns["decode_loop"](
        self._state, self._cache, rows, *call.head, *call.sampling, mask, call.forced, *call.tail,
        np.int32(call.max_steps), np.bool_(call.yield_on_stop))
    tokens, logprobs, counts, routed = jax.device_get((tokens, logprobs, counts, routed))
    pc = self._prefixer
    for r in np.flatnonzero(counts):
      i = int(rows[r])
      s = self._rows[i]
      for j in range(counts[r]):
        if self._rows[i] is not s:  # its processor ended it (a stop string): drop the rest
          break
        s.cache_len, s.pending = s.cache_len + 1, None  # token j's input was fed at step j
        if s.routing is not None and routed is not None:
          s.routing.append(routed[r, j:j + 1])
        if pc is not None:  # a run stops where a block ends (run_ahead), so the state stands there
          pc.add_blocks(self._cache, int(i), s, decoded=True)
        self._accept(i, int(tokens[r, j]), float(logprobs[r, j]))

  # ---- sampling and delivery ------------------------------------------------------
  def _sample_prefilled(self, logits, rows: list[int], masks, forced) -> None:
    """Samples each of `rows` (prompt just prefilled) from its last prefill logits [S, V]."""
    temp, top_k, top_p, lo, hi, n_gen = batch.sampling_args(self._rows, rows)
    from_prefill = np.isin(np.arange(self.slots), rows)
    tokens, logprobs = self._fns["sample"](
        logits, logits, from_prefill, temp, top_k, top_p,
        self._all_allowed[self.slots] if masks is None else jax.device_put(masks), forced, lo, hi, n_gen)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    for i in rows:
      if self._rows[i].handle._capture_logits:
        self._rows[i].handle.first_logits = np.asarray(logits[i], np.float32)
      self._accept(i, int(tokens[i]), float(logprobs[i]))

  def _accept(self, i: int, token: int, logprob: float) -> None:
    """Records row i's new token; delivers it, or finishes the request."""
    s = self._rows[i]
    now = time.monotonic()
    if not s.generated:
      self.metrics.ttft.observe(now - s.handle.submitted)
    else:
      self.metrics.itl.observe(now - s.last_time)
    s.last_time = now
    s.generated.append(token)
    self.metrics.generation_tokens.inc()
    deltas, reason = [], None
    if token in s.stop_ids:
      reason = "stop"  # the stop token is not fed to the processor
    elif s.processor is not None:
      try:
        deltas, reason = s.processor.feed(token)
        deltas = list(deltas)
      except Exception:
        _log.exception("processor.feed failed for %s", s.handle.id)
        deltas, reason = [], "error"
    n = len(s.generated)
    if reason is None and not decode_loop.row_budget(s.params.max_tokens, n, len(s.prompt), self.max_context):
      reason = "length"  # the rule run_ahead budgets by
    if reason is None:
      s.pending = token
      s.handle._deliver(Event([token], deltas, None, None, time.time(), [logprob]))
    else:
      self._finish(i, reason, [token], deltas, [logprob])

  def _finish(self, i: int, reason: str, token_ids: list[int] = (), deltas: list[Delta] = (),
              logprobs: list[float] = ()) -> None:
    """Ends row i's request with `reason` and frees the slot (its row is zeroed on reuse)."""
    s = self._rows[i]
    self._rows[i] = None
    for b in s.chain:  # the prefix cache may evict them now
      b.refs -= 1
    routing = np.concatenate(s.routing).astype(np.int32) if s.routing else None
    self._finish_handle(s.handle, reason, len(s.generated), token_ids, deltas, logprobs, routing, s.cached)

  def _finish_handle(self, handle: Handle, reason: str, n_generated: int, token_ids=(), deltas=(),
                     logprobs=(), routing: np.ndarray | None = None, cached: int = 0) -> None:
    proc = handle.request.processor
    tail: list[Delta] = []
    thinking = 0
    if proc is not None:  # a failing processor must not keep the final event from its request
      try:
        tail = list(proc.close(reason))
        thinking = int(getattr(proc, "thinking_tokens", 0) or 0)
      except Exception:
        _log.exception("processor.close failed for %s", handle.id)
    usage = Usage(len(handle.request.prompt_ids), n_generated, thinking, cached)
    self.metrics.count_request(reason)
    handle._deliver(Event(list(token_ids), list(deltas) + tail, reason, usage, time.time(),
                          list(logprobs), routing))

  def _fail_all(self) -> None:
    for i, s in enumerate(self._rows):
      if s is not None:
        self._finish(i, "error")
    # The decode state may have been donated to the failed call: start from a fresh one.
    self._cache = self.model.init_cache(self.slots, self.max_context)

  def _n_waiting(self) -> int:
    with self._cond:
      return len(self._waiting)

  def _update_gauges(self) -> None:
    self.metrics.observe([s.cache_len for s in self._rows if s is not None], self._n_waiting(), self.prefix)
