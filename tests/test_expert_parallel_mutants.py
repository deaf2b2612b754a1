"""sharding/expert_parallel.py: the capacity and ragged exchanges against a plain reference written out
here (every expert on every token, masked by the routing and by a hand-counted capacity drop loop),
forward and gradients, odd token counts (padded shards) and tensor-parallel FFN widths; 8 fake CPU
devices from conftest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.moe_experts import dropless_experts
from sharding import expert_parallel as ep_lib
from sharding import mesh as mesh_lib
from tests.helpers import assert_close


def _swiglu(x, wg, wu, wd):
  g = jnp.dot(x, wg, precision="highest")
  return jnp.dot(jax.nn.silu(g) * jnp.dot(x, wu, precision="highest"), wd, precision="highest")


def _plain(x, idx, w, wg, wu, wd):
  y = jnp.zeros(x.shape, jnp.float32)
  for ex in range(wg.shape[0]):
    y = y + jnp.sum(jnp.where(idx == ex, w, 0.0), axis=1)[:, None] * _swiglu(x, wg[ex], wu[ex], wd[ex])
  return y


def _kept(idx, shards, ep, e_local, cap):
  """Tokens padded to a multiple of `shards`, split in contiguous chunks; per chunk and destination
  shard the first `cap` assignments in (token, slot) order are kept, the rest dropped."""
  idx = np.asarray(idx)
  t, k = idx.shape
  per = -(-t // shards)
  keep = np.zeros(idx.shape, bool)
  for s in range(shards):
    seen = [0] * ep
    for tok in range(s * per, min((s + 1) * per, t)):
      for j in range(k):
        dest = idx[tok, j] // e_local
        keep[tok, j] = seen[dest] < cap
        seen[dest] += 1
  return keep


def _inputs(seed, t, e, k, d, f):
  rng = np.random.default_rng(seed)
  r = lambda *s, scale=1.0: jnp.asarray(scale * rng.standard_normal(s), jnp.float32)  # noqa: E731
  x = r(t, d)
  wg, wu, wd = r(e, d, f, scale=d ** -0.5), r(e, d, f, scale=d ** -0.5), r(e, f, d, scale=f ** -0.5)
  idx = jnp.asarray([rng.permutation(e)[:k] for _ in range(t)], jnp.int32).reshape(t, k)
  w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
  return x, idx, w, wg, wu, wd, rng


def _local(x, ids, w, w_gate, w_up, w_down):
  return dropless_experts(x, ids, w, w_gate, w_up, w_down, jnp.float32, impl="grouped", block=2)


def _run(mesh_shape, exchange, factor, args, cot):
  """(y, dropped, grads of <y, cot> wrt x, w, w_gate, w_up, w_down) over the mesh."""
  x, idx, w, wg, wu, wd = args

  def fn(x, w, wg, wu, wd):
    return ep_lib.expert_parallel_experts(x, idx, w, wg, wu, wd, local_experts=_local, exchange=exchange,
                                          capacity_factor=factor)

  def loss(*a):
    y, _ = fn(*a)
    return jnp.sum(y * cot)

  mesh = mesh_lib.make_mesh(dict(zip(mesh_lib.MESH_AXES, mesh_shape, strict=True)))
  with mesh_lib.activate(mesh):
    y, dropped = jax.jit(fn)(x, w, wg, wu, wd)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, w, wg, wu, wd)
  return jax.device_get(y), float(dropped), jax.device_get(grads)


def _check(y, grads, args, w_ref, cot, what):
  x, idx, _, wg, wu, wd = args

  def loss(x, w, wg, wu, wd):
    return jnp.sum(_plain(x, idx, w * w_ref, wg, wu, wd) * cot)

  assert_close(y, _plain(x, idx, args[2] * w_ref, wg, wu, wd), what=f"{what} forward")
  g_ref = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, args[2], wg, wu, wd)
  for name, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, g_ref, strict=True):
    assert_close(a, b, what=f"{what} grad {name}")


# (mesh, factor, bucket rows by hand): 13 tokens pad to 16; A_local = 16 / batch shards * k.
CAPACITY_CASES = [((1, 1, 8, 1), 0.5, 1),  # A_local = 2 * 2 = 4, ceil(0.5 * 4 / 8) = 1
                  ((1, 1, 4, 2), 1.0, 2),  # A_local = 4 * 2 = 8, ceil(1.0 * 8 / 4) = 2
                  ((2, 1, 2, 2), 0.75, 3)]  # A_local = 4 * 2 = 8, ceil(0.75 * 8 / 2) = 3


@pytest.mark.parametrize("mesh_shape,factor,cap", CAPACITY_CASES, ids=["ep8", "ep4_tp2", "dp2_ep2_tp2"])
def test_capacity_exchange_drops_match_hand_count(mesh_shape, factor, cap):
  """13 tokens (padded to the batch shards), k=2, e=8: dropped assignments (counted by hand) add
  nothing, forward and backward; the rest are exact, and `dropped` is their exact count."""
  t, e, k = 13, 8, 2
  args = _inputs(int(factor * 8) + mesh_shape[2], t, e, k, 6, 4)
  ep, shards = mesh_shape[2], mesh_shape[0] * mesh_shape[1] * mesh_shape[2]
  keep = _kept(args[1], shards, ep, e // ep, cap)
  assert 0 < int((~keep).sum())
  cot = jnp.asarray(args[-1].standard_normal((t, 6)), jnp.float32)
  y, dropped, grads = _run(mesh_shape, "capacity", factor, args[:-1], cot)
  assert dropped == float((~keep).sum())
  _check(y, grads, args[:-1], jnp.asarray(keep, jnp.float32), cot, f"capacity {mesh_shape}")


@pytest.mark.parametrize("mesh_shape", [(1, 1, 8, 1), (1, 2, 2, 2)], ids=["ep8", "fsdp2_ep2_tp2"])
def test_ragged_exchange_matches_plain_reference(mesh_shape):
  """The ragged exchange (emulated on CPU) is dropless: 11 tokens, k=3, skewed toward experts 0-2."""
  t, e, k = 11, 8, 3
  x, idx, w, wg, wu, wd, rng = _inputs(4, t, e, k, 5, 4)
  idx = idx.at[:6].set(jnp.asarray([0, 1, 2], jnp.int32))
  cot = jnp.asarray(rng.standard_normal((t, 5)), jnp.float32)
  args = (x, idx, w, wg, wu, wd)
  y, dropped, grads = _run(mesh_shape, "ragged", 1.0, args, cot)
  assert dropped == 0.0
  _check(y, grads, args, jnp.ones_like(w), cot, f"ragged {mesh_shape}")


def test_capacity_factor_must_be_positive():
  with pytest.raises(ValueError, match="capacity_factor=0"):
    ep_lib.capacity(8, 2, 0)
  assert ep_lib.capacity(9, 2, 0.5) == 3  # ceil(2.25), not floor
  assert ep_lib.capacity(4, 2, 8.0) == 4  # at most A_local


@pytest.mark.parametrize("exchange", ["capacity", "ragged"])
def test_empty_batch_is_an_empty_output(exchange):
  """Zero tokens over the mesh: [0, d] out and nothing dropped (it used to crash)."""
  x, idx, w, wg, wu, wd, _ = _inputs(1, 0, 8, 2, 5, 4)
  y, dropped, grads = _run((1, 1, 8, 1), exchange, 1.0, (x, idx, w, wg, wu, wd), jnp.zeros((0, 5)))
  assert y.shape == (0, 5) and dropped == 0.0
  np.testing.assert_array_equal(grads[2], np.zeros(wg.shape, np.float32))
