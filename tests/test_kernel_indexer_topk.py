"""Pallas indexer top-k (pallas_kernels/indexer_topk) vs the XLA path, in interpret mode.

Integer-valued inputs make every score exact in f32 whatever the summation
order, so indices must match the XLA path exactly, ties included (ties are
frequent with small integers: higher score first, then lower key index).
Random normal inputs check the selected score sets. Both kernel bodies run
on CPU (Triton: generic interpreter; TPU: pltpu.InterpretParams); lowering
for TPU and CUDA is checked with jax.export.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from model.attention import sparse
from pallas_kernels.indexer_topk import kernel, ops, reference
from tests.helpers import assert_close

B, T, H, D, S = 2, 13, 3, 5, 19


def _data(seed: int, integer: bool):
  """Indexer inputs for two rows of different kinds (numpy, no compile).

  Row 0: a packed chunk: keys are positions 0..18 in two segments (0: 0..6,
  1: 7..18), the queries are the last 13 tokens; the last query is padding
  (segment -1). Row 1: a decode cache of 19 slots with 15 filled (unfilled
  slots have segment -1); queries are positions 2..14.
  """
  rng = np.random.default_rng(seed)
  if integer:
    draw = lambda *shape: rng.integers(-2, 3, shape).astype(np.float32)
    q, w, k = draw(B, T, H, D), draw(B, T, H) * 0.5, draw(B, S, D)
  else:
    q, w, k = (rng.standard_normal(sh).astype(np.float32) for sh in ((B, T, H, D), (B, T, H), (B, S, D)))
  k_pos = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy()
  k_seg = np.stack([np.where(np.arange(S) < 7, 0, 1), np.where(np.arange(S) < 15, 0, -1)]).astype(np.int32)
  q_pos = np.stack([np.arange(S - T, S), np.arange(2, 2 + T)]).astype(np.int32)
  q_seg = np.stack([k_seg[0, S - T:], np.zeros(T)]).astype(np.int32)
  q_seg[0, -1] = -1
  return tuple(jnp.asarray(x) for x in (q, w, k, q_pos, q_seg, k_pos, k_seg))


@functools.cache
def _ref(topk: int, seed: int = 0, integer: bool = True):
  args = _data(seed, integer)
  return args, jax.jit(lambda *a: sparse.blockwise_topk(*a, topk, 4, 8))(*args)


# (backend, block, interpret, topk): topk 9 and 24 exceed the allowed keys of early queries
# (24 > s as well); key blocks of 8/16/32 over 19 keys give 3/2/1 blocks and skipped blocks.
CASES = {
    "triton_16q_16keys_topk4": ("triton", ops.BlockSizes(16, 16, 16), True, 4),
    "triton_16q_32keys_topk24": ("triton", ops.BlockSizes(16, 32, 16), True, 24),
    "tpu_8q_8keys_chunk4_topk9": ("tpu", ops.BlockSizes(8, 8, 4), pltpu.InterpretParams(), 9),
    "tpu_8q_16keys_chunk8_topk6": ("tpu", ops.BlockSizes(8, 16, 8), pltpu.InterpretParams(), 6),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_exactly_with_ties(case):
  backend, block, interp, topk = CASES[case]
  args, (want_idx, want_valid) = _ref(topk)
  fn = lambda *a: ops.blockwise_topk(*a, topk, 4, 8, block=block, interpret=interp, backend=backend)
  idx, valid = jax.jit(fn)(*args)
  np.testing.assert_array_equal(np.asarray(valid), np.asarray(want_valid))
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
  assert not bool(jnp.any(valid[0, -1])), "a padding query selects nothing"
  assert bool(jnp.all(jnp.where(valid[1], idx[1] < 15, True))), "unfilled cache slots are never selected"


@pytest.mark.parametrize("backend,interp", [("triton", True), ("tpu", pltpu.InterpretParams())])
def test_decode_single_query(backend, interp):
  """One new token per row against a cache (tile of one query, Triton's broadcast-multiply scores)."""
  q, w, k, q_pos, q_seg, k_pos, k_seg = _data(4, True)
  args = (q[:, 7:8], w[:, 7:8], k, q_pos[:, 7:8], q_seg[:, 7:8], k_pos, k_seg)
  want = jax.jit(lambda *a: sparse.blockwise_topk(*a, 5, 4, 8))(*args)
  got = jax.jit(lambda *a: ops.blockwise_topk(*a, 5, 4, 8, interpret=interp, backend=backend))(*args)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.parametrize("backend,interp,block", [("triton", True, ops.BlockSizes(16, 16, 16)),
                                                   ("tpu", pltpu.InterpretParams(), ops.BlockSizes(8, 8, 4))])
def test_decode_query_on_a_key_block_start_sees_its_own_key(backend, interp, block):
  """A query at position 16 with key blocks of 8 / 16: the block starting at its own key (key
  pos == query pos) is needed. Both paths share needed_blocks, so check them against the dense
  definition, not against each other."""
  q, w, k, q_pos, q_seg, k_pos, k_seg = _data(4, True)
  args = (q[:, 10:11], w[:, 10:11], k, q_pos[:, 10:11], q_seg[:, 10:11], k_pos, k_seg)
  assert int(q_pos[0, 10]) == 16
  topk = 12  # more than row 0's 10 allowed keys (segment 1, positions 7..16)
  d_idx, d_valid, _ = reference.dense_topk(*args, topk)
  assert bool(jnp.any(d_valid[0, 0] & (d_idx[0, 0] == 16)))
  xla = jax.jit(lambda *a: sparse.blockwise_topk(*a, topk, 4, 8))(*args)
  pal = jax.jit(lambda *a: ops.blockwise_topk(*a, topk, 4, 8, block=block, interpret=interp,
                                              backend=backend))(*args)
  for name, (idx, valid) in (("xla", xla), ("pallas", pal)):
    np.testing.assert_array_equal(np.asarray(valid), np.asarray(d_valid), err_msg=name)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(d_idx), err_msg=name)


def test_reference_matches_dense_definition():
  """The XLA path (the kernel's reference) equals top-k of the dense masked score matrix."""
  for topk in (4, 24):
    args, (idx, valid) = _ref(topk)
    d_idx, d_valid, _ = reference.dense_topk(*args, topk)
    np.testing.assert_array_equal(np.asarray(valid), np.asarray(d_valid))
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(d_idx))


def test_random_normal_scores_select_the_same_sets():
  """With continuous scores, the selected scores equal the XLA path's (order by value)."""
  topk = 6
  args, (want_idx, want_valid) = _ref(topk, seed=3, integer=False)
  fn = lambda *a: ops.blockwise_topk(*a, topk, 4, 8, block=ops.BlockSizes(16, 16, 16), interpret=True,
                                     backend="triton")
  idx, valid = jax.jit(fn)(*args)
  _, _, scores = reference.dense_topk(*args, topk)
  np.testing.assert_array_equal(np.asarray(valid), np.asarray(want_valid))
  pick = lambda ix: jnp.where(valid, jnp.take_along_axis(scores, ix, axis=-1), 0.0)
  assert_close(pick(idx), pick(want_idx), what="selected scores")


@pytest.mark.parametrize("backend,interp", [("triton", True), ("tpu", pltpu.InterpretParams())])
def test_every_output_element_is_written(backend, interp):
  """Interpreters start outputs as NaN / INT_MIN (TPU: all fresh memory): all tiles must be written."""
  args = _data(1, True)
  block = ops.BlockSizes(16, 16, 16) if backend == "triton" else ops.BlockSizes(8, 8, 4)
  geo = ops._geometry((B, T, H, D, S), 7, 8, block, backend, interp)
  tp, sp, m = geo.queries, geo.keys, geo.chunk
  q, w, k, q_pos, q_seg, k_pos, k_seg = args
  pad = lambda x, n, v: jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=v)
  qp, qs, kp, ks = pad(q_pos, tp, 0), pad(q_seg, tp, -1), pad(k_pos, sp, 0), pad(k_seg, sp, -1)
  bounds = ops.tile_bounds(qp, qs, kp, ks, geo.block_q, geo.block_k)
  qk = jnp.pad(q, ((0, 0), (0, tp - T), (0, 0), (0, geo.dim - D))).transpose(0, 2, 1, 3)
  wk = pad(w, tp, 0.0).transpose(0, 2, 1)[..., None]
  kk = jnp.pad(k, ((0, 0), (0, sp - S), (0, geo.dim - D)))
  chunked = lambda x: x.reshape(B, sp // m, 1, m)
  run = jax.jit(functools.partial(kernel.topk, geo))
  vals, ids = run(bounds, qk, wk, qp[..., None], qs[..., None], kk, chunked(kp), chunked(ks))
  assert not np.isnan(np.asarray(vals)).any()
  assert (np.asarray(ids) != np.iinfo(np.int32).min).all()


def test_no_gradient_flows_and_grad_traces():
  """Inside a differentiated loss (as in the model) the selection is constant: zero cotangents."""
  args = _data(2, False)
  q, w, k = args[:3]

  def loss(q, w, k):
    idx, valid = ops.blockwise_topk(q, w, k, *args[3:], 4, 4, 8, interpret=True, backend="triton")
    picked = jnp.take_along_axis(jnp.sum(k, -1)[:, None, :], idx, -1)
    return jnp.sum(jnp.where(valid, picked, 0.0)) + 0 * q.sum()

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, w, k)
  assert float(jnp.abs(grads[0]).max()) == 0.0 and float(jnp.abs(grads[1]).max()) == 0.0
  assert float(jnp.abs(grads[2]).max()) > 0.0  # through the gather of k, not through the selection


S_ = jax.ShapeDtypeStruct


def _structs(b=1, t=256, h=8, d=64, s=4096, dt=jnp.bfloat16):
  """Indexer of a small-config-like layer: 8 heads of 64, bf16, 4096 keys."""
  i32 = jnp.int32
  return (S_((b, t, h, d), dt), S_((b, t, h), dt), S_((b, s, d), dt), S_((b, t), i32), S_((b, t), i32),
          S_((b, s), i32), S_((b, s), i32))


@pytest.mark.parametrize("topk,t", [(64, 256), (2048, 256), (256, 1)])
@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("triton", "cuda")])
def test_lowers_for_tpu_and_cuda(backend, platform, topk, t):
  """jax.export for the device platform; t=1 is a decode step (batch 4, one query per row)."""
  fn = lambda *a: ops.blockwise_topk(*a, topk, 128, 2048, backend=backend, interpret=False)
  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if platform == "cuda" else []
  structs = _structs(b=1 if t > 1 else 4, t=t)
  exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*structs)
  assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in exported.mlir_module()


def test_bad_arguments_raise_clear_errors():
  q, w, k, q_pos, q_seg, k_pos, k_seg = _data(0, True)
  call = ops.blockwise_topk
  with pytest.raises(ValueError, match="w_idx must be"):
    call(q, w[..., :2], k, q_pos, q_seg, k_pos, k_seg, 4, 4, 8)
  with pytest.raises(ValueError, match="k_idx must be"):
    call(q, w, k[..., :3], q_pos, q_seg, k_pos, k_seg, 4, 4, 8)
  with pytest.raises(ValueError, match="k_seg must have shape"):
    call(q, w, k, q_pos, q_seg, k_pos, k_seg[:, :5], 4, 4, 8)
  with pytest.raises(ValueError, match="q_pos must be an integer"):
    call(q, w, k, q_pos.astype(jnp.float32), q_seg, k_pos, k_seg, 4, 4, 8)
  with pytest.raises(ValueError, match="topk=0"):
    call(q, w, k, q_pos, q_seg, k_pos, k_seg, 0, 4, 8)
  with pytest.raises(ValueError, match="backend"):
    call(q, w, k, q_pos, q_seg, k_pos, k_seg, 4, 4, 8, backend="gpu")
  with pytest.raises(ValueError, match="block_q=4 must be a multiple of 8"):
    call(q, w, k, q_pos, q_seg, k_pos, k_seg, 4, 4, 8, backend="tpu", block=ops.BlockSizes(4, 8, 4))
  with pytest.raises(ValueError, match="multiple of chunk"):
    ops.BlockSizes(8, 12, 8)
  with pytest.raises(ValueError, match="power of two"):
    ops.BlockSizes(6, None, 8)
