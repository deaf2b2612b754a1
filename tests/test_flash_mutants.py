"""model/attention/flash.py against softmax(Q K^T) V and its gradients written out here in float64 numpy
(tests/test_flash.py compares with the module's own dense helper), plus the argument checks a
mutation audit and probing found unpinned: block sizes that are numpy ints (accepted), bools, floats
and zero (refused), an empty sequence (refused, not a ZeroDivisionError), and a row whose every
logit is far below zero (the running max must start at -inf, not 0, or exp underflows to 0 / 0).

One shape, one compile: t=11 in query blocks of 4 (the last one padded) and key blocks of 3."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.attention.flash import flash_mqa_attention
from tests.helpers import assert_close

B, T, H, C, P = 2, 11, 2, 3, 2
SCALE = 0.7


def _reference(q_lat, q_rope, latent, k_rope, cot):
  """Causal softmax attention and the gradients of sum(out * cot), by hand, in float64."""
  logits = SCALE * (np.einsum("bthc,bsc->bths", q_lat, latent) + np.einsum("bthp,bsp->bths", q_rope, k_rope))
  causal = np.arange(T)[None, :] <= np.arange(T)[:, None]  # [t, s]: key s at or before query t
  logits = np.where(causal[None, :, None, :], logits, -np.inf)
  p = np.exp(logits - logits.max(axis=-1, keepdims=True))
  p /= p.sum(axis=-1, keepdims=True)
  out = np.einsum("bths,bsc->bthc", p, latent)
  dp = np.einsum("bthc,bsc->bths", cot, latent)
  ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * SCALE  # d loss / d logits (pre-scale)
  grads = (np.einsum("bths,bsc->bthc", ds, latent), np.einsum("bths,bsp->bthp", ds, k_rope),
           np.einsum("bths,bthc->bsc", ds, q_lat) + np.einsum("bths,bthc->bsc", p, cot),
           np.einsum("bths,bthp->bsp", ds, q_rope))
  return out, grads


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(11)
  q_lat, q_rope = rng.standard_normal((B, T, H, C)), rng.standard_normal((B, T, H, P))
  latent, k_rope = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, P))
  # Batch 1, query 0 sees key 0 alone, with logits near -300 on both heads: its output is key 0's
  # latent, and a running max started at 0 gives exp(-300) = 0 in f32 and 0 / 0.
  q_lat[1, 0] = -215.0 * latent[1, 0] / np.sum(latent[1, 0] ** 2)
  q_rope[1, 0] = -215.0 * k_rope[1, 0] / np.sum(k_rope[1, 0] ** 2)
  cot = rng.standard_normal((B, T, H, C))
  args = tuple(np.asarray(a, np.float32).astype(np.float64) for a in (q_lat, q_rope, latent, k_rope))
  # Block sizes as numpy ints (a sweep over np.arange): accepted like Python ints.
  qb, kb = np.int64(4), np.int64(3)

  def loss(*a):
    out = flash_mqa_attention(*a, SCALE, qb, kb)
    return jnp.sum(out * jnp.asarray(cot, jnp.float32)), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      *(jnp.asarray(a, jnp.float32) for a in args))
  return np.asarray(out), [np.asarray(g) for g in grads], _reference(*args, cot), args


def test_forward_is_causal_softmax_attention(case):
  out, _, (want, _), args = case
  assert out.dtype == np.float32
  assert_close(out, want, what="out_lat")
  np.testing.assert_allclose(out[1, 0], np.broadcast_to(args[2][1, 0], (H, C)), rtol=1e-6)


@pytest.mark.parametrize("i,name", list(enumerate(["q_lat", "q_rope", "latent", "k_rope"])))
def test_gradients_match_the_written_out_backward(case, i, name):
  _, grads, (_, want), _ = case
  assert_close(grads[i], want[i], what=f"grad {name}")


def _args(t):
  z = jnp.zeros
  return z((1, t, H, C)), z((1, t, H, P)), z((1, t, C)), z((1, t, P))


@pytest.mark.parametrize("query_block,key_block,bad", [
    (True, 4, "query_block=True"), (4, False, "key_block=False"), (4.0, 4, "query_block=4.0"),
    (0, 4, "query_block=0"), (np.int32(-2), 4, "query_block=np.int32(-2)")])
def test_block_sizes_that_are_not_positive_ints_are_refused(query_block, key_block, bad):
  """True reached jnp.arange as a bool (a TypeError from iota); 4.0 reached range arithmetic."""
  with pytest.raises(ValueError, match=re.escape(f"flash_mqa_attention: {bad} must be a positive int.")):
    flash_mqa_attention(*_args(5), 1.0, query_block, key_block)


def test_an_empty_sequence_is_refused_by_name():
  """t=0 divided by a zero block size (ZeroDivisionError) before."""
  with pytest.raises(ValueError, match=r"flash_mqa_attention: t=0: needs at least one query"):
    flash_mqa_attention(*_args(0), 1.0, 4, 4)
