"""The tiny model memorises one fixed batch: loss falls by >= 90% in 300 AdamW steps."""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from model.decoder import build_model


def test_tiny_overfits_one_batch(tiny_cfg):
  model = build_model(tiny_cfg, seed=0)
  tok = jnp.asarray(np.random.default_rng(0).integers(0, tiny_cfg.image_token_id, (2, 33)), jnp.int32)
  inputs, targets = tok[:, :-1], tok[:, 1:]
  opt = nnx.Optimizer(model, optax.adamw(3e-3, weight_decay=0.0), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    def loss_fn(m):
      logits, aux = m(inputs)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
      return ce + 1e-3 * aux["z_loss"] + aux["indexer_loss"], ce

    (_, ce), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    return ce

  # 100 steps reach ~0.1% of the first loss (measured 0.12%; 300 steps reached 0.04%, and this
  # asserted 10% after them)
  losses = [float(step(model, opt)) for _ in range(100)]
  assert np.all(np.isfinite(losses))
  assert losses[-1] <= 0.01 * losses[0], (losses[0], losses[-1])
