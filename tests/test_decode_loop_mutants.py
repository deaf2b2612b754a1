"""serving/decode_loop.py host-side inputs, at the edges a mutation audit found untested: what run_ahead
puts in a call's stop table, which FreeRun masks it takes, and when a call yields to a waiting request.

Host-only (no engine, no compile): fake rows as in tests/test_decode_loop.py.
"""

import types

import numpy as np

from serving import decode_loop
from serving.types import FreeRun, SamplingParams

V, CONTEXT = 16, 64


class _Slot:
  """A decoding row: prompt fed, one token generated and pending."""

  def __init__(self, stop_ids=frozenset({2}), processor=None):
    self.prompt, self.fed, self.pending = np.zeros(4, np.int32), 4, 5
    self.generated, self.routing, self.seed, self.stop_ids = [1], None, 7, frozenset(stop_ids)
    self.processor, self.cache_len = processor, 4
    self.params = SamplingParams(max_tokens=10, temperature=0.0)


class _Proc:
  def __init__(self, run):
    self.run = run

  def free_run(self):
    return self.run


def _ahead(rows, waiting=0):
  return decode_loop.run_ahead(rows, waiting, None, CONTEXT, V, 8)


def test_stop_id_zero_is_in_the_stop_table():
  """Id 0 is a valid stop id (validation takes ids in [0, V)): the device must stop the row there."""
  c = _ahead([_Slot(stop_ids={0, 15})])
  stop = c.head[3]
  assert np.flatnonzero(stop[0]).tolist() == [0, 15]


def test_a_run_yields_when_one_request_waits_and_every_slot_is_busy():
  """One waiting request is enough: the call must end at the first row that stops, so the freed slot
  is taken at the same token as with one step per call."""
  c = _ahead([_Slot(), _Slot()], waiting=1)
  assert c is not None and c.yield_on_stop and c.max_steps == 8
  assert not _ahead([_Slot(), _Slot()], waiting=0).yield_on_stop


def test_free_run_masks_of_exactly_the_vocabulary_run_ahead():
  """A mask of V entries (the whole vocabulary) is valid; only longer ones or ones allowing nothing
  fall back to one step per call."""
  full = np.zeros(V, bool)
  full[[3, V - 1]] = True
  c = _ahead([_Slot(processor=_Proc(FreeRun(full, frozenset(), 4)))])
  assert c is not None
  assert np.flatnonzero(c.mask[0]).tolist() == [3, V - 1]
  assert c.head[2].tolist() == [4]  # the free run's 4 < max_tokens 10 - 1 generated
  assert _ahead([_Slot(processor=_Proc(FreeRun(np.zeros(V, bool), frozenset(), 4)))]) is None
  assert _ahead([_Slot(processor=_Proc(FreeRun(np.ones(V + 1, bool), frozenset(), 4)))]) is None


def test_row_budget_at_the_context_limit():
  # min(max_tokens - generated, context - prompt - generated), never below 0
  assert decode_loop.row_budget(10, 3, 50, 64) == 7
  assert decode_loop.row_budget(10, 3, 55, 64) == 64 - 55 - 3
  assert decode_loop.row_budget(10, 4, 60, 64) == 0
  assert decode_loop.row_budget(10, 10, 4, 64) == 0


class _Constraint:
  def __init__(self, c):
    self.c = c

  def next_constraint(self):
    return self.c


def test_constraints_fail_only_rows_whose_constraint_is_outside_the_vocabulary():
  """serving/batch.constraints: a forced id must be in [0, V); V itself fails its row, V - 1 and 0 are
  forced; a mask shorter than V is padded with False."""
  from serving import batch

  class Row:
    def __init__(self, c):
      self.processor, self.handle = _Constraint(c), types.SimpleNamespace(id="r")
  short = np.zeros(4, bool)
  short[2] = True
  rows = [Row(V), Row(V - 1), Row(0), Row(-1), Row(short), Row(None)]
  forced, masks, failed = batch.constraints(rows, range(len(rows)), V)
  assert failed == [0, 3]
  assert forced.tolist() == [-1, V - 1, 0, -1, -1, -1]
  assert np.flatnonzero(masks[4]).tolist() == [2] and masks[5].all()
