"""experiments/bench/dsa_masked_dense.py: its two sides are the two DSA paths of the same function
(equal loss and gradients in f32 on packed rows), and its rows really differ in the path taken."""

import jax.numpy as jnp
import numpy as np

from configs import horizon
from experiments.bench import dsa_masked_dense as bench
from model.config import ModelConfig


def test_sides_agree_and_take_different_paths():
  cfg = ModelConfig.from_config(horizon.get_config("tiny").model).replace(remat="none")
  t = 2 * cfg.index_topk + 5
  r = bench.bench_length(cfg, 2 * t, t, reps=1)
  assert r["batch"] == 2 and r["gather_ms"] > 0 and r["masked_ms"] > 0
  assert r["loss_rel_diff"] < 1e-5 and r["grad_rel_diff"] < 1e-5, r
  x, pos, seg, _ = bench._inputs(cfg, 2, t)
  assert x.shape == (2, t, cfg.d_model) and len(np.unique(np.asarray(seg))) == 3
  # positions restart at every segment start
  starts = np.flatnonzero(np.diff(np.asarray(seg[0]), prepend=-1))
  np.testing.assert_array_equal(np.asarray(pos[0])[starts], 0)
  fn_g, p_g = bench._grad_fn(cfg.replace(dsa_dense_len=0))
  fn_m, p_m = bench._grad_fn(cfg.replace(dsa_dense_len=t))
  ct = jnp.ones_like(x)
  hlo_g = fn_g.lower(p_g, x, pos, seg, ct).as_text()
  hlo_m = fn_m.lower(p_m, x, pos, seg, ct).as_text()
  assert "gather" in hlo_g and "gather" not in hlo_m  # the masked side gathers no key rows
