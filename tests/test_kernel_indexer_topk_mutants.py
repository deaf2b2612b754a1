"""Indexer top-k kernel body: cases that a mutation audit found unchecked.

Integer-valued inputs make every score exact (ties are frequent); the expected selection is
written out with numpy below: the allowed keys sorted by (higher score, lower key index).
"""

import jax
import numpy as np
import pytest

from pallas_kernels.indexer_topk import ops


def _want(q, w, k, q_pos, q_seg, k_pos, k_seg, topk):
  """Plain numpy: per query, the allowed keys by descending score, ties to the lower index."""
  dots = np.einsum("bthd,bsd->bths", q, k)
  score = np.einsum("bths,bth->bts", np.maximum(dots, 0.0), w)
  ks, kp = k_seg[:, None, :], k_pos[:, None, :]
  ok = (ks == q_seg[:, :, None]) & (ks >= 0) & (kp <= q_pos[:, :, None])
  b, t, s = score.shape
  idx, valid = np.zeros((b, t, topk), np.int32), np.zeros((b, t, topk), bool)
  for i in range(b):
    for j in range(t):
      keys = [x for x in np.lexsort((np.arange(s), -score[i, j])) if ok[i, j, x]][:topk]
      idx[i, j, :len(keys)], valid[i, j, :len(keys)] = keys, True
  return idx, valid


def _data(t, s, seed):
  """One row; keys 0..s-1 in one segment, queries at the last t positions, scores in small integers."""
  rng = np.random.default_rng(seed)
  q = rng.integers(-2, 3, (1, t, 2, 3)).astype(np.float32)
  w = rng.integers(1, 3, (1, t, 2)).astype(np.float32)
  k = rng.integers(-2, 3, (1, s, 3)).astype(np.float32)
  q_pos = np.arange(s - t, s, dtype=np.int32)[None]
  k_pos = np.arange(s, dtype=np.int32)[None]
  return q, w, k, q_pos, np.zeros((1, t), np.int32), k_pos, np.zeros((1, s), np.int32)


@pytest.mark.parametrize("backend,block", [("triton", ops.BlockSizes(4, 32, 16))])
def test_several_key_blocks_of_several_chunks(backend, block):
  """Triton body: 40 keys -> two key blocks of two 16-key chunks; the second block's chunks hold
  keys 32..47 (not 16..31 again), and the running top-k carries across the blocks. The 4 queries
  (positions 36..39) allow every key of block 0, so no masked key forces its merge."""
  args = _data(4, 40, 0)
  topk = 5
  idx, valid = jax.jit(lambda *a: ops.blockwise_topk(*a, topk, 4, 32, block=block, interpret=True,
                                                     backend=backend))(*args)
  want_idx, want_valid = _want(*args, topk)
  assert want_valid.all() and (want_idx >= 32).any() and (want_idx < 32).any(), "uses both key blocks"
  np.testing.assert_array_equal(np.asarray(valid), want_valid)
  np.testing.assert_array_equal(np.asarray(idx), want_idx)
