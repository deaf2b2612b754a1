"""Checks that a packed LM batch is self-consistent (the contract every pipeline's batches keep).

Used by the data tests on training/data.py's grain pipeline and on the other batch sources;
kept apart from the preparing and reading of shards.
"""

from __future__ import annotations

import numpy as np

from training.data_sources import DataError

LM_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


def check_batch(batch: dict[str, np.ndarray], eos_id: int | None = None,
                docs_end_in_row: bool = False) -> None:
  """Raises DataError unless the packed batch is self-consistent.

  Per row: segment ids are 0 (padding) only after the real tokens and the
  loss mask is 0 exactly there; positions are 0 at the row start and wherever
  the segment id changes, else previous + 1; within a segment targets[i] ==
  inputs[i + 1]. With eos_id: eos is never an input and is a target only at
  the last token of a segment; with docs_end_in_row (concat packing) every
  segment that ends inside a row ends by predicting eos.
  """
  missing = [k for k in LM_KEYS if k not in batch]
  if missing:
    raise DataError(f"batch lacks {missing}; an LM batch has {LM_KEYS}.")
  shape = np.shape(batch["inputs"])
  for k in LM_KEYS:
    if np.shape(batch[k]) != shape or len(shape) != 2:
      raise DataError(f"batch[{k!r}] has shape {np.shape(batch[k])}; all must be [batch, seq] = {shape}.")
    # Token ids, positions and segment ids index tables: a float batch (5.7 as a token) is a bug upstream.
    if k != "loss_mask" and not np.issubdtype(np.asarray(batch[k]).dtype, np.integer):
      raise DataError(f"batch[{k!r}] has dtype {np.asarray(batch[k]).dtype}; it must be an integer dtype.")
  for r in range(shape[0]):
    _check_row(r, *(np.asarray(batch[k][r]) for k in LM_KEYS), eos_id, docs_end_in_row)


def _check_row(r, inputs, targets, positions, seg, mask, eos_id, docs_end_in_row) -> None:
  def fail(msg):
    raise DataError(f"batch row {r}: {msg}")

  real = seg > 0
  n = int(real.sum())
  if not real[:n].all():
    fail("padding (segment id 0) appears before real tokens.")
  if not np.array_equal(mask > 0, real):
    fail("loss_mask is not 1 exactly on the real (segment id > 0) tokens.")
  seg, positions = seg[:n], positions[:n]
  starts = np.concatenate([[True], seg[1:] != seg[:-1]])
  expected = np.zeros(n, np.int64)
  for i in range(1, n):
    expected[i] = 0 if starts[i] else expected[i - 1] + 1
  if not np.array_equal(positions, expected):
    fail(f"positions {positions.tolist()} do not restart at 0 exactly at segment starts.")
  same = ~starts[1:]
  if not np.array_equal(targets[:n - 1][same], inputs[1:n][same]):
    fail("a target is not the next input token within its segment.")
  if eos_id is None:
    return
  # Eos as a target in the middle of a segment is eos as the next input (checked above), so this
  # rule covers both.
  if np.any(inputs[:n] == eos_id):
    fail(f"eos ({eos_id}) appears as an input: a document continues past its end.")
  if docs_end_in_row and np.any(targets[:n - 1][~same] != eos_id):
    fail("a segment ends inside the row without predicting eos.")
