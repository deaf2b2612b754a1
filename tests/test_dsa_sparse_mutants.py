"""Mutation-audit tests for Gated DSA's kernels (model/attention/sparse.py and the shared mask of
pallas_kernels/indexer_topk/reference.py): each pins a behaviour the neighbouring tests
(tests/test_dsa_sparse.py) left open, against a reference written out here (a numpy loop or a
plain formula) on random odd-shaped f32 inputs. The layer: tests/test_dsa_mutants.py."""

import numpy as np
import pytest

from model.attention import sparse
from tests.helpers import assert_close


def _numpy_topk_mask(scores, allowed, topk):
  """Per row: the allowed entries ordered by (score descending, position ascending), first topk."""
  out = np.zeros(scores.shape, bool)
  for row in np.ndindex(scores.shape[:-1]):
    cand = np.flatnonzero(allowed[row])
    order = sorted(cand.tolist(), key=lambda j: (-float(scores[row][j]), j))
    out[row][order[:topk]] = True
  return out


@pytest.mark.parametrize("topk", [3, 6])
def test_topk_mask_bisection_lands_on_adjacent_floats(topk):
  """Scores drawn from a few values that include neighbouring floats (int32 order keys one apart),
  so the k-th value is often tied and its key's neighbour is also present: the value bisection must
  end exactly on the k-th key (a floor midpoint or one step short stops one key below it)."""
  rng = np.random.default_rng(topk)
  one_up = np.nextafter(np.float32(1.0), np.float32(2.0))
  pool = np.array([1.0, one_up, np.nextafter(one_up, np.float32(2.0)), np.nextafter(np.float32(1.0), 0),
                   -2.5, np.nextafter(np.float32(-2.5), 0), 0.75, 3.0], np.float32)
  scores = pool[rng.integers(0, len(pool), (512, 11))]
  allowed = rng.random(scores.shape) < 0.85
  got = np.asarray(sparse.topk_mask(scores, allowed, topk))
  np.testing.assert_array_equal(got, _numpy_topk_mask(scores, allowed, topk))


def test_blockwise_topk_ties_across_key_blocks_go_to_lower_positions():
  """Indexer keys repeat (three distinct vectors), so scores tie exactly across key blocks: the
  running top-k keeps lax.top_k's order, the lower key position first, whichever block it is in."""
  rng = np.random.default_rng(7)
  b, t, h, kd, topk = 2, 13, 3, 5, 5
  q = rng.standard_normal((b, t, h, kd)).astype(np.float32)
  w = rng.uniform(0.2, 1.0, (b, t, h)).astype(np.float32)
  pool = rng.standard_normal((3, kd)).astype(np.float32)
  k = pool[rng.integers(0, 3, (b, t))]
  pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  seg = np.zeros((b, t), np.int32)
  idx, valid = sparse.blockwise_topk(q, w, k, pos, seg, pos, seg, topk, 4, 4)
  scores = np.einsum("bth,bths->bts", w.astype(np.float64),
                     np.maximum(np.einsum("bthk,bsk->bths", q.astype(np.float64), k.astype(np.float64)), 0))
  want = _numpy_topk_mask(scores, pos[:, None, :] <= pos[:, :, None], topk)
  got = np.zeros((b, t, t), bool)
  for r, i, j in zip(*np.nonzero(np.asarray(valid)), strict=True):
    got[r, i, int(idx[r, i, j])] = True
  np.testing.assert_array_equal(got, want)


def test_indexer_kl_ignores_huge_masked_logits():
  """Masked logits far above the allowed ones (future keys' indexer scores) must not enter the
  softmax's max shift: exp(allowed - 300) would underflow to 0 in f32. Reference: float64 KL."""
  rng = np.random.default_rng(11)
  b, t, n = 2, 3, 9
  mask = rng.random((b, t, n)) < 0.6
  mask[..., 0] = True
  logits = rng.standard_normal((b, t, n)).astype(np.float32)
  logits[~mask] += 300.0
  p = np.where(mask, rng.uniform(0.1, 1.0, (b, t, n)), 0.0)
  p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
  want = 0.0
  for i, j in np.ndindex(b, t):
    z, pm = logits[i, j][mask[i, j]].astype(np.float64), p[i, j][mask[i, j]].astype(np.float64)
    logq = z - z.max() - np.log(np.exp(z - z.max()).sum())
    want += np.sum(pm * (np.log(pm) - logq)) / (b * t)
  assert_close(sparse.indexer_kl(p, logits, mask), want, what="indexer kl")


def test_blockwise_topk_negative_segments_select_nothing():
  """Negative segment ids (padding) attend to nothing and are never attended to, even by each
  other: a padded query gets no valid slot, and no real query selects a padded key."""
  rng = np.random.default_rng(12)
  b, t, h, kd = 1, 11, 2, 3
  q = rng.standard_normal((b, t, h, kd)).astype(np.float32)
  w = rng.uniform(0.5, 1.0, (b, t, h)).astype(np.float32)
  k = rng.standard_normal((b, t, kd)).astype(np.float32)
  pos = np.arange(t, dtype=np.int32)[None]
  seg = np.array([[0, 0, 0, 0, -1, -1, 1, 1, 1, -1, -1]], np.int32)
  idx, valid = sparse.blockwise_topk(q, w, k, pos, seg, pos, seg, 4, 4, 4)
  idx, valid = np.asarray(idx), np.asarray(valid)
  np.testing.assert_array_equal(valid.sum(-1), [[1, 2, 3, 4, 0, 0, 1, 2, 3, 0, 0]])
  for i in range(t):
    for j in idx[0, i][valid[0, i]]:
      assert seg[0, j] == seg[0, i] >= 0 and j <= i, (i, j)


def test_topk_mask_takes_numpy_ints_and_refuses_bools():
  """A top-k read from a NumPy config (np.int64) is a count; True is not (it kept one entry per row)."""
  rng = np.random.default_rng(5)
  scores = rng.standard_normal((3, 7)).astype(np.float32)
  allowed = rng.random(scores.shape) < 0.8
  got = np.asarray(sparse.topk_mask(scores, allowed, np.int64(2)))
  np.testing.assert_array_equal(got, _numpy_topk_mask(scores, allowed, 2))
  for bad in (True, 2.0, 0):
    with pytest.raises(ValueError, match=r"topk_mask: topk=.* must be an int >= 1"):
      sparse.topk_mask(scores, allowed, bad)
