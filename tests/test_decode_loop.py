"""serving/decode_loop.py: run-ahead decoding gives the tokens, log-probs, finish reasons, deltas
and routing of one step per call, on the random `tiny` model (two engines, one model)."""

import jax
import numpy as np
import pytest

from serving import decode_loop
from serving.build import build_engine
from serving.engine import Engine, Request
from serving.output import OutputProcessor
from serving.types import FreeRun, SamplingParams, TextDelta, ToolChoice

SLOTS, CONTEXT, CHUNK, STEPS = 4, 96, 16, 8


@pytest.fixture(scope="module")
def engines():
  """(run-ahead engine, the same with run-ahead turned off, the K-step calls' log): both with
  tiny's prefix cache (decoded blocks cached too), which run-ahead must fill as one step per call
  does. Both compile the decode program for K steps: one program, whatever the step count."""
  from configs import serve
  config = serve.get_config("tiny")
  s = config.serving
  # Both batch-invariant (every call computes all slots): compared bitwise below.
  s.update(slots=SLOTS, max_context=CONTEXT, prefill_chunk=CHUNK, decode_steps=STEPS, batch_invariant=True)
  assert s.prefix_cache_mb > 0 and not s.prefix_cache_exact
  ahead = build_engine(config)
  one = Engine(ahead.model, ahead.tokenizer, slots=SLOTS, max_context=CONTEXT, prefill_chunk=CHUNK,
               prefix_cache_mb=s.prefix_cache_mb, prefix_cache_block=s.prefix_cache_block,
               decode_steps=STEPS)
  calls, program = [], ahead._fns["decode_loop"]

  def logged(*args):
    calls.append(int(args[-2]))  # max_steps (then yield_on_stop)
    return program(*args)
  ahead._fns["decode_loop"] = logged
  # One step per call for `one` (run_ahead's own rule: steps < 2).
  one.decode_steps = 1
  yield ahead, one, calls
  ahead.stop()
  one.stop()


def _prompt(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]  # below the special ids


def _run(engine, requests):
  """Submits all, drives the engine on this thread; per request: ids, logprobs, reason, deltas."""
  handles = [engine.submit(r) for r in requests]
  while not all(h.done for h in handles):
    engine.step()
  out = []
  for h in handles:
    ids, lps, deltas, reason, routing = [], [], [], None, None
    for ev in h.events(timeout=0):
      ids += ev.token_ids
      lps += ev.logprobs or []
      deltas += [(type(d).__name__, getattr(d, "text", None)) for d in ev.deltas]
      reason = ev.finish_reason or reason
      routing = ev.routing if ev.routing is not None else routing
    h.routing = routing
    out.append((ids, lps, reason, deltas, h))
  return out


def _both(engines, requests):
  """Runs requests() through both engines; checks they agree (tokens and log-probs bitwise, reasons,
  deltas, and the prefix caches' blocks); returns the run-ahead engine's results."""
  ahead, one, _ = engines
  got, want = _run(ahead, requests()), _run(one, requests())
  for (ids_a, lps_a, ra, da, _), (ids_b, lps_b, rb, db, _) in zip(got, want, strict=True):
    assert ids_a == ids_b
    assert lps_a == lps_b  # bitwise: the same maths, compiled inside the loop
    assert ra == rb and da == db
  pa, pb = ahead.prefix.blocks, one.prefix.blocks
  assert sorted(pa) == sorted(pb)  # the same blocks (their LRU order follows the calls)
  for key, block in pa.items():
    other = pb[key]
    mine, theirs = (jax.tree.leaves((b.tokens, b.state)) for b in (block, other))
    for x, y in zip(mine, theirs, strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  return got, want


def test_same_tokens_as_one_step_per_call(engines):
  ahead, one, calls = engines
  eos = ahead.tokenizer.special_id("bos")

  def requests():
    return [Request(_prompt(20, 1), SamplingParams(max_tokens=21, temperature=0.0, stop_token_ids=[eos])),
            Request(_prompt(7, 2), SamplingParams(max_tokens=30, temperature=0.9, top_k=50, top_p=0.9, seed=3,
                                                  stop_token_ids=[eos])),
            Request(_prompt(33, 3), SamplingParams(max_tokens=13, temperature=1.3, seed=2**40 + 5,
                                                   stop_token_ids=[eos])),
            Request(_prompt(CONTEXT - 12, 4), SamplingParams(max_tokens=12, temperature=0.7, seed=9,
                                                             stop_token_ids=[eos]))]
  before = len(calls)
  got, want = _both(engines, requests)
  assert [len(g[0]) for g in got] == [21, 30, 13, 12]
  assert [g[2] for g in got] == ["length"] * 4  # the last row fills its context with max_tokens
  assert max(calls[before:]) == STEPS  # the run-ahead path ran


def test_row_buckets_compute_only_the_decoding_rows(engines):
  """batch_invariant=False: each call computes the smallest bucket (2 or 4 of the 4 slots) holding
  its decoding rows, gathered from the decode state and written back. Greedy tokens and finish
  reasons equal the all-slots engine's and log-probs agree to rounding (not bitwise: XLA compiles
  each row count on its own, and tiny's MoE reads gathered experts below 8 assignments)."""
  ahead, _, _ = engines
  buckets = Engine(ahead.model, ahead.tokenizer, slots=SLOTS, max_context=CONTEXT, prefill_chunk=CHUNK,
                   decode_steps=STEPS, batch_invariant=False)
  assert buckets.decode_buckets == (2, 4)
  rows_seen, program = [], buckets._fns["decode_loop"]

  def logged(state, cache, rows, *rest):
    rows_seen.append(tuple(int(r) for r in rows))
    return program(state, cache, rows, *rest)
  buckets._fns["decode_loop"] = logged
  eos = ahead.tokenizer.special_id("bos")

  def requests():
    return [Request(_prompt(n, 60 + n), SamplingParams(max_tokens=m, temperature=0.0, stop_token_ids=[eos]))
            for n, m in ((9, 5), (21, 24), (14, 11))]
  got, (want, _) = _run(buckets, requests()), _both(engines, requests)  # both: their caches stay alike
  for (ids_a, lps_a, ra, _, _), (ids_b, lps_b, rb, _, _) in zip(got, want, strict=True):
    assert ids_a == ids_b and ra == rb == "length"
    np.testing.assert_allclose(lps_a, lps_b, rtol=1e-4, atol=1e-5)
  assert {len(r) for r in rows_seen} == {2, 4}  # three rows decode at 4, the last one or two at 2
  assert all(len(set(r)) == len(r) for r in rows_seen)
  buckets.stop()


def test_stop_ids_end_rows_inside_a_run(engines):
  ahead, one, calls = engines
  # Greedy continuations of these prompts, decoded one step per call: stop at a token that comes
  # mid-run, so the device stops that row and the others go on.
  prompts = [_prompt(10, s) for s in (11, 12, 13)]
  free, _ = _both(engines, lambda: [Request(p, SamplingParams(max_tokens=24, temperature=0.0))
                                    for p in prompts])
  stops = [[ids[5]] for ids, *_ in free]

  def requests():
    return [Request(p, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=st))
            for p, st in zip(prompts, stops, strict=True)]
  got, want = _both(engines, requests)
  assert all(g[2] == "stop" and len(g[0]) <= 6 for g in got)


def test_runs_ahead_while_requests_wait_for_a_slot(engines):
  """Seven requests, four slots: while requests wait, calls still run up to K steps (they were one
  step each) and end at the step where their first row stops, so a freed slot is taken at the same
  token as with one step per call. Tokens and log-probs bitwise as one step per call."""
  ahead, _, _ = engines
  log, program = [], ahead._fns["decode_loop"]

  def logged(*args):
    out = program(*args)
    log.append((int(args[-2]), bool(args[-1]), [int(c) for c in np.asarray(out[2]) if c]))
    return out
  lengths = (5, 9, 14, 20, 7, 11, 6)

  def requests():
    return [Request(_prompt(8 + i, 60 + i), SamplingParams(max_tokens=m, temperature=0.0))
            for i, m in enumerate(lengths)]
  ahead._fns["decode_loop"] = logged
  try:
    got, _ = _both(engines, requests)
  finally:
    ahead._fns["decode_loop"] = program
  assert tuple(len(g[0]) for g in got) == lengths
  waited = [counts for steps, yields, counts in log if yields]
  assert len(waited) >= 3 and all(steps == STEPS for steps, yields, _ in log if yields)
  assert max(max(c) for c in waited) > 1  # ran ahead while requests waited
  # Every row live at a call's start runs until the first one stops, then the call ends: equal counts.
  assert all(len(set(c)) == 1 for c in waited), waited
  assert not log[-1][1]  # the queue drained: the last calls run ahead without yielding


def _chat(tok, budget, stop=()):
  return OutputProcessor(tok, thinking=True, thinking_budget=budget, stop=stop)


def test_chat_processor_runs_ahead_with_the_same_deltas(engines):
  ahead, one, calls = engines
  tok = ahead.tokenizer

  def requests():
    return [Request(_prompt(12, 21), SamplingParams(max_tokens=40, temperature=1.0, seed=1),
                    processor=_chat(tok, 9)),
            Request(_prompt(15, 22), SamplingParams(max_tokens=40, temperature=1.0, seed=2),
                    processor=_chat(tok, None)),
            Request(_prompt(9, 23), SamplingParams(max_tokens=33, temperature=0.0), processor=_chat(tok, 3))]
  before = len(calls)
  got, want = _both(engines, requests)
  assert max(calls[before:]) == STEPS
  think_close = tok.special_id("/think")
  for ids, _, _, deltas, h in got[::2]:  # budgets 9 and 3: <|/think|> forced right after them
    budget = h.request.processor._budget
    assert ids[budget] == think_close and h.request.processor.thinking_tokens == budget
    assert any(k == "ThinkingDelta" for k, _ in deltas)


def test_stop_string_ends_a_row_inside_a_run(engines):
  ahead, one, _ = engines
  tok = ahead.tokenizer
  free, _ = _both(engines, lambda: [Request(_prompt(10, 31), SamplingParams(max_tokens=30, temperature=0.0),
                                            processor=OutputProcessor(tok, thinking=False,
                                                                      thinking_budget=None))])
  text = "".join(t for k, t in free[0][3] if k == TextDelta.__name__ and t)
  assert len(text) > 12, text
  stop = text[8:11]

  def requests():
    return [Request(_prompt(10, 31), SamplingParams(max_tokens=30, temperature=0.0),
                    processor=OutputProcessor(tok, thinking=False, thinking_budget=None, stop=[stop])),
            Request(_prompt(14, 32), SamplingParams(max_tokens=30, temperature=0.0),
                    processor=OutputProcessor(tok, thinking=False, thinking_budget=None))]
  got, want = _both(engines, requests)
  assert got[0][4].request.processor.stop_sequence == stop and len(got[0][0]) < 30


def test_routing_recorded_inside_a_run(engines):
  ahead, one, calls = engines
  if not any(k == "moe" for k in ahead.cfg.ffn_kinds):
    pytest.skip("tiny has no MoE layers")

  def requests():
    return [Request(_prompt(n, 40 + n), SamplingParams(max_tokens=11, temperature=0.0), record_routing=True)
            for n in (6, 17)]
  before = len(calls)
  got, want = _both(engines, requests)
  assert max(calls[before:]) == STEPS
  for g, w in zip(got, want, strict=True):
    a, b = g[4].routing, w[4].routing
    assert a.shape == b.shape == (len(g[4].request.prompt_ids) + len(g[0]) - 1,) + a.shape[1:]
    np.testing.assert_array_equal(a, b)


# ---- eligibility ------------------------------------------------------------------


class _Slot:
  def __init__(self, prompt=4, fed=4, pending=5, processor=None, generated=(1,), max_tokens=10):
    self.prompt, self.fed, self.pending = np.zeros(prompt, np.int32), fed, pending
    self.generated, self.routing, self.seed, self.stop_ids = list(generated), None, 2**40 + 7, frozenset({2})
    self.processor, self.cache_len = processor, prompt + len(generated) - 1
    self.params = SamplingParams(max_tokens=max_tokens, temperature=0.5, top_k=3, top_p=0.8)


class _Proc:
  def __init__(self, run):
    self.run = run

  def free_run(self):
    if isinstance(self.run, Exception):
      raise self.run
    return self.run


def _ahead(rows, waiting=0, block=None, steps=8):
  return decode_loop.run_ahead(rows, waiting, block, 64, 16, steps)


def test_run_ahead_eligibility():
  ok = [_Slot(), None]
  assert _ahead(ok) is not None
  assert _ahead(ok, steps=1) is None
  assert not _ahead(ok).yield_on_stop
  assert _ahead(ok, waiting=1) is None  # a request came after admission and a slot is free: admit it
  busy = _ahead([_Slot(), _Slot()], waiting=3)  # every slot busy: run ahead, end where one stops
  assert busy is not None and busy.yield_on_stop and busy.max_steps == 8
  assert _ahead([None, None]) is None
  assert _ahead([_Slot(fed=2), _Slot()]) is None  # still prefilling
  assert _ahead([_Slot(pending=None)]) is None
  assert _ahead([_Slot(processor=object())]) is None  # no free_run
  assert _ahead([_Slot(processor=_Proc(None))]) is None
  assert _ahead([_Slot(processor=_Proc(FreeRun(None, frozenset(), 0)))]) is None
  assert _ahead([_Slot(processor=_Proc(ValueError("x")))]) is None


def test_run_ahead_inputs():
  mask = np.zeros(12, bool)
  mask[[3, 4]] = True
  rows = [_Slot(processor=_Proc(FreeRun(mask, frozenset({7, 9, 11, 13, 14, 99}), 3))), None,
          _Slot(prompt=60, fed=60, generated=(1, 2), max_tokens=50)]
  c = _ahead(rows)
  tokens, active, budget, stop = c.head
  np.testing.assert_array_equal(tokens, [5, 0, 5])
  np.testing.assert_array_equal(active, [True, False, True])
  np.testing.assert_array_equal(budget, [3, 0, 2])  # the free run's 3; the context's 64 - 60 - 2
  assert stop.shape == (3, 16) and np.flatnonzero(stop[0]).tolist() == [2, 7, 9, 11, 13, 14]  # 99: no id
  assert not stop[1].any() and np.flatnonzero(stop[2]).tolist() == [2]
  assert c.mask.shape == (3, 16) and c.mask[0].tolist() == mask.tolist() + [False] * 4
  assert c.mask[1].all() and c.mask[2].all()
  assert (c.forced == -1).all() and c.max_steps == 8
  temp, top_k, top_p = c.sampling
  lo, hi, n_gen = c.tail
  assert lo[0] == 7 and hi[0] == 2**8 and n_gen.tolist() == [1, 0, 2] and n_gen.dtype == np.uint32
  assert temp[0] == np.float32(0.5) and top_k[2] == 3 and top_p[0] == np.float32(0.8)
  # The engine's argument order (Engine._decode) matches the specs serving/weights traces with.
  rows_b, c = decode_loop.select_rows(c, (3,))
  args = (rows_b, *c.head, *c.sampling, c.mask, c.forced, *c.tail, np.int32(c.max_steps),
          np.bool_(c.yield_on_stop))
  specs = decode_loop.input_specs(3, 16)
  assert [(a.shape, np.dtype(a.dtype)) for a in args] == [(x.shape, np.dtype(x.dtype)) for x in specs]


def test_row_buckets():
  assert decode_loop.row_buckets(16, batch_invariant=False) == (2, 4, 8, 16)
  assert decode_loop.row_buckets(12, batch_invariant=False) == (2, 4, 8, 12)
  assert decode_loop.row_buckets(3, batch_invariant=False) == (2, 3)
  assert decode_loop.row_buckets(2, batch_invariant=False) == (2,)
  assert decode_loop.row_buckets(1, batch_invariant=False) == (1,)
  assert decode_loop.row_buckets(16, batch_invariant=True) == (16,)


def test_select_rows_takes_the_smallest_bucket_live_rows_first():
  rows = [None, _Slot(), None, _Slot(prompt=9, fed=9, generated=(1, 2)), None]
  c = _ahead(rows)
  picked, sub = decode_loop.select_rows(c, (2, 4, 5))
  np.testing.assert_array_equal(picked, [1, 3])
  assert picked.dtype == np.int32 and sub.mask is None and sub.max_steps == c.max_steps
  assert sub.yield_on_stop == c.yield_on_stop is False
  assert decode_loop.select_rows(c._replace(yield_on_stop=True), (2, 4, 5))[1].yield_on_stop
  for full, part in zip((*c.head, *c.sampling, c.forced, *c.tail), (*sub.head, *sub.sampling, sub.forced,
                                                                      *sub.tail), strict=True):
    np.testing.assert_array_equal(part, full[picked])  # every per-row input, stop table included
  rows[0] = rows[4] = _Slot()
  picked, sub = decode_loop.select_rows(_ahead(rows), (2, 4, 5))
  np.testing.assert_array_equal(picked, [0, 1, 3, 4])  # four live rows fill bucket 4
  rows[2] = _Slot()
  picked, sub = decode_loop.select_rows(_ahead(rows), (2, 4, 5))
  np.testing.assert_array_equal(picked, np.arange(5))
  rows = [None, None, _Slot(), None]
  picked, sub = decode_loop.select_rows(_ahead(rows), (2, 4))
  np.testing.assert_array_equal(picked, [2, 0])  # padded with the lowest idle slot, inactive in the call
  np.testing.assert_array_equal(sub.head[1], [True, False])


def test_one_step_inputs():
  rows = [_Slot(), _Slot(), None]
  forced = np.array([-1, 4, -1], np.int32)
  c = decode_loop.one_step(rows, [1], None, forced, 16)
  np.testing.assert_array_equal(c.head[1], [False, True, False])
  np.testing.assert_array_equal(c.head[2], [0, 1, 0])
  assert c.max_steps == 1 and c.forced is forced and c.mask is None


def test_run_ahead_stops_rows_at_prefix_cache_block_ends():
  rows = [_Slot(prompt=20, fed=20, generated=(1,) * 5, max_tokens=50),
          _Slot(prompt=31, fed=31, generated=(1,))]
  budget = _ahead(rows, block=8).head[2]
  np.testing.assert_array_equal(budget, [8 - 24 % 8, 8 - 31 % 8])  # cache_len 24 and 31: 8 and 1


def test_output_processor_free_run():
  from training.tokenizer import default_tokenizer_path, load_tokenizer
  tok = load_tokenizer(default_tokenizer_path("tiny"))
  p = OutputProcessor(tok, thinking=True, thinking_budget=2)
  run = p.free_run()
  assert run.max_tokens == 2 and run.pause_ids == frozenset(tok.special_ids.values())
  p.feed(5)
  p.feed(6)
  assert p.free_run() is None and p.next_constraint() == tok.special_id("/think")
  p.feed(tok.special_id("/think"))
  assert p.free_run().max_tokens >= 1 << 20 and p.free_run().mask is None  # the free answer
  q = OutputProcessor(tok, thinking=False, thinking_budget=None, tool_choice=ToolChoice(mode="none"))
  assert not q.free_run().mask[tok.special_id("tool_call")]  # the ban mask, as next_constraint
  np.testing.assert_array_equal(q.free_run().mask, q.next_constraint())
