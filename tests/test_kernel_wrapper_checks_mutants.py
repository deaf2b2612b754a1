"""Argument checks and launch geometry of the Pallas kernels' wrappers (pallas_kernels/*/ops.py) that a
mutation audit found unpinned. Every call here is traced with jax.eval_shape (no kernel runs): it
either raises the wrapper's ValueError or gives the documented result shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.delta_rule import BlockSizes as DeltaBlocks
from pallas_kernels.delta_rule import chunk_gated_delta_rule
from pallas_kernels.indexer_topk import ops as topk_ops
from pallas_kernels.mxfp4 import ops as mx_ops
from pallas_kernels.sparse_attention import ops as attn_ops

S = jax.ShapeDtypeStruct
F32, I32 = jnp.float32, jnp.int32


def _delta(t=6, h=2, kd=3, vd=2):
  """q, k, v, g, beta structs of a tiny delta rule call (b = 1)."""
  return (S((1, t, h, kd), F32), S((1, t, h, kd), F32), S((1, t, h, vd), F32), S((1, t, h), F32),
          S((1, t, h), F32))


@pytest.mark.parametrize("chunk", [16, 32])
def test_delta_compiled_kernels_take_power_of_two_chunks_from_16(chunk):
  """chunk_size 16 is the smallest the compiled kernels take (TPU tiling, tl.dot): accepted."""
  fn = lambda *a: chunk_gated_delta_rule(*a, chunk_size=chunk, interpret=False)
  o, final = jax.eval_shape(fn, *_delta())
  assert (o.shape, final.shape) == ((1, 6, 2, 2), (1, 2, 3, 2))


@pytest.mark.parametrize("chunk", [8, 24])
def test_delta_compiled_kernels_refuse_other_chunks(chunk):
  fn = lambda *a: chunk_gated_delta_rule(*a, chunk_size=chunk, interpret=False)
  with pytest.raises(ValueError, match=f"chunk_size={chunk} must be a power of two >= 16"):
    jax.eval_shape(fn, *_delta())


def test_delta_bools_are_not_sizes():
  """True is an int in Python; as a chunk or block size it is a mistake, not 1."""
  with pytest.raises(ValueError, match="chunk_size=True"):
    jax.eval_shape(lambda *a: chunk_gated_delta_rule(*a, chunk_size=True, interpret=True), *_delta())
  with pytest.raises(ValueError, match="time_block=True"):
    DeltaBlocks(time_block=True)


def _mqa(t=3, h=2, c=3, p=2, s=5, k=4):
  """q_lat, q_rope, latent, k_rope, idx, valid structs of a tiny sparse MQA call (b = 1)."""
  return (S((1, t, h, c), F32), S((1, t, h, p), F32), S((1, s, c), F32), S((1, s, p), F32), S((1, t, k), I32),
          S((1, t, k), jnp.bool_))


def _attend(structs, scale=0.5, query_block=4, **kw):
  return jax.eval_shape(lambda *a: attn_ops.sparse_mqa_attention(*a, scale, query_block, **kw), *structs)


@pytest.mark.parametrize("structs, scale, kw, match", [
    (_mqa(), 0.0, {}, "scale=0.0 must be a positive number"),
    (_mqa(), -0.5, {}, "scale=-0.5 must be a positive number"),
    (_mqa(), True, {}, "scale=True must be a positive number"),
    (_mqa(), float("inf"), {}, "scale=inf must be a positive number"),
    (_mqa(k=0), 0.5, {}, "idx and valid must both be"),
    (_mqa(s=0), 0.5, {}, "need non-empty q_lat and latent"),
    (_mqa(h=16), 0.5, dict(backend="tpu", block=attn_ops.BlockSizes(8, 8, 4)),
     "on TPU block_h=4 must be a multiple of 8"),
    (_mqa(h=12), 0.5, dict(backend="tpu", block=attn_ops.BlockSizes(8, 8, 8)),
     "block_h=8 must divide the \\(padded\\) head count 12"),
])
def test_sparse_attention_refuses(structs, scale, kw, match):
  with pytest.raises(ValueError, match=match):
    _attend(structs, scale, **kw)


def test_sparse_attention_takes_a_numpy_scale():
  """The XLA path takes any real scale (np.float32 from numpy maths included); so does the drop-in."""
  out, p_sel = _attend(_mqa(), np.float32(0.5), backend="triton", interpret=True)
  assert (out.shape, out.dtype, p_sel.shape) == ((1, 3, 2, 3), F32, (1, 3, 4))


@pytest.mark.parametrize("t, query_block", [(20, 16), (33, 16), (17, 32)])
def test_sparse_attention_tpu_backward_chunks_whole_query_blocks(t, query_block):
  """TPU: block_q=8 and query_block > 8, so the backward scans chunks of several query tiles; the
  padded query count must be a whole number of chunks (t=20, qb=16: chunks of 16, 32 queries)."""
  structs = _mqa(t=t)

  def loss(ql, qr, lat, kr, idx, valid):
    out, _ = attn_ops.sparse_mqa_attention(ql, qr, lat, kr, idx, valid, 0.5, query_block, backend="tpu",
                                           interpret=False, block=attn_ops.BlockSizes(8, 8, None))
    return jnp.sum(out)

  grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3)), *structs)
  assert [x.shape for x in grads] == [x.shape for x in structs[:4]]


def _topk(t=5, h=2, d=3, s=19):
  """q_idx, w_idx, k_idx, q_pos, q_seg, k_pos, k_seg structs of a tiny indexer call (b = 1)."""
  return (S((1, t, h, d), F32), S((1, t, h), F32), S((1, s, d), F32), S((1, t), I32), S((1, t), I32),
          S((1, s), I32), S((1, s), I32))


def test_indexer_topk_refuses_tpu_key_blocks_off_the_sublane_tile():
  """TPU key blocks must be multiples of 8 unless one block holds every key (chunk 4: 4 keys of 19)."""
  fn = lambda *a: topk_ops.blockwise_topk(*a, 4, 4, 8, backend="tpu", interpret=False,
                                          block=topk_ops.BlockSizes(8, 4, 4))
  with pytest.raises(ValueError, match="on TPU block_k=4 must be a multiple of 8"):
    jax.eval_shape(fn, *_topk())
  one_block = lambda *a: topk_ops.blockwise_topk(*a, 4, 4, 8, backend="tpu", interpret=False,
                                                 block=topk_ops.BlockSizes(8, 4, 4))
  idx, valid = jax.eval_shape(one_block, *_topk(s=4))
  assert idx.shape == valid.shape == (1, 5, 4)


def test_indexer_topk_needs_a_head():
  fn = lambda *a: topk_ops.blockwise_topk(*a, 4, 4, 8, backend="triton", interpret=True)
  with pytest.raises(ValueError, match="need at least one indexer head"):
    jax.eval_shape(fn, *_topk(h=0))


@pytest.mark.parametrize("make, fields", [
    (DeltaBlocks, ("time_block", "num_warps", "num_stages")),
    (attn_ops.BlockSizes, ("block_q", "block_k", "block_h")),
    (topk_ops.BlockSizes, ("block_q", "block_k", "chunk")),
    (mx_ops.BlockSizes, ("block_m", "block_n", "block_k")),
], ids=["delta", "sparse_attention", "indexer_topk", "mxfp4"])
def test_numpy_ints_are_sizes_and_bools_are_not(make, fields):
  """Every kernel's BlockSizes: NumPy ints (sizes computed with NumPy) were refused by some and are
  kept as Python ints; True was taken as 1 by some and is refused by all."""
  sizes = {"time_block": 32, "num_warps": 4, "num_stages": 2, "block_q": 8, "block_k": 64, "block_h": 4,
           "chunk": 32, "block_m": 16, "block_n": 16}
  block = make(**{f: np.int64(sizes[f]) for f in fields})
  assert all(type(getattr(block, f)) is int and getattr(block, f) == sizes[f] for f in fields)
  assert block == make(**{f: sizes[f] for f in fields})
  for f in fields:
    with pytest.raises(ValueError, match=f"BlockSizes.{f}=True"):
      make(**{f: True})


def test_numpy_int_arguments_are_taken_and_bools_refused():
  """chunk_size, query_block, topk, query_block and key_block of the kernels' entry points."""
  delta = lambda *a: chunk_gated_delta_rule(*a, chunk_size=np.int32(4), interpret=True)  # noqa: E731
  o, _ = jax.eval_shape(delta, *_delta())
  assert o.shape == (1, 6, 2, 2)
  out, _ = _attend(_mqa(), 0.5, np.int64(4), backend="triton", interpret=True)
  assert out.shape == (1, 3, 2, 3)
  with pytest.raises(ValueError, match="query_block=True must be a positive int"):
    _attend(_mqa(), 0.5, True)
  topk = lambda *args: (lambda *a: topk_ops.blockwise_topk(*a, *args, backend="triton", interpret=True))
  idx, _ = jax.eval_shape(topk(np.int64(4), np.int32(4), np.int64(8)), *_topk())
  assert idx.shape == (1, 5, 4)
  for args, name in (((True, 4, 8), "topk"), ((4, True, 8), "query_block"), ((4, 4, True), "key_block")):
    with pytest.raises(ValueError, match=f"{name}=True must be a positive int"):
      jax.eval_shape(topk(*args), *_topk())
