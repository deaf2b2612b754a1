"""serving.sampling edge cases that mutation testing found unchecked (references written out)."""

import jax
import numpy as np

from serving.sampling import sample_row

# logits, temperature, top_k, top_p, mask, forced, seed_lo, seed_hi, n_generated
_row = jax.jit(sample_row)


def _args(logits, *, temperature=0.0, top_k=0, top_p=1.0, mask=None, forced=-1, n=0):
  mask = np.ones(len(logits), bool) if mask is None else mask
  return (np.asarray(logits, np.float32), np.float32(temperature), np.int32(top_k), np.float32(top_p),
          mask, np.int32(forced), np.uint32(7), np.uint32(0), np.uint32(n))


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_greedy_is_the_best_allowed_token():
  """Temperature 0 with a mask: the argmax over the allowed tokens, not over all logits."""
  logits = np.random.default_rng(11).normal(size=13).astype(np.float32)
  best = int(np.argmax(logits))
  mask = np.ones(13, bool)
  mask[best] = False
  want = int(np.argmax(np.where(mask, logits, -np.inf)))
  token, lp = _row(*_args(logits, mask=mask))
  assert int(token) == want != best
  np.testing.assert_allclose(float(lp), _log_softmax(logits)[want], rtol=1e-5)


def test_forced_token_zero_is_forced():
  """forced >= 0 bypasses sampling; id 0 is a real token (forced -1 means none)."""
  logits = np.random.default_rng(12).normal(size=9).astype(np.float32)
  logits[0] = -8.0  # never the greedy choice
  for temperature in (0.0, 0.9):
    token, lp = _row(*_args(logits, temperature=temperature, forced=0))
    assert int(token) == 0
    np.testing.assert_allclose(float(lp), _log_softmax(logits)[0], rtol=1e-5)


def test_sample_rows_takes_each_row_from_its_own_logits():
  """Rows flagged from_prefill sample the prefill logits, the others the decode logits (greedy)."""
  from serving.sampling import sample_rows
  rng = np.random.default_rng(13)
  S, V = 5, 17
  prefill = rng.normal(size=(S, V)).astype(np.float32)
  decode = rng.normal(size=(S, V)).astype(np.float32)
  decode[np.arange(S), np.argmax(prefill, 1)] = -9.0  # the two argmaxes differ in every row
  from_prefill = np.array([True, False, False, True, False])
  tokens, lps = jax.jit(sample_rows)(
      prefill, decode, from_prefill, np.zeros(S, np.float32), np.zeros(S, np.int32), np.ones(S, np.float32),
      np.ones((S, V), bool), np.full(S, -1, np.int32), np.arange(S, dtype=np.uint32), np.zeros(S, np.uint32),
      np.zeros(S, np.uint32))
  src = np.where(from_prefill[:, None], prefill, decode)
  assert np.asarray(tokens).tolist() == np.argmax(src, 1).tolist()
  want = [_log_softmax(src[i])[np.argmax(src[i])] for i in range(S)]
  np.testing.assert_allclose(np.asarray(lps), want, rtol=1e-5)
