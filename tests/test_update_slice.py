"""model.layers.update_slice / to_bits / from_bits: 16-bit float writes moved as uint16 bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.layers import from_bits, to_bits, update_slice


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_update_slice_is_dynamic_update_slice_where_not_kept(dtype):
  """The bits of `dynamic_update_slice(buf, where(keep_old, old, new), start)` (new cast to buf's
  dtype, the start clamped as lax clamps it), with no f32 copy of a 16-bit buffer in the program."""
  rng = np.random.default_rng(7)
  buf = jnp.asarray(rng.standard_normal((29, 13)), dtype)
  new = jnp.asarray(rng.standard_normal((6, 13)), jnp.float32)
  keep = jnp.asarray(rng.random((6, 1)) < 0.4)

  def plain(b, n, start, k):
    old = jax.lax.dynamic_slice(b, (start, 0), n.shape)
    return jax.lax.dynamic_update_slice(b, jnp.where(k, old, n.astype(b.dtype)), (start, 0))

  def ours(b, n, start, k):
    return update_slice(b, n, (start, 0), keep_old=k)
  for start in (0, 11, 23, 27):  # 27: past the end, clamped to 23
    want = jax.jit(plain)(buf, new, jnp.int32(start), keep)
    got = jax.jit(ours)(buf, new, jnp.int32(start), keep)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(to_bits(got)), np.asarray(to_bits(want)))
  assert not np.array_equal(np.asarray(got, np.float32), np.asarray(buf, np.float32))
  np.testing.assert_array_equal(jax.jit(update_slice)(buf, new, (jnp.int32(3), 0)),
                                jax.lax.dynamic_update_slice(buf, new.astype(dtype), (3, 0)))
  hlo = jax.jit(ours).lower(buf, new, jnp.int32(0), keep).compile().as_text()
  assert ("f32[29,13]" in hlo) == (dtype == jnp.float32), "a 16-bit buffer was written through f32"


def test_bits_round_trip():
  x = jnp.asarray([1.5, -0.0, jnp.inf, jnp.nan, 3e-41], jnp.float32)
  for dtype in (jnp.bfloat16, jnp.float16):
    y = x.astype(dtype)
    assert to_bits(y).dtype == jnp.uint16
    back = from_bits(to_bits(y), dtype)
    assert back.dtype == dtype
    np.testing.assert_array_equal(np.asarray(back, np.float32), np.asarray(y, np.float32))
  assert to_bits(x) is x and from_bits(x, jnp.float32) is x
  assert to_bits(jnp.arange(3)).dtype == jnp.int32
