"""model/scan.py's layer order, found unpinned by a mutation audit: the full-model scan tests are slow
(marked so, or minutes of compiling), so mutants that ran the scanned layers in another order,
handed a unit the wrong layer's routing replay, returned the aux dicts out of layer order, skipped
the residual constraint inside the scan, or dropped a layer after an unscanned stack passed the fast
suite. Here the blocks are affine maps x -> a*x + b (+ c * sum of its replay ids) whose order matters,
so the written-out chain is the reference; each case compiles in well under a second."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import horizon
from model.config import ModelConfig
from model.scan import LayerPlan, layer_plan, run_blocks


class _Affine(nnx.Module):
  """x -> a*x + b + 0.5 * sum(replay ids); aux: the input it saw."""

  def __init__(self, a: float, b: float):
    self.a = nnx.Param(jnp.asarray(a, jnp.float32))
    self.b = nnx.Param(jnp.asarray(b, jnp.float32))

  def __call__(self, x, positions, segment_ids, replay):
    y = x * self.a[...] + self.b[...]
    if replay is not None:
      y = y + 0.5 * jnp.sum(jnp.where(replay[1][..., None], replay[0], 0)).astype(jnp.float32)
    return y, {"seen": x[0, :, 0]}


class _Stack(nnx.Module):
  def __init__(self, blocks):
    self.blocks = nnx.List(blocks)


A = [1.5, -0.5, 2.0, 0.75, -1.25, 1.1, 0.9, -2.0]  # f32 rounding: compared at atol 1e-5 (values ~1-10)
B = [0.1, 1.0, -0.3, 0.2, 0.5, -1.0, 0.05, 0.4]
X0 = [[[1.0], [-2.0]]]  # [b=1, t=2, d=1]


def _cfg(num_layers, **changes) -> ModelConfig:
  base = ModelConfig.from_config(horizon.get_config("tiny").model)
  return base.replace(**{"num_layers": num_layers, "dsa_period": 2, "num_dense_layers": 1, **changes})


def _replays(n):
  """Layer 0 (dense FFN): none; layer i >= 1: ids all equal to i on a mask that keeps one token."""
  mask = jnp.asarray([[True, False]])
  return [None] + [(jnp.full((1, 2, 1), i, jnp.int32), mask) for i in range(1, n)]


def _reference(n, minus=1.0):
  """The chain written out: layer i maps x to A[i]*x + B[i] + 0.5*i (its one kept replay id), then the
  constraint subtracts `minus`; returns (output, the input each layer saw)."""
  x, seen = np.asarray(X0, np.float64)[0, :, 0], []
  for i in range(n):
    seen.append(x.copy())
    x = A[i] * x + B[i] + 0.5 * i - minus
  return x, seen


def _run(n, scan, remat="none"):
  cfg = _cfg(n, scan_layers=scan, remat=remat)
  stack = _Stack([_Affine(A[i], B[i]) for i in range(n)])
  graphdef, state = nnx.split(stack)

  def f(state):
    blocks = nnx.merge(graphdef, state).blocks
    x, auxes = run_blocks(blocks, cfg, jnp.asarray(X0), jnp.zeros((1, 2), jnp.int32),
                          jnp.ones((1, 2), jnp.int32), _replays(n),
                          lambda blk, x, p, s, r: blk(x, p, s, r), lambda y: y - 1.0)
    return jnp.sum(x), (x, auxes)

  (_, (x, auxes)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(state)
  return cfg, np.asarray(x)[0, :, 0], [np.asarray(a["seen"]) for a in auxes], grads


@pytest.mark.parametrize("n, plan", [(8, LayerPlan(1, 2, 3)), (7, LayerPlan(1, 2, 3)),
                                     (3, LayerPlan(1, 2, 0))])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_layers_run_in_order_with_their_replays_and_aux(n, plan, remat):
  """8 layers: one dense, three scanned units of two, one unrolled after; 7: nothing after the scan;
  3: one unit only, so nothing is scanned (every layer must still run once, in order)."""
  cfg, x, seen, _ = _run(n, True, remat)
  assert layer_plan(cfg) == plan
  want_x, want_seen = _reference(n)
  np.testing.assert_allclose(x, want_x, rtol=1e-6, atol=1e-5)
  assert len(seen) == n
  for i in range(n):
    np.testing.assert_allclose(seen[i], want_seen[i], rtol=1e-6, atol=1e-5,
                               err_msg=f"layer {i}'s input")


def test_gradients_reach_each_layers_own_parameters():
  """d sum(out) / d a_i = sum(input of layer i) * prod_{j>i} a_j; d / d b_i = t * prod_{j>i} a_j."""
  n = 8
  _, _, _, grads = _run(n, True)
  _, seen = _reference(n)
  t = len(X0[0])
  for i in range(n):
    tail = float(np.prod(A[i + 1:]))
    np.testing.assert_allclose(grads["blocks"][i]["a"][...], np.sum(seen[i]) * tail, rtol=1e-5,
                               err_msg=f"grad a_{i}")
    np.testing.assert_allclose(grads["blocks"][i]["b"][...], t * tail, rtol=1e-5, err_msg=f"grad b_{i}")


def test_the_period_is_dsa_period_whatever_the_offset():
  """Layer i is DSA when i % dsa_period == dsa_offset: the offset moves the DSA layer inside the unit,
  not the period (a mutant added it to the period and raised on a valid config)."""
  cfg = _cfg(8, scan_layers=True, dsa_offset=1)
  assert cfg.layer_kinds == ("delta", "dsa", "delta", "dsa", "delta", "dsa", "delta", "dsa")
  assert layer_plan(cfg) == LayerPlan(1, 2, 3)
  assert layer_plan(_cfg(11, scan_layers=True, dsa_period=3, dsa_offset=2)) == LayerPlan(1, 3, 3)


@pytest.mark.parametrize("remat, wrapped", [("none", False), ("full", True), ("save_dots", True)])
def test_scanned_blocks_are_rematerialised_as_the_config_says(remat, wrapped):
  """Every remat but 'none' wraps the scanned block in jax.checkpoint (a mutant left 'save_dots'
  unwrapped: the same maths, every activation kept). The unrolled layers' remat is the caller's."""
  cfg = _cfg(8, scan_layers=True, remat=remat)
  stack = _Stack([_Affine(A[i], B[i]) for i in range(8)])
  jaxpr = jax.make_jaxpr(lambda x: run_blocks(
      stack.blocks, cfg, x, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32), _replays(8),
      lambda blk, x, p, s, r: blk(x, p, s, r), lambda y: y)[0])(jnp.asarray(X0))
  assert ("checkpoint" in str(jaxpr) or "remat" in str(jaxpr)) == wrapped
