"""Mutation-audit tests for the gated delta rule and DeltaAttention (model/attention/delta_rule.py,
delta.py): behaviours the neighbouring tests (tests/test_delta.py) left open, each against a
reference written out here (a per-token numpy loop) on random odd-shaped f32 inputs."""

import numpy as np
import pytest
from flax import nnx

from model.attention.delta import DeltaAttention


def test_layer_rejects_empty_batch_or_time_up_front(tiny_cfg):
  """An empty time or batch axis is a clear ValueError, not a ZeroDivisionError from a reshape."""
  layer = nnx.eval_shape(lambda: DeltaAttention(tiny_cfg, rngs=nnx.Rngs(0)))
  d = tiny_cfg.d_model
  for shape in ((1, 0, d), (0, 3, d)):
    with pytest.raises(ValueError, match=r"t >= 1"):
      layer(np.zeros(shape, np.float32))
  with pytest.raises(ValueError, match=r"t >= 1"):
    layer.extend(np.zeros((1, 0, d), np.float32), np.ones((1, 0), bool), layer.init_cache(1, 4))


def test_extend_rejects_a_valid_mask_that_is_not_a_prefix(tiny_cfg):
  """valid [False, True, True] would advance the state over two tokens but keep the conv history
  of the wrong ones (it assumes right padding): rejected while valid is concrete."""
  layer = nnx.eval_shape(lambda: DeltaAttention(tiny_cfg, rngs=nnx.Rngs(0)))
  x = np.ones((2, 3, tiny_cfg.d_model), np.float32)
  with pytest.raises(ValueError, match="prefix mask per row"):
    layer.extend(x, np.array([[True, False, False], [False, True, True]]), layer.init_cache(2, 4))
