"""Tests for model/attention/flash.py: blockwise causal MQA against the plain dense definition.

Random odd-shaped f32 inputs, forward and every gradient, several block layouts
(blocks that do not divide t, key blocks larger and smaller than query blocks).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from model.attention.flash import causal_reference, flash_mqa_attention
from tests.helpers import assert_close


def _inputs(seed, b, t, h, c, p):
  rng = np.random.default_rng(seed)
  shapes = ((b, t, h, c), (b, t, h, p), (b, t, c), (b, t, p))
  return tuple(jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes)


@pytest.mark.parametrize("b,t,h,c,p,qb,kb", [
    (2, 37, 3, 7, 5, 8, 16), (1, 37, 3, 7, 5, 16, 8), (2, 23, 5, 11, 3, 5, 7),
    (1, 19, 2, 13, 4, 64, 64), (1, 29, 3, 5, 2, 29, 3)])
def test_flash_matches_dense(b, t, h, c, p, qb, kb):
  args = _inputs(t * 7 + qb, b, t, h, c, p)
  scale = 0.41
  cot = jnp.asarray(np.random.default_rng(1).standard_normal((b, t, h, c), np.float32))

  def run(f):
    loss = lambda *a: (jnp.sum(f(*a) * cot), f(*a))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)

  (_, out), grads = run(lambda *a: flash_mqa_attention(*a, scale, qb, kb))
  (_, out_r), grads_r = run(lambda *a: causal_reference(*a, scale))
  assert_close(out, out_r, what="out_lat")
  for name, a, e in zip(("q_lat", "q_rope", "latent", "k_rope"), grads, grads_r, strict=True):
    assert_close(a, e, what=f"grad {name}")


def test_flash_check_grads():
  args = _inputs(3, 1, 7, 2, 3, 2)
  f = lambda *a: flash_mqa_attention(*a, 0.5, 3, 2)
  check_grads(jax.jit(f), args, order=1, modes=["rev"], eps=1e-3)


def test_flash_bad_inputs():
  ql, qr, lat, kr = _inputs(4, 1, 6, 2, 3, 2)
  with pytest.raises(ValueError, match="as many keys as queries"):
    flash_mqa_attention(ql, qr, lat[:, :5], kr[:, :5], 1.0, 2, 2)
  with pytest.raises(ValueError, match="key_block"):
    flash_mqa_attention(ql, qr, lat, kr, 1.0, 2, 0)
  with pytest.raises(ValueError, match="k_rope"):
    flash_mqa_attention(ql, qr, lat, kr[..., :1], 1.0, 2, 2)
