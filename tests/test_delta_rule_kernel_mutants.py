"""Pallas gated delta rule wrapper (pallas_kernels/delta_rule/ops.py): behaviours the mutation
audit found unpinned by tests/test_kernel_delta_rule.py, against values written out here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.delta_rule import BlockSizes, chunk_gated_delta_rule, ops


def _zeros(b, t, h, kd, vd):
  f32 = jnp.float32
  return (jnp.zeros((b, t, h, kd), f32), jnp.zeros((b, t, h, kd), f32), jnp.ones((b, t, h, vd), f32),
          jnp.zeros((b, t, h), f32), jnp.ones((b, t, h), f32))


@pytest.mark.parametrize("b, h, kd, vd", [(0, 2, 3, 4), (1, 0, 3, 4), (1, 2, 3, 0), (1, 2, 0, 4)])
def test_an_empty_axis_gives_empty_or_zero_results(b, h, kd, vd):
  """A drop-in for the XLA function, which returns these shapes: no batch, no heads or no value
  dim give empty results; no key dim gives a [b, h, 0, vd] state and zero outputs (o = S^T q with
  S empty), instead of an error from the kernel's tiling."""
  q, k, v, g, beta = _zeros(b, 3, h, kd, vd)
  s0 = jnp.ones((b, h, kd, vd), jnp.float32)
  o, final = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=2, interpret=True)
  assert o.shape == (b, 3, h, vd) and o.dtype == jnp.float32 and final.shape == (b, h, kd, vd)
  np.testing.assert_array_equal(np.asarray(o), 0.0)
  dv = jax.grad(lambda v: jnp.sum(chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=2)[0]))(v)
  assert dv.shape == v.shape
  np.testing.assert_array_equal(np.asarray(dv), 0.0)


@pytest.mark.parametrize("n, c, want", [
    (8, 64, 512),   # 512 tokens fit one block
    (9, 64, 320),   # 576 tokens: 2 blocks of ceil(9 / 2) = 5 chunks
    (20, 32, 320),  # 640 tokens: 2 blocks of 10 chunks
    (17, 64, 384),  # 1088 tokens: 3 blocks of ceil(17 / 3) = 6 chunks
])
def test_default_tpu_time_block_splits_the_sequence_evenly(n, c, want):
  """Compiled (TPU) default: about 512 tokens per grid step, an even split in whole chunks."""
  assert ops._time_block(BlockSizes(), False, n, c) == want
  assert ops._time_block(BlockSizes(), True, n, c) == n * c  # interpret mode: one block


def test_a_time_block_longer_than_the_sequence_is_cut_to_it():
  """time_block=48 for 2 chunks of 16: one block of 32 tokens, not 48 (16 tokens of padding)."""
  assert ops._time_block(BlockSizes(time_block=48), True, 2, 16) == 32
  assert ops._time_block(BlockSizes(time_block=48), False, 5, 16) == 48


def test_triton_layout_pads_head_dims_to_powers_of_two_from_16():
  """tl.dot needs power-of-two sizes >= 16: kd = 5 -> 16, vd = 20 -> 32, 64 stays; the Triton
  grid runs the whole padded length (tp) in one time block. Elsewhere dims stay as they are
  unless pad_head_dims asks for the same padding."""
  plan = ops._Plan(chunk=16, time_block=32, interpret=False, pad_head_dims=False, num_warps=4,
                   num_stages=1)
  layout, kp, vp = ops._layout(plan, "triton", 96, 5, 20)
  assert (kp, vp, layout.time_block, layout.backend) == (16, 32, 96, "triton")
  assert ops._layout(plan, "triton", 96, 64, 3)[1:] == (64, 16)
  layout, kp, vp = ops._layout(plan, "tpu", 96, 5, 20)
  assert (kp, vp, layout.time_block) == (5, 20, 32)
  padded = ops._Plan(16, 32, True, True, 4, 1)
  assert ops._layout(padded, "interpret", 96, 5, 20)[1:] == (16, 32)
