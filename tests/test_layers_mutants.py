"""model/layers.py, found unpinned by a mutation audit: the prefix-mask check, the norm's eps and
scale, RoPE's angles and halves, einsum's rounding of its operands to the compute dtype, which specs
take the custom backward, parameter initialisation and the key stream were pinned only through
whole-model tests (or not at all). Each reference is written out here."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.layers import (
  MLP,
  KeyGen,
  RMSNorm,
  _transposable,
  apply_rope,
  check_prefix_mask,
  einsum,
  einsum_f32,
  maybe_remat,
  param,
  rms_norm,
  rope_frequencies,
  swiglu,
)


def test_check_prefix_mask():
  ok = np.asarray([[True, True, False], [False, False, False], [True, True, True], [True, False, False]])
  check_prefix_mask(jnp.asarray(ok), "x")
  for bad in ([[True, False, True]], [[False, True, True]], [[True, True, False], [False, False, True]]):
    with pytest.raises(ValueError, match="who: valid must be a prefix mask"):
      check_prefix_mask(jnp.asarray(bad), "who")
  jax.jit(lambda v: check_prefix_mask(v, "x"))(jnp.asarray([[False, True]]))  # traced: not checked


def test_rms_norm_eps_and_scale():
  x = jnp.asarray([[3.0, 4.0], [1.0, 0.0]])
  got = rms_norm(x, jnp.asarray([1.0, -2.0]), 0.5)
  want = [[3 / math.sqrt(13), -8 / math.sqrt(13)], [1 / math.sqrt(1.0), 0.0]]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(rms_norm(x, None, 0.0), [[3 / math.sqrt(12.5), 4 / math.sqrt(12.5)],
                                                      [math.sqrt(2), 0.0]], rtol=1e-6)
  assert rms_norm(x.astype(jnp.bfloat16), None, 0.0).dtype == jnp.bfloat16
  norm = RMSNorm(2, 0.5, rngs=None)
  np.testing.assert_array_equal(norm.scale[...], [1.0, 1.0])
  np.testing.assert_allclose(norm(x), [[3 / math.sqrt(13), 4 / math.sqrt(13)], [1.0, 0.0]], rtol=1e-6)


def test_rope_rotates_half_pairs_by_position_times_frequency():
  np.testing.assert_allclose(rope_frequencies(4, 100.0), [1.0, 0.1], rtol=1e-6)
  x = jnp.asarray([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
  got = apply_rope(jnp.concatenate([x, x], 1), jnp.asarray([[0, 2]]), 100.0)
  c0, s0, c1, s1 = math.cos(2.0), math.sin(2.0), math.cos(0.2), math.sin(0.2)
  want = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1]
  np.testing.assert_allclose(got[0, 0, 0], [1.0, 2.0, 3.0, 4.0], rtol=1e-6)  # position 0: unchanged
  np.testing.assert_allclose(got[0, 1, 0], want, rtol=1e-5, atol=1e-6)
  # [b, t, k] (no head axis) takes the same angles.
  got = apply_rope(x[:, :, 0], jnp.asarray([[2]]), 100.0)
  assert apply_rope(x.astype(jnp.bfloat16), jnp.asarray([[2]]), 100.0).dtype == jnp.bfloat16
  np.testing.assert_allclose(got[0, 0], want, rtol=1e-5, atol=1e-6)


def test_einsum_rounds_its_operands_to_the_compute_dtype():
  """x = [1 + 2^-9, -1] . [1, 1]: exactly 2^-9 in f32, 0 once 1 + 2^-9 is rounded to bf16 (to 1)."""
  x = jnp.asarray([[1 + 2.0 ** -9, -1.0]])
  w = jnp.ones((2, 1))
  got = einsum("bd,df->bf", x, w, jnp.bfloat16)
  assert got.dtype == jnp.bfloat16 and float(got[0, 0]) == 0.0
  got = einsum("bd,df->bf", w.T, x.T, jnp.bfloat16)  # the weight is rounded too
  assert float(got[0, 0]) == 0.0
  got = einsum("bd,df->bf", x, w, jnp.float32)
  assert got.dtype == jnp.float32 and float(got[0, 0]) == 2.0 ** -9
  y, vjp = jax.vjp(lambda x, w: einsum("bd,df->bf", x, w, jnp.bfloat16), x, w)
  dx, dw = vjp(jnp.asarray([[1 + 2.0 ** -9]], jnp.bfloat16))  # the cotangent rounds to 1 as well
  np.testing.assert_array_equal(dx, [[1.0, 1.0]])
  np.testing.assert_array_equal(dw, [[1.0], [-1.0]])  # x rounded: [1, -1]


@pytest.mark.parametrize("spec,want", [
    ("btd,df->btf", True), ("btd,btf->df", True), ("bthk,bshk->bhts", True),
    ("...d,df->...f", False), ("btd,df", False), ("bii,ij->bj", False), ("bd,dd->bd", False),
    ("btd,df->bf", False), ("bd,df->bdf", True), ("bd,d,d->b", False), ("bd,df->b", False)])
def test_which_specs_take_the_custom_backward(spec, want):
  assert _transposable(spec) is want


def test_untransposable_reduction_still_differentiates():
  """btd,df->bf sums over t, which neither gradient einsum could produce: the plain path's gradient."""
  x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(1, 3, 4) / 8)
  w = jnp.asarray(np.arange(8, dtype=np.float32).reshape(4, 2) / 4)
  dx, dw = jax.grad(lambda x, w: jnp.sum(einsum("btd,df->bf", x, w, jnp.bfloat16).astype(jnp.float32)),
                    (0, 1))(x, w)
  np.testing.assert_allclose(dx, np.broadcast_to(np.asarray(w).sum(1), (1, 3, 4)), rtol=1e-6)
  np.testing.assert_allclose(dw, np.broadcast_to(np.asarray(x).sum((0, 1))[:, None], (4, 2)), rtol=1e-6)


def test_param_init_and_axes():
  rngs = KeyGen(jax.random.key(0))
  p = param(rngs, (400, 300), ("embed", "mlp"), jnp.float32)
  assert p.axes == ("embed", "mlp") and p[...].dtype == jnp.float32
  assert abs(float(jnp.std(p[...])) - 1 / 20) < 0.05 / 20  # std 1/sqrt(fan_in = shape[0])
  assert abs(float(jnp.std(param(rngs, (400, 300), (None, None), jnp.float32, fan_in=100, scale=2.0)[...]))
             - 0.2) < 0.2 / 20
  assert abs(float(jnp.std(param(rngs, (400, 300), (None, None), jnp.float32, init="normal", scale=0.5)[...]))
             - 0.5) < 0.5 / 20
  ones = param(rngs, (2, 3), ("a", "b"), jnp.bfloat16, init="ones")[...]
  np.testing.assert_array_equal(ones, np.ones((2, 3)))
  np.testing.assert_array_equal(param(rngs, (2,), ("a",), jnp.float32, init="zeros")[...], [0.0, 0.0])
  assert param(rngs, (2, 3), ("a", "b"), jnp.bfloat16)[...].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="1 axis names"):
    param(rngs, (2, 3), ("a",), jnp.float32)


@pytest.mark.parametrize("key_of, dtype, std", [
    (jax.random.key, jnp.float32, 0.37), (jax.random.PRNGKey, jnp.bfloat16, 1.3)], ids=["typed", "raw"])
def test_eager_init_draws_are_the_direct_draws(key_of, dtype, std, monkeypatch):
  """Eager parameters come from a power-of-two flat draw, sliced (one compile per size bucket): the
  values are jax.random.normal's for the shape, bit for bit, scaled and cast, for odd shapes (1
  element, an exact power of two, one past it); traced draws and draws above the bucket limit take
  the direct path. (Each shape compiles a draw: few shapes keep the test fast.)"""
  from model import layers
  calls = []
  flat = layers._flat_normal
  monkeypatch.setattr(layers, "_flat_normal", lambda k, n: calls.append(n) or flat(k, n))
  for i, shape in enumerate([(1,), (8,), (9,), (3, 5), (17, 3, 5)]):
    key = key_of(i)
    want = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    got = layers._normal(key, shape, std, dtype)
    assert got.shape == shape and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert calls == [1, 8, 16, 16, 256]  # the eager calls only
  # Traced, XLA may fold std into the draw's last multiply (1 ulp from the eager values, as before).
  traced = jax.jit(layers._normal, static_argnums=(1, 3))(key, shape, std, dtype)
  direct = jax.jit(lambda k, s: (s * jax.random.normal(k, shape, jnp.float32)).astype(dtype))(key, std)
  np.testing.assert_array_equal(np.asarray(traced, np.float32), np.asarray(direct, np.float32))
  assert calls == [1, 8, 16, 16, 256]
  monkeypatch.setattr(layers, "_BUCKET_MAX_ELEMENTS", 8)
  np.testing.assert_array_equal(layers._normal(key_of(0), (3, 3), 2.0, jnp.float32),
                                2.0 * jax.random.normal(key_of(0), (3, 3), jnp.float32))
  assert len(calls) == 5


def test_keygen_is_fold_in_of_a_counter():
  key = jax.random.key(7)
  gen = KeyGen(key)
  for i in range(3):
    np.testing.assert_array_equal(jax.random.key_data(gen.params()),
                                  jax.random.key_data(jax.random.fold_in(key, i)))


def test_swiglu_and_mlp_use_gate_up_down_in_their_places():
  x = jnp.asarray([[[1.0, -2.0]]])
  wg, wu, wd = jnp.asarray([[1.0], [0.5]]), jnp.asarray([[2.0], [-1.0]]), jnp.asarray([[3.0, -1.0]])
  # x Wg = 0 (silu 0), x Wu = 4: the output is 0; with gate and up swapped it is not.
  np.testing.assert_allclose(swiglu(x, wg, wu, wd, jnp.float32), [[[0.0, 0.0]]], atol=1e-7)
  x = jnp.asarray([[[2.0, 0.0]]])
  g, u = 2.0, 4.0
  silu = g / (1 + math.exp(-g))
  np.testing.assert_allclose(swiglu(x, wg, wu, wd, jnp.float32), [[[3 * silu * u, -silu * u]]], rtol=1e-6)
  mlp = MLP(2, 1, rngs=KeyGen(jax.random.key(0)), param_dtype=jnp.float32, dtype=jnp.float32)
  mlp.w_gate[...], mlp.w_up[...], mlp.w_down[...] = wg, wu, wd
  np.testing.assert_allclose(mlp(x), [[[3 * silu * u, -silu * u]]], rtol=1e-6)
  assert mlp.w_down.axes == ("mlp", "embed") and mlp.w_gate.axes == ("embed", "mlp")


def test_maybe_remat_policies():
  f = lambda x: x * 2  # noqa: E731
  assert maybe_remat(f, "none") is f
  for policy in ("full", "save_dots"):
    assert maybe_remat(f, policy) is not f
  with pytest.raises(ValueError, match="unknown remat policy 'fast'"):
    maybe_remat(f, "fast")


def test_f32_result_einsum_rounds_cotangent_and_keeps_each_operands_dtype():
  """einsum_f32: g = [1 + 2^-9, -1] rounds to [1, -1] for the backward product, so dx = g . [1, 1] is 0
  (2^-9 unrounded); an f32 second operand gets an f32 gradient."""
  x, y = jnp.asarray([[1.0]], jnp.bfloat16), jnp.asarray([[1.0, 1.0]], jnp.bfloat16)
  _, vjp = jax.vjp(lambda x, y: einsum_f32("bd,df->bf", x, y), x, y)
  dx, _ = vjp(jnp.asarray([[1 + 2.0 ** -9, -1.0]], jnp.float32))
  assert dx.dtype == jnp.bfloat16 and float(dx[0, 0]) == 0.0
  _, vjp = jax.vjp(lambda x, y: einsum_f32("bd,df->bf", x, y), x, y.astype(jnp.float32))
  assert vjp(jnp.ones((1, 2), jnp.float32))[1].dtype == jnp.float32
  # The plain path (an untransposable spec) also rounds y to x's dtype: 1 + 2^-9 -> 1.
  x, y = jnp.asarray([1.0, -1.0], jnp.bfloat16), jnp.asarray([1 + 2.0 ** -9, 1.0])
  got = einsum_f32("...d,...d->...", x, y)
  assert got.dtype == jnp.float32 and float(got) == 0.0
