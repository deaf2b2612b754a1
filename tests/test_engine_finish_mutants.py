"""serving/engine.py finish reasons, usage and seeds at their edges (a mutation audit's survivors).

Uses the session's started engine (tests/conftest.py: tiny, 4 slots, context 256, the loop thread
running). Each expected result is an earlier run of the same request without the edge (greedy, or the
same seed), cut where the edge puts it.
"""

from serving.engine import Request
from serving.types import SamplingParams
from tests.test_engine_scheduling_audit import BOS, _prompt


def _collect(handle):
  ids, last = [], None
  for ev in handle.events(timeout=60):  # raises queue.Empty if the final event never comes
    ids += ev.token_ids
    last = ev
  return ids, last.finish_reason, last.usage


def _run(engine, prompt, max_tokens, stop=(BOS,), **kw):
  kw.setdefault("temperature", 0.0)
  params = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop), **kw)
  return _collect(engine.submit(Request(prompt, params)))


def _first_seen_late(ids):
  """The last position k whose token does not occur before it (a stop id there cuts at k + 1)."""
  return next(k for k in range(len(ids) - 1, 0, -1) if ids[k] not in ids[:k])


def test_a_stop_id_on_the_last_allowed_token_finishes_with_stop(engine):
  """The token that reaches max_tokens (or fills the context) is also a stop id: 'stop', not 'length'."""
  prompt = _prompt(9, 3)
  free, reason, usage = _run(engine, prompt, 16)
  assert reason == "length" and len(free) == 16 and usage.completion_tokens == 16
  k = _first_seen_late(free)
  ids, reason, usage = _run(engine, prompt, k + 1, stop=(free[k],))
  assert (ids, reason) == (free[:k + 1], "stop")
  assert (usage.prompt_tokens, usage.completion_tokens) == (9, k + 1)
  # At the context limit: prompt + max_tokens = 256 exactly.
  long = _prompt(256 - 6, 4)
  free, reason, usage = _run(engine, long, 6)
  assert reason == "length" and len(free) == 6 and (usage.prompt_tokens, usage.completion_tokens) == (250, 6)
  k = _first_seen_late(free)
  ids, reason, usage = _run(engine, long, 6, stop=(free[k],))
  assert (ids, reason, usage.completion_tokens) == (free[:k + 1], "stop", k + 1)


def test_seeds_are_taken_modulo_2_64(engine):
  """A seed is any int; the engine keys sampling by seed mod 2**64 (64 bits: both words differ)."""
  prompt = _prompt(8, 5)
  base = _run(engine, prompt, 10, temperature=1.0, seed=5)[0]
  assert len(base) == 10
  assert _run(engine, prompt, 10, temperature=1.0, seed=2**64 + 5)[0] == base
  assert _run(engine, prompt, 10, temperature=1.0, seed=2**63 + 5)[0] != base
  assert _run(engine, prompt, 10, temperature=1.0, seed=2**32 + 5)[0] != base


def test_requests_without_stop_ids_stop_at_the_engine_defaults(engine):
  """No stop_token_ids: the tokenizer's eos and end_of_turn (Engine.default_stop_ids) stop a request;
  given stop ids replace them."""
  prompt = _prompt(12, 6)
  free = _run(engine, prompt, 12)[0]
  k = _first_seen_late(free)
  keep = engine.default_stop_ids
  engine.default_stop_ids = (free[k],)  # read at admission
  try:
    ids, reason, usage = _run(engine, prompt, 12, stop=())
    replaced = _run(engine, prompt, 12, stop=(BOS,))
  finally:
    engine.default_stop_ids = keep
  assert (ids, reason, usage.completion_tokens) == (free[:k + 1], "stop", k + 1)
  assert replaced[:2] == (free, "length")


def test_a_prefix_written_by_one_request_serves_another_with_the_same_tokens(engine):
  """Two prompts share their first 40 tokens: after the first ran, the second loads 2 blocks of 16
  (usage.cached_tokens 32, the prefix cache's block; prefill chunk 32) and generates what it generates
  cold. The prefill must count its tokens in the row's length, or blocks are cached at the wrong
  tokens (and their states serve other prompts)."""
  shared = _prompt(40, 7)
  other, mine = shared + _prompt(9, 8), shared + _prompt(11, 9)
  engine.prefix.clear()  # the session's engine: nothing of these prompts is cached before
  cold, reason, usage = _run(engine, mine, 12)
  assert reason == "length" and usage.cached_tokens == 0
  engine.prefix.clear()
  assert _run(engine, other, 12)[2].cached_tokens == 0
  ids, reason, usage = _run(engine, mine, 12)
  assert (ids, reason) == (cold, "length")
  assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (51, 12, 32)


def test_stop_cancels_running_and_waiting_requests_and_frees_their_slots(engine):
  """Engine.stop: every request still waiting or running ends with 'cancelled' (usage: the tokens it
  got); the engine is then idle, and requests in the freed slots generate what they generate alone."""
  prompts = [_prompt(6 + j, 40 + j) for j in range(5)]
  alone = [_run(engine, p, 8)[0] for p in prompts[:2]]
  engine.stop()  # the loop thread ends; this thread drives the engine
  try:
    handles = [engine.submit(Request(p, SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[BOS])))
               for p in prompts]  # 4 slots: the fifth waits
    engine.step()  # admit 4 and prefill: each has its first token
    engine.stop()
    got = [_collect(h) for h in handles]
    assert [reason for _, reason, _ in got] == ["cancelled"] * 5
    assert [len(ids) for ids, _, _ in got] == [1, 1, 1, 1, 0]
    assert [u.completion_tokens for _, _, u in got] == [1, 1, 1, 1, 0]
    assert [u.prompt_tokens for _, _, u in got] == [6, 7, 8, 9, 10]
    again = [engine.generate(Request(p, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[BOS])))
             for p in prompts[:2]]
    assert [(ids, reason) for ids, reason, _ in again] == [(a, "length") for a in alone]
  finally:
    engine.start()
