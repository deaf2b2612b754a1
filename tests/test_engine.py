"""serving.engine on the random `tiny` model: reference equality, batching invariance, sampling, limits.

One engine per module (4 slots, 96-token context, 16-token prefill chunks; this
module's `engine` fixture overrides the session one of conftest.py):
the tests drive its loop with `step()` / `generate()` on the test thread,
and the threaded and asyncio paths start its loop thread.
"""

import asyncio
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import ConfigError
from serving.build import build_engine
from serving.engine import OverloadedError, Request, RequestError
from serving.types import SamplingParams, TextDelta
from tests.helpers import assert_close

SLOTS, CONTEXT, CHUNK = 4, 96, 16
REF_LEN = 48  # the reference pads every prompt to this length (one compiled program)


@pytest.fixture(scope="module")
def engine():
  from configs import serve
  config = serve.get_config("tiny")
  config.serving.update(slots=SLOTS, max_context=CONTEXT, prefill_chunk=CHUNK, max_queue=64)
  eng = build_engine(config)
  yield eng
  eng.stop()


def _prompt(n, seed):
  # Ordinary token ids (below the tokenizer's special ids, which start at 316).
  return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def _params(**kw):
  kw.setdefault("temperature", 0.0)
  return SamplingParams(**kw)


@pytest.fixture(scope="module")
def reference(engine):
  """The plain loop, jitted once: model.prefill on the whole (padded) prompt, decode_step, argmax."""
  graphdef, state = nnx.split(engine.model)

  @jax.jit
  def prefill(state, tokens, length, images):
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(1, CONTEXT)
    logits, cache = model.prefill(tokens, length, cache, images=images)
    return jnp.take(logits[0], length[0] - 1, axis=0), cache

  @jax.jit
  def decode(state, token, cache):
    logits, cache = nnx.merge(graphdef, state).decode_step(token, cache)
    return logits[0], cache

  def whole_prompt(prompt, images=None):
    # Prompts without placeholders get a dummy image (unused) so one program serves all calls.
    tokens = np.zeros((1, REF_LEN), np.int32)
    tokens[0, :len(prompt)] = prompt
    images = np.full((1, 1, 16, 16, 3), 0.5, np.float32) if images is None else images
    return prefill(state, tokens, np.array([len(prompt)], np.int32), images)

  def greedy(prompt, n_new):
    last, cache = whole_prompt(prompt)
    out, lps = [], []
    for _ in range(n_new):
      tok = int(jnp.argmax(last))
      out.append(tok)
      lps.append(float(jax.nn.log_softmax(last)[tok]))
      last, cache = decode(state, jnp.asarray([tok], jnp.int32), cache)
    return out, lps

  greedy.whole_prompt = whole_prompt
  return greedy


def _collect(handle):
  ids, lps, last = [], [], None
  for ev in handle.events(timeout=60):
    ids += ev.token_ids
    lps += ev.logprobs
    last = ev
  return ids, lps, last


def test_greedy_equals_reference_loop(engine, reference):
  # Prompt lengths below, at and above the 16-token chunk (up to three chunks).
  for n, seed in ((5, 1), (16, 2), (23, 3), (41, 4)):
    prompt = _prompt(n, seed)
    handle = engine.submit(Request(prompt, _params(max_tokens=7, stop_token_ids=[330])))
    while not handle.done:
      engine.step()
    ids, lps, last = _collect(handle)
    ref_ids, ref_lps = reference(prompt, 7)
    assert ids == ref_ids, f"prompt length {n}"
    assert_close(lps, ref_lps, what=f"logprobs, prompt length {n}")
    assert last.finish_reason == "length"
    assert last.usage.prompt_tokens == n and last.usage.completion_tokens == 7


def _mixed_requests():
  rng = np.random.default_rng(7)
  reqs = []
  for j in range(10):
    n, m = int(rng.integers(2, 45)), int(rng.integers(3, 18))
    params = (SamplingParams(max_tokens=m, temperature=0.8, top_p=0.95, seed=100 + j) if j % 2 else
              _params(max_tokens=m))
    reqs.append(Request(_prompt(n, 50 + j), params))
  return reqs


def test_continuous_batching_is_bit_identical_to_running_alone(engine):
  reqs = _mixed_requests()
  handles = [engine.submit(r) for r in reqs]
  busy, queued = [], []
  while not all(h.done for h in handles):
    engine.step()
    busy.append(engine.metrics.slots_used.value())
    queued.append(engine.metrics.queue_length.value())
  assert max(busy) == SLOTS and queued[0] == len(reqs) - SLOTS and queued[-1] == 0
  batched = [_collect(h) for h in handles]
  for r, (ids, lps, last) in zip(reqs, batched, strict=True):
    alone_ids, reason, usage = engine.generate(r)
    assert ids == alone_ids, f"request {r.params}"
    assert last.finish_reason == reason
    # the same usage, but for the prompt tokens the rerun loads from the prefix cache
    assert last.usage == dataclasses.replace(usage, cached_tokens=last.usage.cached_tokens)
    assert usage.cached_tokens >= last.usage.cached_tokens
    assert len(lps) == len(ids)


def test_seeds(engine):
  prompt = _prompt(9, 11)
  sample = lambda seed: engine.generate(Request(prompt, SamplingParams(
      max_tokens=24, temperature=1.0, seed=seed, stop_token_ids=[330])))[0]
  a, b, c = sample(3), sample(3), sample(4)
  assert a == b
  assert a != c
  # Seeds beyond 32 bits are accepted and distinct from their low word.
  assert sample(3 + 2**40) != a


def test_top_k_one_is_greedy(engine):
  prompt = _prompt(13, 12)
  greedy = engine.generate(Request(prompt, _params(max_tokens=10, stop_token_ids=[330])))[0]
  top1 = engine.generate(Request(prompt, SamplingParams(max_tokens=10, temperature=0.8, top_k=1,
                                                        seed=5, stop_token_ids=[330])))[0]
  assert top1 == greedy
  nucleus = engine.generate(Request(prompt, SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6,
                                                           seed=6, stop_token_ids=[330])))[0]
  assert nucleus == greedy


def _filtered_reference(logits, temperature, top_k, top_p, mask):
  """Plain numpy: mask, temperature, keep the top_k, then the smallest nucleus with mass >= top_p."""
  x = np.where(mask, logits, -np.inf) / temperature
  order = np.argsort(-x, kind="stable")
  if top_k:
    x[order[top_k:]] = -np.inf
  p = np.exp(x - x.max())
  p /= p.sum()
  mass_before = np.cumsum(p[order]) - p[order]
  drop = order[mass_before >= top_p]
  p[drop] = 0
  return p / p.sum()


def test_sampler_matches_filtered_distribution():
  from serving.sampling import sample_row
  logits = np.random.default_rng(5).normal(size=11).astype(np.float32) * 2
  mask = np.ones(11, bool)
  mask[[2, 7]] = False
  n = 4000
  draw = jax.jit(jax.vmap(sample_row, in_axes=(None,) * 8 + (0,)))
  for temperature, top_k, top_p in ((0.7, 5, 0.8), (1.3, 0, 0.9), (1.0, 3, 1.0)):
    tokens, lps = draw(logits, np.float32(temperature), np.int32(top_k), np.float32(top_p), mask,
                       np.int32(-1), np.uint32(9), np.uint32(0), np.arange(n, dtype=np.uint32))
    want = _filtered_reference(logits, temperature, top_k, top_p, mask)
    freq = np.bincount(np.asarray(tokens), minlength=11) / n
    assert np.all(freq[want == 0] == 0), (freq, want)
    assert np.max(np.abs(freq - want)) < 0.035, (freq, want)  # ~4 standard errors at n=4000
    assert_close(lps, jax.nn.log_softmax(logits)[np.asarray(tokens)], what="logprobs")
  # Unfiltered sampling uses the per-request key fold_in(fold_in(PRNGKey(seed), 0), n_generated).
  for seed in (0, 12345, 2**32 - 1):
    tokens = draw(logits, np.float32(1), np.int32(0), np.float32(1), np.ones(11, bool), np.int32(-1),
                  np.uint32(seed), np.uint32(0), np.arange(8, dtype=np.uint32))[0]
    root = jax.random.fold_in(jax.random.PRNGKey(seed), 0)
    want = [int(jax.random.categorical(jax.random.fold_in(root, i), logits)) for i in range(8)]
    assert np.asarray(tokens).tolist() == want


def test_sample_batch_skips_unused_filters_without_changing_rows():
  from serving.sampling import sample_batch, sample_row
  rng = np.random.default_rng(6)
  S, V = 6, 37
  logits = jnp.asarray(rng.normal(size=(S, V)).astype(np.float32) * 3)
  mask = np.ones((S, V), bool)
  mask[1, :5] = False
  rest = (mask, np.array([-1, -1, 4, -1, -1, -1], np.int32), np.arange(S, dtype=np.uint32),
          np.zeros(S, np.uint32), np.arange(S, dtype=np.uint32) * 3)
  temp = np.array([0.0, 0.8, 1.0, 1.3, 0.5, 1.0], np.float32)
  batch = jax.jit(sample_batch)
  rows = jax.jit(jax.vmap(sample_row))
  plain = (np.zeros(S, np.int32), np.ones(S, np.float32))  # no row filters: the sort-free branch
  some = (np.array([0, 0, 0, 5, 0, 0], np.int32), np.array([1, 1, 1, 1, 0.7, 1], np.float32))
  for top_k, top_p in (plain, some):
    got = batch(logits, temp, top_k, top_p, *rest)
    want = rows(logits, temp, top_k, top_p, *rest)
    for g, w in zip(got, want, strict=True):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # Rows without filters draw the same whichever branch their batch took.
  a = batch(logits, temp, *plain, *rest)
  b = batch(logits, temp, *some, *rest)
  for i in (0, 1, 2, 5):
    assert int(a[0][i]) == int(b[0][i]) and float(a[1][i]) == float(b[1][i])


class _Scripted:
  """Forces `force` first, then allows only `allowed` ids, ends with `reason` after `n` tokens."""

  def __init__(self, force, allowed, n, vocab, reason="tool_calls"):
    self.force, self.n, self.reason = force, n, reason
    self.mask = np.zeros(vocab, bool)
    self.mask[allowed] = True
    self.fed, self.closed = [], []

  def next_constraint(self):
    return self.force if not self.fed else self.mask

  def feed(self, token_id):
    self.fed.append(token_id)
    return [TextDelta(f"<{token_id}>")], (self.reason if len(self.fed) == self.n else None)

  def close(self, reason):
    self.closed.append(reason)
    return [TextDelta("closed")]

  @property
  def thinking_tokens(self):
    return 2


def test_processor_forces_masks_and_finishes(engine):
  allowed = [17, 40, 41, 200]
  proc = _Scripted(force=123, allowed=allowed, n=6, vocab=engine.vocab_size)
  handle = engine.submit(Request(_prompt(20, 13), SamplingParams(max_tokens=30, temperature=1.5, seed=1),
                                 processor=proc))
  while not handle.done:
    engine.step()
  events = list(handle.events(timeout=0))
  ids = [t for ev in events for t in ev.token_ids]
  assert ids[0] == 123 and set(ids[1:]) <= set(allowed) and len(ids) == 6
  assert proc.fed == ids and proc.closed == ["tool_calls"]
  assert events[-1].finish_reason == "tool_calls"
  assert events[-1].deltas[-1] == TextDelta("closed")
  assert [d.text for ev in events for d in ev.deltas][:-1] == [f"<{t}>" for t in ids]
  assert events[-1].usage.thinking_tokens == 2 and events[-1].usage.completion_tokens == 6


def test_stop_token_and_max_tokens(engine):
  prompt = _prompt(10, 14)
  free = engine.generate(Request(prompt, _params(max_tokens=12, stop_token_ids=[330])))
  assert free[1] == "length" and len(free[0]) == 12 and free[2].completion_tokens == 12
  stop = free[0][4]
  proc = _Scripted(force=None, allowed=np.arange(engine.vocab_size), n=10**6, vocab=engine.vocab_size)
  proc.next_constraint = lambda: None
  ids, reason, usage = engine.generate(Request(prompt, _params(max_tokens=12, stop_token_ids=[stop]),
                                               processor=proc))
  cut = free[0].index(stop) + 1
  assert reason == "stop" and ids == free[0][:cut] and usage.completion_tokens == cut
  assert proc.fed == ids[:-1]  # the stop token is not fed to the processor
  assert proc.closed == ["stop"]


def test_bad_requests_raise_with_param(engine):
  before = engine.metrics.requests.value(status="rejected")
  cases = [
      (Request(_prompt(CONTEXT + 1, 1), _params(max_tokens=1)), "prompt"),
      (Request([], _params(max_tokens=4)), "prompt"),
      (Request(_prompt(60, 1), _params(max_tokens=CONTEXT - 59)), "max_tokens"),
      (Request(_prompt(5, 1), _params(max_tokens=0)), "max_tokens"),
      (Request(_prompt(5, 1), _params(max_tokens=4, temperature=-1.0)), "temperature"),
      (Request(_prompt(5, 1), _params(max_tokens=4, top_p=0.0)), "top_p"),
      (Request(_prompt(5, 1), _params(max_tokens=4), images=np.zeros((1, 16, 16, 3), np.float32)), "images"),
      (Request([engine.cfg.image_token_id] * 3, _params(max_tokens=4)), "prompt"),
      (Request([5, engine.vocab_size], _params(max_tokens=4)), "prompt"),
  ]
  for req, param in cases:
    with pytest.raises(RequestError) as err:
      engine.submit(req)
    assert err.value.param == param, err.value.message
  assert engine.metrics.requests.value(status="rejected") == before + len(cases)
  # The largest allowed request is accepted.
  ids, reason, _ = engine.generate(Request(_prompt(60, 1), _params(max_tokens=CONTEXT - 60)))
  assert len(ids) == CONTEXT - 60 and reason == "length"


def test_overloaded(engine):
  keep = engine.max_queue
  engine.max_queue = 2
  try:
    handles = [engine.submit(Request(_prompt(4, 2), _params(max_tokens=2))) for _ in range(2)]
    with pytest.raises(OverloadedError):
      engine.submit(Request(_prompt(4, 2), _params(max_tokens=2)))
  finally:
    engine.max_queue = keep
  for h in handles:
    h.cancel()
  engine.step()
  assert all(list(h.events(timeout=0))[-1].finish_reason == "cancelled" for h in handles)


def test_cancel_frees_the_slot(engine):
  bos = [engine.tokenizer.special_id("bos")]  # the only stop id: the long ones run their 80 tokens
  long = [engine.submit(Request(_prompt(6, 20 + j), _params(max_tokens=80, stop_token_ids=bos)))
          for j in range(SLOTS)]
  late = engine.submit(Request(_prompt(7, 30), _params(max_tokens=5)))
  waiting = engine.submit(Request(_prompt(7, 31), _params(max_tokens=5)))
  for _ in range(2):  # prefill, then one decode call (up to decode_steps tokens: a request waits)
    engine.step()
  assert engine.metrics.slots_used.value() == SLOTS and engine.metrics.queue_length.value() == 2
  waiting.cancel()
  long[1].cancel()
  engine.step()
  assert engine.metrics.queue_length.value() == 0  # `late` took the freed slot
  while not late.done:
    engine.step()
  assert _collect(late)[2].finish_reason == "length"
  ids, _, last = _collect(long[1])
  assert last.finish_reason == "cancelled" and 1 <= last.usage.completion_tokens == len(ids) < 80
  assert _collect(waiting)[2].finish_reason == "cancelled"
  for h in long:
    h.cancel()
  engine.step()
  assert engine.metrics.slots_used.value() == 0


def test_image_request_matches_prefill_with_images(engine, reference):
  cfg = engine.cfg
  n_patch = cfg.vision.num_patches
  # Text, one image whose placeholders straddle the chunk boundary, text again.
  prompt = _prompt(10, 40) + [cfg.image_token_id] * n_patch + _prompt(9, 41)
  image = np.random.default_rng(3).uniform(size=(1, 16, 16, 3)).astype(np.float32)
  got = engine.next_token_logits(prompt, image)
  want = reference.whole_prompt(prompt, jnp.asarray(image[None]))[0]
  assert_close(got, want, what="first-token logits with an image")
  # The image's content matters: another image gives other logits.
  plain = reference.whole_prompt(prompt, jnp.asarray(1 - image[None]))[0]
  assert not np.allclose(got, plain, atol=1e-3)


def test_engine_error_keeps_the_loop_alive(engine, reference):
  real = engine._fns["decode_loop"]
  calls = []

  def broken(*args):
    calls.append(1)
    raise RuntimeError("injected device failure")

  engine._fns["decode_loop"] = broken
  try:
    handles = [engine.submit(Request(_prompt(5, 60 + j), _params(max_tokens=4))) for j in range(2)]
    while not all(h.done for h in handles):
      engine.step()
  finally:
    engine._fns["decode_loop"] = real
  assert calls and all(_collect(h)[2].finish_reason == "error" for h in handles)
  # A failing processor ends only its own request.
  proc = _Scripted(force=None, allowed=[1], n=99, vocab=engine.vocab_size)
  proc.next_constraint = lambda: 1 / 0
  bad = engine.submit(Request(_prompt(5, 70), _params(max_tokens=4), processor=proc))
  good = engine.submit(Request(_prompt(5, 71), _params(max_tokens=4)))
  while not (bad.done and good.done):
    engine.step()
  assert _collect(bad)[2].finish_reason == "error" and proc.closed == ["error"]
  ids, _, last = _collect(good)
  assert last.finish_reason == "length"
  assert ids == reference(_prompt(5, 71), 4)[0]


def test_threaded_and_asyncio_consumers(engine):
  reqs = [Request(_prompt(8 + 5 * j, 80 + j), _params(max_tokens=6 + j)) for j in range(6)]
  expected = [engine.generate(r)[0] for r in reqs]  # driven on this thread
  engine.start()
  try:
    assert engine.running
    assert engine.generate(reqs[0])[0] == expected[0]  # through the loop thread

    async def consume(r, bind_at_submit):
      h = engine.submit(r, loop=asyncio.get_running_loop() if bind_at_submit else None)
      ids, reasons = [], []
      async for ev in h.aevents():
        ids += ev.token_ids
        reasons.append(ev.finish_reason)
      assert reasons[-1] == "length" and all(x is None for x in reasons[:-1])
      return ids

    async def main():
      return await asyncio.gather(*(consume(r, j % 2 == 0) for j, r in enumerate(reqs)))

    assert asyncio.run(main()) == expected
  finally:
    engine.stop()
  assert not engine.running


def test_metrics_render(engine):
  text = engine.metrics.render()
  values = {}
  for line in text.splitlines():
    if not line.startswith("#"):
      name, value = line.rsplit(" ", 1)
      values[name] = float(value)
  for name in ("horizon_prompt_tokens_total", "horizon_generation_tokens_total", "horizon_queue_length",
               "horizon_slots_used", "horizon_slots_total", "horizon_context_tokens_used",
               "horizon_context_tokens_capacity", "horizon_time_to_first_token_seconds_count",
               "horizon_inter_token_latency_seconds_count"):
    assert name in values, name
  assert values["horizon_slots_total"] == SLOTS
  assert values["horizon_context_tokens_capacity"] == SLOTS * CONTEXT
  assert values["horizon_generation_tokens_total"] > 50 and values["horizon_prompt_tokens_total"] > 100
  assert values['horizon_requests_total{status="length"}'] > 10
  assert values['horizon_requests_total{status="cancelled"}'] >= 3
  assert values['horizon_requests_total{status="rejected"}'] >= 9
  ttft = values["horizon_time_to_first_token_seconds_count"]
  assert ttft > 10 and values['horizon_time_to_first_token_seconds_bucket{le="+Inf"}'] == ttft
  assert 0 < values["horizon_time_to_first_token_seconds_sum"] / ttft < 60
  assert re.search(r"# TYPE horizon_inter_token_latency_seconds histogram", text)


def test_build_engine_from_checkpoint(engine, tmp_path):
  """The checkpoint's stored model config wins over the serve config's; weights are the saved ones."""
  from configs import serve
  from training.checkpoint import Checkpointer
  run = serve.get_config("tiny")
  with Checkpointer(str(tmp_path / "ckpt"), every=1, keep=1, async_save=False) as ckpt:
    ckpt.save(3, model=engine.model, config=run.to_dict())
  config = serve.get_config("tiny")
  config.model.d_model = 64  # a model these weights do not fit: must be ignored
  config.serving.update(slots=2, max_context=48, prefill_chunk=8, prefix_cache_block=8)
  loaded = build_engine(config, str(tmp_path / "ckpt"))
  assert loaded.cfg == engine.cfg and (loaded.slots, loaded.max_context) == (2, 48)
  want, got = nnx.state(engine.model, nnx.Param), nnx.state(loaded.model, nnx.Param)
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(want),
                               jax.tree_util.tree_leaves_with_path(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
  assert loaded.tokenizer.image_id == engine.cfg.image_token_id
  config.serving.tokenizer = str(tmp_path / "missing.json")  # the error named --config.data.tokenizer
  with pytest.raises(FileNotFoundError, match="missing.json. does not exist.*--config.serving.tokenizer at"):
    build_engine(config, str(tmp_path / "ckpt"))
  # Fields set on the command line: runtime ones apply to the loaded weights (they were dropped
  # silently); one the weights fix is refused by name, unless it agrees with the checkpoint.
  config.serving.tokenizer = ""
  other = "float32" if engine.cfg.dtype != "float32" else "bfloat16"
  ran = build_engine(config, str(tmp_path / "ckpt"), model_overrides={"dtype": other, "kernels": "xla",
                                                                      "d_model": engine.cfg.d_model})
  assert (ran.cfg.dtype, ran.cfg.kernels, ran.cfg.d_model) == (other, "xla", engine.cfg.d_model)
  with pytest.raises(ConfigError, match=r"config.model.d_model=64 \(checkpoint .* has 56\).*drop the flag"):
    build_engine(config, str(tmp_path / "ckpt"), model_overrides={"d_model": 64, "kernels": "xla"})
  with pytest.raises(ConfigError, match="quantization='experts'.*experiments.quantize"):
    build_engine(config, str(tmp_path / "ckpt"), model_overrides={"quantization": "experts"})


def test_ids_past_the_tokenizer_are_never_sampled():
  """tiny_sharded pads its vocabulary to 332 ids for a 331-token tokenizer: an unconstrained row
  sampled id 331 now and then, and a request with an output processor then failed decoding it
  (finish 'error'; RL dropped or mis-scored such episodes). Every mask the engine builds for a
  free row now stops at the tokenizer's last id."""
  from configs import serve
  from serving import batch as batch_lib
  config = serve.get_config("tiny_sharded")
  config.serving.update(slots=4, max_context=160, prefill_chunk=16)
  eng = build_engine(config)
  n = eng.tokenizer.vocab_size
  assert eng.vocab_size == n + 1 and not eng._open[n:].any() and eng._open[:n].all()
  assert not np.asarray(eng._all_allowed[4])[:, n:].any()
  rows = batch_lib.open_rows(3, eng.vocab_size, eng._open)
  assert rows.shape == (3, n + 1) and rows[:, :n].all() and not rows[:, n:].any()
  assert batch_lib.open_rows(2, 5, None).all()
  # Near-uniform sampling (temperature 1000) over ~2,000 tokens: id 331 would come up ~6 times.
  handles = [eng.submit(Request(_prompt(8, s), SamplingParams(temperature=1000.0, max_tokens=150, seed=s)))
             for s in range(16)]
  while not all(h.done for h in handles):
    eng.step()
  ids = [t for h in handles for t in _collect(h)[0]]
  assert len(ids) > 1000 and max(ids) < n, (len(ids), max(ids))
  eng.stop()
