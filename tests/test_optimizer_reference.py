"""The train step's optimizer against plain NumPy references written out here: global-norm clipping,
AdamW (bias-corrected moments, eps outside the square root, decoupled weight decay on matrices
only), the warm-up + cosine schedule and skipped non-finite steps, several steps each so that b1,
b2, the clip threshold and the schedule's position all show in the weights."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import horizon
from tests.helpers import assert_close
from training import train_step as ts


def _tc(**changes) -> ts.TrainConfig:
  return ts.TrainConfig.from_config(dict(horizon.get_config("tiny").train.items(), **changes))


def _ref_lr(n: int, peak: float, warmup: int, steps: int, end_fraction: float) -> float:
  """Update n (0-based), warmup >= 1: linear warm-up reaching `peak` on update warmup-1, then a
  half cosine from `peak` reaching peak * end_fraction on the last update (steps-1), flat after."""
  if n < warmup:
    return peak * (n + 1) / warmup
  end = peak * end_fraction
  progress = min(1.0, (n + 1 - warmup) / (max(steps, warmup + 1) - warmup))
  return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup,steps", [(10, 100), (1, 12), (4, 5)])
def test_schedule_matches_written_out_warmup_cosine(warmup, steps):
  """Every update's rate, with a peak other than 1 (end_lr is a fraction *of the peak*), and the
  end rate reached on the last update, not one before it."""
  peak, frac = 3e-3, 0.1
  lr = ts.learning_rate_schedule(_tc(learning_rate=peak, warmup_steps=warmup, steps=steps,
                                     end_lr_fraction=frac))
  got = np.array([float(lr(n)) for n in range(steps + 5)])
  want = np.array([_ref_lr(n, peak, warmup, steps, frac) for n in range(steps + 5)])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
  assert got[warmup - 1] == pytest.approx(peak, rel=1e-6)
  assert got[steps - 1] == pytest.approx(peak * frac, rel=1e-5)
  if steps - 2 >= warmup:
    assert got[steps - 2] > peak * frac * (1 + 1e-4)  # still decaying one update before the end


def _params(rng):
  r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  return {"blocks": {i: {"w": r(3, 4), "scale": 1.0 + 0.1 * r(4)} for i in range(2)},
          "embed": r(5, 3), "bias": r(3)}


def _reference_run(params, grads_seq, tc):
  """NumPy float64 AdamW as the train step should run it; a non-finite gradient skips the step
  entirely (no moment, count or schedule advance)."""
  lr = lambda n: _ref_lr(n, tc.learning_rate, tc.warmup_steps, tc.steps, tc.end_lr_fraction)  # noqa: E731
  p = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
  m = [np.zeros_like(x) for x in p]
  v = [np.zeros_like(x) for x in p]
  t = 0
  out = []
  for grads in grads_seq:
    g = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
    if all(np.all(np.isfinite(x)) for x in g):
      if tc.grad_clip > 0:
        norm = math.sqrt(sum(float(np.sum(x * x)) for x in g))
        g = [x * min(1.0, tc.grad_clip / norm) for x in g]
      t += 1
      for i, (gi, pi) in enumerate(zip(g, p, strict=True)):
        m[i] = tc.b1 * m[i] + (1 - tc.b1) * gi
        v[i] = tc.b2 * v[i] + (1 - tc.b2) * gi * gi
        m_hat, v_hat = m[i] / (1 - tc.b1 ** t), v[i] / (1 - tc.b2 ** t)
        decay = tc.weight_decay * pi if pi.ndim >= 2 else 0.0
        p[i] = pi - lr(t - 1) * (m_hat / (np.sqrt(v_hat) + tc.eps) + decay)
    out.append([x.copy() for x in p])
  return out


@pytest.mark.parametrize("group_max_elements", [0, 1 << 20], ids=["per_leaf", "grouped"])
def test_make_optimizer_matches_numpy_adamw(group_max_elements):
  """Five steps through make_optimizer (clip 0.5 hit on some steps, not on others, one NaN step
  skipped) against the NumPy reference: b1 != b2, weight decay on the matrices only."""
  tc = _tc(learning_rate=0.05, warmup_steps=3, steps=8, end_lr_fraction=0.2, weight_decay=0.3,
           b1=0.8, b2=0.97, grad_clip=0.5, group_max_elements=group_max_elements)
  rng = np.random.default_rng(0)
  params0 = jax.tree.map(jnp.asarray, _params(rng))
  grads_seq = []
  for i, scale in enumerate((4.0, 0.05, 1.0, 2.0, 0.02)):  # global norms ~ 18, 0.2, 4.5, 9, 0.09
    g = jax.tree.map(lambda x, s=scale: jnp.asarray(rng.standard_normal(x.shape) * s, jnp.float32),
                     params0)
    if i == 2:
      g["blocks"][1]["w"] = g["blocks"][1]["w"].at[0, 1].set(jnp.nan)
    grads_seq.append(g)
  want = _reference_run(params0, grads_seq, tc)
  tx = ts.make_optimizer(tc)
  params, state = params0, tx.init(params0)
  for step, (g, ref) in enumerate(zip(grads_seq, want, strict=True)):
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
    for (path, got), r, p0 in zip(jax.tree_util.tree_leaves_with_path(params), ref,
                                  jax.tree.leaves(params0), strict=True):
      # The displacement from the start, so the tolerance is relative to what the optimizer moved.
      assert_close(np.asarray(got, np.float64) - np.asarray(p0, np.float64), r - np.asarray(p0, np.float64),
                   what=f"step {step} {jax.tree_util.keystr(path)}")
  assert int(state.total_notfinite) == 1


class _Toy(nnx.Module):
  """The train step's model interface with two parameters and a non-trainable multiplier that can
  poison the logits with NaN."""

  def __init__(self, vocab: int, dim: int):
    rng = np.random.default_rng(3)
    self.embed = nnx.Param(jnp.asarray(rng.standard_normal((vocab, dim)), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((vocab,), jnp.float32))
    self.poison = nnx.Variable(jnp.ones((), jnp.float32))

  def __call__(self, inputs, positions, segment_ids, images=None):
    e = self.embed[...]
    logits = (e[inputs] @ e.T) * self.poison[...] + self.bias[...]
    zero = jnp.zeros((), jnp.float32)
    return logits, {"z_loss": zero, "seq_aux_loss": zero, "indexer_loss": zero}


def test_reported_learning_rate_is_the_one_applied_after_a_skipped_step():
  """A skipped (non-finite) step does not advance the schedule: the next step reports and applies
  the rate of update 0 (Adam's first update moves each 1-D weight by ~lr * sign(gradient))."""
  tc = _tc(learning_rate=0.01, warmup_steps=10, steps=50, weight_decay=0.0)
  vocab = 11
  model = _Toy(vocab, 4)
  opt = nnx.Optimizer(model, ts.make_optimizer(tc), wrt=nnx.Param)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, vocab, (2, 7)), jnp.int32)
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1),
           "positions": jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7)),
           "segment_ids": jnp.ones((2, 7), jnp.int32)}
  model.poison[...] = jnp.float32(jnp.nan)
  bias0 = np.asarray(model.bias[...])
  metrics = jax.device_get(ts.jit_train_step(model, opt, batch, tc))
  assert not metrics["finite"]
  np.testing.assert_array_equal(model.bias[...], bias0)
  model.poison[...] = jnp.float32(1.0)
  metrics = jax.device_get(ts.jit_train_step(model, opt, batch, tc))
  assert metrics["finite"]
  first = tc.learning_rate * 1 / tc.warmup_steps  # update 0 of a 10-step warm-up
  assert float(metrics["learning_rate"]) == pytest.approx(first, rel=1e-6)
  moved = np.abs(np.asarray(model.bias[...]) - bias0)
  assert float(moved.max()) == pytest.approx(first, rel=1e-4)
