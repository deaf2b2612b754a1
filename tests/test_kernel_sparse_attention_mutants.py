"""Sparse-attention kernel bodies: cases that a mutation audit found unchecked.

The Triton body is called directly (the custom_vjp of ops._attention_fn for forward and
gradients, kernel.probs) on tiny odd shapes in interpret mode, against a plain gather +
softmax written out below. The existing cases use one Triton slot block (J >= 16) and no
head block mixing real and padded heads; here the slots come in blocks of 2, laid out by
hand: a query whose first slot block is all invalid, a valid key 0 next to an invalid slot,
and an unselected NaN key row.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_attention import kernel, ops
from tests.helpers import assert_close

SCALE = 0.61
B, H, C, P, S = 1, 3, 5, 3, 8


def _ref(ql, qr, lat, kr, sel):
  """Plain per-slot attention: out [b, t, h, c] and lse [b, t, h] (-inf / zeros for no valid slot)."""
  rows = jnp.maximum(sel, 0)
  g_lat = jnp.stack([lat[i][rows[i]] for i in range(sel.shape[0])])  # [b, t, j, c]
  g_kr = jnp.stack([kr[i][rows[i]] for i in range(sel.shape[0])])
  logits = (jnp.einsum("bthc,btjc->bthj", ql, g_lat) + jnp.einsum("bthp,btjp->bthj", qr, g_kr)) * SCALE
  ok = (sel >= 0)[:, :, None, :]
  m = jnp.max(jnp.where(ok, logits, -jnp.inf), axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(ok, jnp.exp(logits - m), 0.0)
  tot = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(tot > 0, tot, 1.0)
  tot, m = tot[..., 0], m[..., 0]
  lse = jnp.where(tot > 0, m + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
  return jnp.einsum("bthj,btjc->bthc", p, g_lat), lse, p


def _inputs(t, seed):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return f(B, t, H, C), f(B, t, H, P), f(B, S, C), f(B, S, P)


def _geo(t, slots, block_q, block_k, backend="triton", interpret=True, heads=H, block_h=H):
  return kernel.Geometry(batch=B, queries=t, keys=S, heads=heads, real_heads=H, latent=C, rope=P,
                         slots=slots, block_q=block_q, block_k=block_k, block_h=block_h, scale=SCALE,
                         backend=backend, interpret=interpret)


# Per query, 4 slots in two blocks of 2 (-1 = invalid):
#   q0: first block all invalid, the second valid (online softmax starts from an empty block);
#   q1: key 0 valid next to an invalid slot in the same block (key 0 must count, its gradient
#       must survive the invalid slot's scatter);
#   q2: valid slots in both blocks (the running max / sum are rescaled);
#   q3: no valid slot at all.
SEL = np.array([[[-1, -1, 3, 5], [0, -1, 6, 2], [4, 1, 6, 0], [-1, -1, -1, -1]]], np.int32)


def _loss(fn, weights, *a):
  out, lse = fn(*a)
  lse = lse[..., 0] if lse.ndim == 4 else lse
  return jnp.sum(out * weights[0]) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * weights[1], 0.0))


def _pad_head(x):
  return jnp.pad(x, ((0, 0), (0, 0), (0, 1), (0, 0)))


@functools.cache
def _triton_results():
  """One jit: forward, probs and the custom_vjp's backward on the SEL layout: tiles of 2 queries,
  blocks of 2 slots, heads padded 3 -> 4 (q = 0) in two blocks of 2 (the second: real head 2 and
  the padded head)."""
  ql, qr, lat, kr = _inputs(4, 0)
  # Key 7 is never selected: a NaN there (an unwritten cache row) must not reach any output.
  args = (ql, qr, lat.at[0, S - 1].set(jnp.nan), kr.at[0, S - 1].set(jnp.nan))
  sel = jnp.asarray(SEL)
  geo = _geo(4, 4, 2, 2, heads=4, block_h=2)
  mask = sel.reshape(B, 4, 2, 1, 2)
  rng = np.random.default_rng(9)
  weights = (jnp.asarray(rng.standard_normal((B, 4, H, C)), jnp.float32),
             jnp.asarray(rng.standard_normal((B, 4, H)), jnp.float32))
  attn = ops._attention_fn(geo, 2)

  @jax.jit
  def run(ql, qr, lat, kr):
    (out, lse), pull = jax.vjp(lambda *x: attn(*x, sel, mask), _pad_head(ql), _pad_head(qr), lat, kr)
    probs = kernel.probs(geo, _pad_head(ql), _pad_head(qr), lat, kr, sel, mask, lse)
    w_lse = jnp.pad(weights[1], ((0, 0), (0, 0), (0, 1)))[..., None]
    dql, dqr, dlat, dkr = pull((_pad_head(weights[0]), jnp.where(jnp.isfinite(lse), w_lse, 0.0)))
    return (out[:, :, :H], lse[:, :, :H], probs), (dql[:, :, :H], dqr[:, :, :H], dlat, dkr)

  outs, got = run(*args)
  ref = lambda *a: _ref(*a, sel)[:2]
  want = jax.jit(jax.grad(lambda *a: _loss(ref, weights, *a), argnums=(0, 1, 2, 3)))(*args)
  return args, outs, got, want


def test_forward_out_and_lse_per_slot_layout():
  """Empty first block, key 0 beside an invalid slot, two rescaled blocks, an empty row."""
  args, (out, lse, _), _, _ = _triton_results()
  want_out, want_lse, _ = _ref(*args, jnp.asarray(SEL))
  assert_close(out, want_out, what="out")
  assert_close(lse[..., 0][:, :3], want_lse[:, :3], what="lse")
  assert np.all(np.asarray(lse[0, 3]) == -np.inf), "a row without a valid slot has lse -inf"
  assert np.all(np.asarray(out[0, 3]) == 0.0)


def test_probs_per_head_block_exclude_the_padded_head():
  """probs [b, nH, Tp, nJ, 1, J]: per head block, the sum of p over its real heads / real heads."""
  args, (_, _, probs), _, _ = _triton_results()
  _, _, p = _ref(*args, jnp.asarray(SEL))  # [b, t, h, j]
  assert probs.shape == (B, 2, 4, 2, 1, 2)
  assert_close(probs[:, 0].reshape(B, 4, 4), jnp.sum(p[:, :, :2], axis=2) / H, what="head block 0")
  assert_close(probs[:, 1].reshape(B, 4, 4), p[:, :, 2] / H, what="head block 1")


def test_gradients_per_slot_layout():
  """All four gradients (out and lse cotangents) against autodiff of the plain reference."""
  _, _, got, want = _triton_results()
  for name, g, w in zip(("dq_lat", "dq_rope", "dlatent", "dk_rope"), got, want, strict=True):
    assert_close(g, w, what=name)
  assert float(jnp.abs(want[2][0, 0]).max()) > 0, "key 0 is selected (by q1, q2), so it has a gradient"
  assert np.all(np.asarray(got[2][0, S - 1]) == 0) and np.all(np.asarray(got[3][0, S - 1]) == 0)
