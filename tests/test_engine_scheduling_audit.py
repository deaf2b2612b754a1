"""serving/engine.py admission: what one request carries must not fail the step the others run in.

Uses the session's started engine (tests/conftest.py: tiny, 4 slots, the loop thread running).
"""

import numpy as np

from serving.engine import Request
from serving.types import SamplingParams

BOS = 317  # tiny's <|bos|>: the random model (almost) never samples it, so requests run to max_tokens


def _prompt(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def _collect(handle):
  ids, last = [], None
  for ev in handle.events(timeout=60):  # raises queue.Empty if the final event never comes
    ids += ev.token_ids
    last = ev
  return ids, last.finish_reason, last.usage.completion_tokens


def test_numpy_seed_and_stop_ids_run_as_python_ints_beside_other_requests(engine):
  """Validation accepts a numpy seed (int or np.integer) and stop ids as any sequence of ints, but
  admission computed `seed % 2**64` (OverflowError for np.int64) and `stop_token_ids or default`
  (ValueError for an id array) after taking the request off the queue: the step failed, every running
  request ended with 'error', and the request itself never got a final event (a consumer waited
  forever; `generate` on the caller's thread looped forever)."""
  prompt = _prompt(11, 1)
  free = engine.generate(Request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=5,
                                                        stop_token_ids=[BOS])))
  assert free[1] == "length" and len(free[0]) == 12
  stop = free[0][6]
  cut = free[0].index(stop) + 1
  big_seed = 2**63 + 7
  big = engine.generate(Request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=big_seed,
                                                       stop_token_ids=[BOS])))
  assert big[0] != free[0]
  bystander = engine.submit(Request(_prompt(9, 2), SamplingParams(max_tokens=40, temperature=0.0,
                                                                  stop_token_ids=[BOS])))
  handles = [
      engine.submit(Request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=np.int64(5),
                                                   stop_token_ids=np.array([BOS], np.int64)))),
      engine.submit(Request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=np.uint64(big_seed),
                                                   stop_token_ids=(np.int32(BOS),)))),
      engine.submit(Request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=np.int32(5),
                                                   stop_token_ids=np.array([stop, BOS])))),
  ]
  got = [_collect(h) for h in handles]
  assert got[0] == (free[0], "length", 12)
  assert got[1] == (big[0], "length", 12)
  assert got[2] == (free[0][:cut], "stop", cut)  # the array's ids stop the request
  ids, reason, n = _collect(bystander)
  assert (reason, n, len(ids)) == ("length", 40, 40)


class _BadFreeRun:
  """A free processor (no constraint, no finish) whose free_run() breaks FreeRun's contract."""

  def __init__(self, run):
    self.run, self.fed = run, []

  def next_constraint(self):
    return None

  def feed(self, token_id):
    self.fed.append(token_id)
    return [], None

  def close(self, reason):
    return []

  def free_run(self):
    return self.run


def test_a_broken_free_run_falls_back_to_one_step_and_spares_the_other_rows(engine):
  """serving/batch.constraints fails only its row when a processor's constraint is invalid, but
  decode_loop.run_ahead wrote a FreeRun mask longer than the vocabulary into its [S, V] table (and
  unioned pause_ids with the stop ids) unchecked: the step raised and every running request ended
  with 'error'. Now such a row decodes one step per call under next_constraint."""
  from serving.types import FreeRun
  v = engine.vocab_size
  greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=[BOS])  # noqa: E731
  prompts = [_prompt(7 + 3 * k, 20 + k) for k in range(4)]
  want = [engine.generate(Request(p, greedy(24)))[0] for p in prompts]
  runs = [FreeRun(np.ones(v + 3, bool), frozenset(), 50),  # longer than the vocabulary
          FreeRun(np.zeros(v, bool), frozenset(), 50),  # allows nothing
          FreeRun(None, None, 50)]  # pause_ids not a set of ids
  procs = [_BadFreeRun(r) for r in runs]
  handles = [engine.submit(Request(p, greedy(24), processor=q))
             for p, q in zip(prompts[:3], procs, strict=True)]
  handles.append(engine.submit(Request(prompts[3], greedy(24))))  # a bystander without a processor
  for k, h in enumerate(handles):
    ids, reason, n = _collect(h)
    assert (ids, reason, n) == (want[k], "length", 24), k
  assert all(q.fed == w for q, w in zip(procs, want[:3], strict=True))
