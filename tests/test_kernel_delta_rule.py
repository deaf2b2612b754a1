"""Pallas gated delta rule (pallas_kernels/delta_rule) vs the XLA chunked and naive references.

Interpret mode on CPU: forward and every gradient on random f32 inputs with odd sizes (t not a
multiple of the chunk, odd head dims), two chunk sizes and launch settings (one with several
time blocks and the GPU's padded head dims), segment resets (inside chunks, on chunk starts,
back to back) and an initial state. The interpreter fills outputs with NaN before the kernel
runs (checked below), so any element a kernel leaves unwritten fails assert_close's finiteness
check. Lowering: jax.export for TPU (Mosaic) and CUDA (Triton, with the Triton module verified)
at the small config's shapes, forward and backward.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from model.attention.delta_rule import chunk_gated_delta_rule as xla_chunk_rule
from pallas_kernels.delta_rule import BlockSizes, chunk_gated_delta_rule
from pallas_kernels.delta_rule import reference as ref
from tests.helpers import assert_close

B, T, H, KD, VD = 2, 19, 3, 5, 7
ARGS = ("q", "k", "v", "g", "beta", "initial_state")
SETTINGS = {
    "c4": (4, None),
    "c8_blocks_padded": (8, BlockSizes(time_block=16, pad_head_dims=True)),
}


def _inputs(seed: int = 0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, H, KD), np.float32)
  k = rng.standard_normal((B, T, H, KD), np.float32)
  q = q / np.linalg.norm(q, axis=-1, keepdims=True) * KD ** -0.5
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((B, T, H, VD), np.float32)
  g = -rng.uniform(0.01, 0.5, (B, T, H)).astype(np.float32)
  beta = rng.uniform(0.1, 0.95, (B, T, H)).astype(np.float32)
  s0 = rng.standard_normal((B, H, KD, VD), np.float32)
  reset = np.zeros((B, T), bool)
  reset[0, [6, 8, 13]] = True  # inside a chunk, on a chunk start (c = 4 and 8), inside again
  reset[1, [3, 4, 17]] = True  # back to back, and in the last partial chunk
  weights = (rng.standard_normal((B, T, H, VD), np.float32), rng.standard_normal((B, H, KD, VD), np.float32))
  return tuple(jnp.asarray(x) for x in (q, k, v, g, beta, s0)), jnp.asarray(reset), weights


def _value_and_grads(rule, xs, reset, weights, jit=True):
  """(o, final) and the gradients w.r.t. q, k, v, g, beta, initial_state of a random linear loss."""
  def loss(*a):
    o, final = rule(*a, reset)
    return jnp.sum(o * weights[0]) + jnp.sum(final * weights[1]), (o, final)

  fn = jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)
  (_, out), grads = (jax.jit(fn) if jit else fn)(*xs)
  return out, grads


@pytest.fixture(scope="module")
def case():
  return _inputs()


@pytest.fixture(scope="module")
def reference(case):
  xs, reset, weights = case
  return _value_and_grads(lambda *a: xla_chunk_rule(*a, chunk_size=4), xs, reset, weights)


@pytest.fixture(scope="module")
def naive(case):
  xs, reset, weights = case
  # Eager: the per-token loop compiles op by op faster than as one unrolled program.
  return _value_and_grads(ref.naive_gated_delta_rule, xs, reset, weights, jit=False)


@pytest.fixture(scope="module", params=list(SETTINGS))
def kernel_result(request, case):
  xs, reset, weights = case
  c, block = SETTINGS[request.param]
  out = _value_and_grads(lambda *a: chunk_gated_delta_rule(*a, chunk_size=c, block=block), xs, reset,
                         weights)
  return request.param, out


def test_interpret_mode_poisons_unwritten_outputs():
  """Negative control for the finiteness checks: an output the kernel never writes is NaN."""
  def kernel(x_ref, o_ref, p_ref):
    o_ref[...] = x_ref[...]
    del p_ref  # never written

  x = jnp.ones((8, 16), jnp.float32)
  out, poisoned = pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2,
                                 interpret=True)(x)
  assert np.all(np.asarray(out) == 1.0) and np.all(np.isnan(np.asarray(poisoned)))


def test_forward_matches_references(kernel_result, reference, naive):
  name, ((o, final), _) = kernel_result
  (o_ref, final_ref), _ = reference
  (o_naive, final_naive), _ = naive
  assert o.shape == (B, T, H, VD) and o.dtype == jnp.float32 and final.dtype == jnp.float32
  assert_close(o, o_ref, what=f"{name}: o vs chunked reference")
  assert_close(final, final_ref, what=f"{name}: final state vs chunked reference")
  assert_close(o, o_naive, what=f"{name}: o vs naive")
  assert_close(final, final_naive, what=f"{name}: final state vs naive")


@pytest.mark.parametrize("arg", range(len(ARGS)), ids=ARGS)
def test_gradients_match_references(kernel_result, reference, naive, arg):
  name, (_, grads) = kernel_result
  _, grads_ref = reference
  _, grads_naive = naive
  assert float(jnp.linalg.norm(grads_ref[arg])) > 0.0, "the reference gradient must not vanish"
  assert_close(grads[arg], grads_ref[arg], what=f"{name}: d{ARGS[arg]} vs chunked reference")
  assert_close(grads[arg], grads_naive[arg], what=f"{name}: d{ARGS[arg]} vs naive")


def test_defaults_and_low_precision_values(case):
  """No initial state, no resets, bf16 values: same results (in v's dtype) as the reference."""
  (q, k, v, g, beta, _), _, _ = case
  v = v.astype(jnp.bfloat16)
  o, final = jax.jit(lambda *a: chunk_gated_delta_rule(*a, chunk_size=8))(q, k, v, g, beta)
  o_ref, final_ref = jax.jit(lambda *a: xla_chunk_rule(*a, chunk_size=8))(q, k, v, g, beta)
  assert o.dtype == jnp.bfloat16
  assert_close(o.astype(jnp.float32), o_ref.astype(jnp.float32), dtype="bfloat16", what="o")
  assert_close(final, final_ref, what="final state")


# ---- bad arguments -----------------------------------------------------------------------------

def _bad_call(**over):
  (q, k, v, g, beta, s0), reset, _ = _inputs()
  kw = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, reset=reset, chunk_size=4)
  kw.update(over)
  return chunk_gated_delta_rule(**kw)


@pytest.mark.parametrize("over, match", [
    (dict(q=jnp.zeros((B, T, KD))), "q must be"),
    (dict(k=jnp.zeros((B, T, H, KD + 1))), "k has shape"),
    (dict(v=jnp.zeros((B, T + 1, H, VD))), "v has shape"),
    (dict(g=jnp.zeros((B, T))), "g has shape"),
    (dict(beta=jnp.zeros((B, T, H + 1))), "beta has shape"),
    (dict(initial_state=jnp.zeros((B, H, VD, KD))), "initial_state has shape"),
    (dict(reset=jnp.zeros((B, T + 1), bool)), "reset has shape"),
    (dict(reset=jnp.zeros((B, T), jnp.float32)), "reset has dtype"),
    (dict(q=jnp.zeros((B, T, H, KD), jnp.int32)), "q has dtype"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(block="big"), "block="),
    (dict(block=BlockSizes(time_block=6)), "block.time_block=6"),
    (dict(interpret="yes"), "interpret="),
    (dict(interpret=False, chunk_size=12), "chunk_size=12 must be a power of two"),
])
def test_bad_arguments(over, match):
  with pytest.raises(ValueError, match=match):
    _bad_call(**over)


@pytest.mark.parametrize("kw, match", [
    (dict(time_block=0), "time_block=0"),
    (dict(pad_head_dims="yes"), "pad_head_dims="),
    (dict(num_warps=3), "num_warps=3"),
    (dict(num_stages=0), "num_stages=0"),
])
def test_bad_block_sizes(kw, match):
  with pytest.raises(ValueError, match=match):
    BlockSizes(**kw)


# ---- lowering for TPU (Mosaic) and CUDA (Triton) ----------------------------------------------

def _small_shapes():
  from configs import horizon
  m = horizon.get_config("small").model
  b, t, h, kd, vd = 1, m.max_seq_len, m.delta_v_heads, m.delta_qk_dim, m.delta_v_dim
  s = jax.ShapeDtypeStruct
  f32 = jnp.float32
  shapes = (s((b, t, h, kd), f32), s((b, t, h, kd), f32), s((b, t, h, vd), f32), s((b, t, h), f32),
            s((b, t, h), f32), s((b, h, kd, vd), f32), s((b, t), jnp.bool_))
  return shapes, m.delta_chunk_size


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_exports(platform, direction, monkeypatch):
  shapes, c = _small_shapes()

  def fwd(q, k, v, g, beta, s0, reset):
    return chunk_gated_delta_rule(q, k, v, g, beta, s0, reset, c, interpret=False)

  def bwd(q, k, v, g, beta, s0, reset):
    def loss(*a):
      o, final = fwd(*a, reset)
      return jnp.sum(o) + jnp.sum(final)
    return jax.grad(loss, argnums=tuple(range(6)))(q, k, v, g, beta, s0)

  verified = []
  if platform == "cuda":
    # Verify each Triton module (power-of-two tensor sizes, dot operand types) as it is built.
    from jax._src.pallas.triton import pallas_call_registration as triton_reg
    build = triton_reg.lowering.lower_jaxpr_to_triton_module

    def build_and_verify(*a, **kw):
      result = build(*a, **kw)
      verified.append(result.module.operation.verify())
      return result

    monkeypatch.setattr(triton_reg.lowering, "lower_jaxpr_to_triton_module", build_and_verify)
  checks = ([jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
            if platform == "cuda" else [])
  fn = fwd if direction == "fwd" else bwd
  exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*shapes)
  text = exported.mlir_module()
  # The gradient needs the state recompute and the reverse pass (the unused forward is dropped).
  names = {"fwd": {"gated_delta_rule_fwd"}, "bwd": {"gated_delta_rule_fwd", "gated_delta_rule_bwd"}}
  assert set(re.findall(r"gated_delta_rule_(?:fwd|bwd)", text)) == names[direction]
  if platform == "tpu":
    assert "tpu_custom_call" in text
  else:
    assert len(verified) == len(names[direction]) and all(verified)
    assert "__gpu$xla.gpu.triton" in text
