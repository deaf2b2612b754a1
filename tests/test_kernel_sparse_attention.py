"""Pallas sparse MQA (pallas_kernels/sparse_attention) vs the XLA path, in interpret mode.

Both kernel bodies run on CPU: Triton under the generic interpreter, TPU
(Mosaic: SMEM indices, per-row DMAs, double buffer) under
pltpu.InterpretParams, which simulates the DMAs and fills fresh memory with
NaN; the generic interpreter NaN-fills outputs too, so an element a kernel
fails to write surfaces as a non-finite value. Lowering for real TPUs and
GPUs is checked with jax.export on this CPU host.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from model.attention import sparse
from pallas_kernels.sparse_attention import kernel, ops, reference
from tests.helpers import assert_close

SCALE = 0.37


def _data(b, t, h, c, p, s, k, seed):
  """Random f32 inputs (numpy, no compile); distinct indices per row, random valid slots, one empty row."""
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  idx = np.argsort(rng.random((b, t, s)), axis=-1)[..., :k].astype(np.int32)
  valid = rng.random((b, t, k)) < 0.7
  valid[0, 1] = False  # a query with no valid slot -> zeros
  return f(b, t, h, c), f(b, t, h, p), f(b, s, c), f(b, s, p), jnp.asarray(idx), jnp.asarray(valid)


def _loss_and_outputs(fn, ql, qr, lat, kr, idx, valid):
  """A loss with a random projection of out_lat, and the forward outputs as aux."""
  out, p_sel = fn(ql, qr, lat, kr, idx, valid)
  proj = jax.random.normal(jax.random.key(7), out.shape)
  return jnp.sum(jnp.sin(out) * proj), (out, p_sel)


# One odd shape for every case: b=2, t=11, h=19 (two Triton head blocks of 16 after padding to 32),
# c=7, p=5, s=13 keys, k=6 slots (padded to the slot block).
SHAPE = (2, 11, 19, 7, 5, 13, 6)


@functools.cache
def _ref_results():
  args = _data(*SHAPE, 0)
  fn = lambda *a: sparse.sparse_mqa_attention(*a, SCALE, 4)
  grads, outs = jax.jit(jax.grad(functools.partial(_loss_and_outputs, fn), argnums=(0, 1, 2, 3),
                                 has_aux=True))(*args)
  return args, grads, outs


# (backend, block, interpret, query_block)
CASES = {
    "triton_1q_16slots": ("triton", ops.BlockSizes(1, 16, None), True, 4),
    "triton_2q_4slots_2headblocks": ("triton", ops.BlockSizes(2, 4, 16), True, 4),
    "tpu_8q_4slots_2chunks": ("tpu", ops.BlockSizes(8, 4, None), pltpu.InterpretParams(), 8),
    "tpu_16q_8slots": ("tpu", ops.BlockSizes(16, 8, None), pltpu.InterpretParams(), 16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradients_match_reference(case):
  backend, block, interp, qblock = CASES[case]
  args, want_grads, (want_out, want_p) = _ref_results()
  fn = lambda *a: ops.sparse_mqa_attention(*a, SCALE, qblock, block=block, interpret=interp,
                                           backend=backend)
  grads, (out, p_sel) = jax.jit(jax.grad(functools.partial(_loss_and_outputs, fn), argnums=(0, 1, 2, 3),
                                         has_aux=True))(*args)
  assert_close(out, want_out, what="out_lat")
  assert_close(p_sel, want_p, what="p_sel")
  empty = ~jnp.any(args[5], axis=-1)
  assert bool(jnp.all(jnp.where(empty[..., None, None], out == 0, True))), "rows without a valid slot"
  for name, g, w in zip(("dq_lat", "dq_rope", "dlatent", "dk_rope"), grads, want_grads, strict=True):
    assert_close(g, w, what=name)


@pytest.mark.parametrize("backend,interp", [("triton", True), ("tpu", pltpu.InterpretParams())])
def test_decode_single_query(backend, interp):
  """t=1 (a decode step): one tile of one query, default block sizes, forward and gradients."""
  args, _, _ = _ref_results()
  args = [x[:, 4:5] for x in args[:2]] + list(args[2:4]) + [x[:, 4:5] for x in args[4:]]
  fn = lambda *a: ops.sparse_mqa_attention(*a, SCALE, 4, interpret=interp, backend=backend)
  ref = lambda *a: sparse.sparse_mqa_attention(*a, SCALE, 4)
  run = lambda f: jax.jit(jax.grad(functools.partial(_loss_and_outputs, f), argnums=(0, 1, 2, 3),
                                   has_aux=True))(*args)
  (grads, (out, p_sel)), (want_grads, (want_out, want_p)) = run(fn), run(ref)
  assert_close(out, want_out, what="out_lat")
  assert_close(p_sel, want_p, what="p_sel")
  for name, g, w in zip(("dq_lat", "dq_rope", "dlatent", "dk_rope"), grads, want_grads, strict=True):
    assert_close(g, w, what=name)


def test_reference_agrees_with_dense_definition():
  """The XLA path (the kernels' reference) equals dense attention under the selection mask."""
  args = _data(*SHAPE, 0)
  out, p_sel = jax.jit(lambda *a: sparse.sparse_mqa_attention(*a, SCALE, 4))(*args)
  d_out, d_p = jax.jit(lambda *a: reference.dense_reference(*a, SCALE))(*args)
  assert_close(out, d_out, what="out_lat")
  assert_close(p_sel, d_p, what="p_sel")


def test_out_of_range_indices_are_clipped_like_the_reference():
  """Valid indices past the end gather the last row (forward only: clipping makes duplicates)."""
  ql, qr, lat, kr, idx, valid = _data(1, 3, 3, 7, 5, 11, 4, 5)
  idx = idx.at[0, :, 0].set(40)
  fn = lambda *a: ops.sparse_mqa_attention(*a, SCALE, 4, block=ops.BlockSizes(1, 16, None), interpret=True,
                                           backend="triton")
  got = jax.jit(fn)(ql, qr, lat, kr, idx, valid)
  want = jax.jit(lambda *a: sparse.sparse_mqa_attention(*a, SCALE, 4))(ql, qr, lat, kr, idx, valid)
  assert_close(got[0], want[0], what="out_lat")
  assert_close(got[1], want[1], what="p_sel")


def _lse_reference(ql, qr, lat, kr, sel):
  """Plain per-head log-sum-exp over the valid slots (-inf for none), and out, from gathered rows."""
  g = lambda x: jax.vmap(lambda xb, ib: xb[jnp.maximum(ib, 0)])(x, sel)  # [b, t, j, .]
  logits = (jnp.einsum("bthc,btjc->bthj", ql, g(lat)) + jnp.einsum("bthp,btjp->bthj", qr, g(kr))) * SCALE
  mask = (sel >= 0)[:, :, None, :]
  lse = jax.nn.logsumexp(jnp.where(mask, logits, -jnp.inf), axis=-1)
  p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  return jnp.einsum("bthj,btjc->bthc", p, g(lat)), lse


def test_lse_cotangent_in_backward():
  """The custom_vjp's second output (lse) has a correct gradient too (dlogit += p * dlse)."""
  b, t, h, c, p, s, k = 1, 4, 16, 16, 16, 19, 16
  ql, qr, lat, kr, idx, valid = _data(b, t, h, c, p, s, k, 6)
  sel = jnp.where(valid, idx, -1).astype(jnp.int32)
  geo = kernel.Geometry(batch=b, queries=t, keys=s, heads=h, real_heads=h, latent=c, rope=p, slots=k,
                         block_q=2, block_k=16, block_h=16, scale=SCALE, backend="triton", interpret=True)
  attn = ops._attention_fn(geo, 2)
  r1, r2 = jax.random.normal(jax.random.key(1), (b, t, h, c)), jax.random.normal(jax.random.key(2), (b, t, h))

  def loss(f, *a):
    out, lse = f(*a)
    lse = lse[..., 0] if lse.ndim == 4 else lse
    return jnp.sum(out * r1) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * r2, 0.0))

  mask = sel.reshape(b, t, 1, 1, k)
  got = jax.jit(jax.grad(lambda *a: loss(attn, *a, sel, mask), argnums=(0, 1, 2, 3)))(ql, qr, lat, kr)
  want = jax.jit(jax.grad(lambda *a: loss(_lse_reference, *a, sel), argnums=(0, 1, 2, 3)))(ql, qr, lat, kr)
  for name, g, w in zip(("dq_lat", "dq_rope", "dlatent", "dk_rope"), got, want, strict=True):
    assert_close(g, w, what=name)


@pytest.mark.parametrize("backend,interp", [("triton", True), ("tpu", pltpu.InterpretParams())])
def test_every_output_element_is_written(backend, interp):
  """Interpreters start outputs as NaN (TPU: all fresh memory); padded rows/heads must be written too.

  (The gradient kernels' outputs are checked by the tests above: an unwritten
  padded row would carry NaN into the scattered key gradients.)
  """
  b, t, h, c, p, s, k = 1, 8, 16, 16, 16, 19, 16
  ql, qr, lat, kr, idx, valid = _data(b, t, h, c, p, s, k, 8)
  sel = jnp.where(valid, idx, -1).astype(jnp.int32)
  mask = sel.reshape(b, t, 2, 1, 8)
  geo = kernel.Geometry(batch=b, queries=t, keys=s, heads=h, real_heads=h - 3, latent=c, rope=p, slots=k,
                        block_q=8, block_k=8, block_h=16, scale=SCALE, backend=backend, interpret=interp)

  @jax.jit
  def run(ql, qr, lat, kr, sel, mask):
    out, lse = kernel.forward(geo, ql, qr, lat, kr, sel, mask)
    return out, lse, kernel.probs(geo, ql, qr, lat, kr, sel, mask, lse)

  out, lse, probs = run(ql, qr, lat, kr, sel, mask)
  assert np.isfinite(np.asarray(out)).all() and not np.isnan(np.asarray(lse)).any()
  assert np.isfinite(np.asarray(probs)).all()


S = jax.ShapeDtypeStruct


def _structs(k, b=1, t=64, h=8, c=128, p=32, s=4096, dt=jnp.bfloat16):
  """A small-config-like DSA layer: 8 heads, latent 128 + RoPE 32, bf16."""
  return (S((b, t, h, c), dt), S((b, t, h, p), dt), S((b, s, c), dt), S((b, s, p), dt),
          S((b, t, k), jnp.int32), S((b, t, k), jnp.bool_))


@pytest.mark.parametrize("topk,t", [(64, 64), (2048, 64), (256, 1)])
@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("triton", "cuda")])
def test_lowers_for_tpu_and_cuda(backend, platform, topk, t):
  """jax.export for the device platform (Mosaic TPU custom call / Triton kernel), forward and backward.

  t=1 is a decode step (one query per row, batch 4).
  """
  fwd = lambda *a: ops.sparse_mqa_attention(*a, 0.1, 64, backend=backend, interpret=False)

  def bwd(ql, qr, lat, kr, idx, valid):
    loss = lambda *x: jnp.sum(fwd(*x, idx, valid)[0].astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2, 3))(ql, qr, lat, kr)

  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if platform == "cuda" else []
  marker = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
  for fn in (fwd, bwd):
    structs = _structs(topk, b=1 if t > 1 else 4, t=t)
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*structs)
    assert marker in exported.mlir_module()


def test_bad_arguments_raise_clear_errors():
  args = _data(1, 3, 2, 5, 3, 7, 4, 0)
  call = lambda *a, **kw: ops.sparse_mqa_attention(*a, **kw)
  ql, qr, lat, kr, idx, valid = args
  with pytest.raises(ValueError, match="q_rope must be"):
    call(ql, qr[:, :, :1], lat, kr, idx, valid, SCALE, 4)
  with pytest.raises(ValueError, match="latent must be"):
    call(ql, qr, lat[..., :2], kr, idx, valid, SCALE, 4)
  with pytest.raises(ValueError, match="idx and valid"):
    call(ql, qr, lat, kr, idx[:, :2], valid, SCALE, 4)
  with pytest.raises(ValueError, match="idx must be an integer"):
    call(ql, qr, lat, kr, idx.astype(jnp.float32), valid, SCALE, 4)
  with pytest.raises(ValueError, match="query_block"):
    call(*args, SCALE, 0)
  with pytest.raises(ValueError, match="backend"):
    call(*args, SCALE, 4, backend="cuda")
  with pytest.raises(ValueError, match="block_q=4 must be a multiple of 8"):
    call(*_data(1, 11, 2, 5, 3, 7, 4, 0), SCALE, 4, backend="tpu", block=ops.BlockSizes(4, 8))
  with pytest.raises(ValueError, match="power of two"):
    ops.BlockSizes(3, 8)
  with pytest.raises(ValueError, match="block_h"):
    ops.BlockSizes(8, 8, 12)
