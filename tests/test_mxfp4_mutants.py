"""MXFP4 format (pallas_kernels/mxfp4/format.py) and matmul wrappers (ops.py): behaviours the
mutation audit found unpinned by tests/test_mxfp4.py, each against values written out here (the OCP
MX v1.0 E2M1 table times the E8M0 scale 2^(byte - 127))."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp4 import format as fmt
from pallas_kernels.mxfp4 import ops

# E2M1 magnitudes of codes 0..7 (the spec's table); codes 8..15 are their negatives.
_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_nan_rounds_to_code_zero_whatever_its_sign():
  """E2M1 has no NaN: NaN (either sign bit) gives code 0, while -0.0 and small negatives give -0."""
  x = np.array([np.nan, -np.nan, -0.0, -0.2, 0.2], np.float32)
  np.testing.assert_array_equal(np.asarray(fmt.float_to_e2m1(x)), [0, 0, 8, 8, 0])


def test_decode_overflows_to_inf_only_past_the_f32_range():
  """Byte 254 (X = 2^127): 1.5 X is finite, 2 X = 2^128 and above are inf; byte 253 overflows
  from 4 X = 2^128 on. Neither byte is the NaN scale (only 0xFF is)."""
  codes = np.arange(16, dtype=np.uint8)
  inf = np.inf
  want_254 = np.array([0.0, 2.0 ** 126, 2.0 ** 127, 1.5 * 2.0 ** 127, inf, inf, inf, inf])
  want_253 = np.array([0.0, 2.0 ** 125, 2.0 ** 126, 1.5 * 2.0 ** 126, 2.0 ** 127, 1.5 * 2.0 ** 127, inf, inf])
  for byte, want in ((254, want_254), (253, want_253)):
    got = np.asarray(fmt.decode_e2m1_scaled(codes, np.full(16, byte, np.uint8))).astype(np.float64)
    np.testing.assert_array_equal(got, np.concatenate([want, -want]))
    assert not np.signbit(got[0]) and np.signbit(got[8])


def test_quantize_takes_the_most_negative_axis():
  """axis = -w.ndim is the first axis, as in numpy: same bytes as quantizing w.T along its last."""
  w = np.zeros((64, 2), np.float32)
  w[:, 0] = np.arange(64) % 8 - 3.0  # block maxima 4 -> X = 1: every value is exact
  w[:, 1] = 0.5
  blocks, scales = fmt.quantize(w, axis=-2)
  assert blocks.shape == (2, 2, 16) and scales.shape == (2, 2)
  np.testing.assert_array_equal(np.asarray(scales), [[127, 127], [124, 124]])  # 0.5 = 4 * 2^-3
  back = np.asarray(fmt.dequantize(blocks, scales))
  np.testing.assert_array_equal(back, w.T)


def test_packing_refuses_scalars_and_signed_or_wide_bytes():
  with pytest.raises(ValueError, match="even last dimension"):
    fmt.pack_e2m1(np.uint8(3))
  # int8 0xF0 is -16: its ">> 4" would sign-extend into a negative "code".
  for packed in (np.array([-16], np.int8), np.array([0x21], np.int32)):
    with pytest.raises(ValueError, match="packed must be uint8"):
      fmt.unpack_e2m1(packed)
  with pytest.raises(ValueError, match="packed must have at least one axis"):  # an IndexError before
    fmt.unpack_e2m1(np.uint8(0x21))


def test_dequantize_refuses_non_uint8_scales_and_short_block_rows():
  with pytest.raises(ValueError, match="must be uint8"):
    fmt.dequantize(np.zeros((2, 16), np.uint8), np.full((2,), 127, np.int32))
  with pytest.raises(ValueError, match=r"blocks must be \[\.\.\., K/32, 16\]"):
    fmt.dequantize(np.zeros((2, 8), np.uint8), np.full((2,), 127, np.uint8))


def test_nbytes_refuses_partial_blocks():
  assert fmt.mxfp4_nbytes(96) == 48 + 3
  with pytest.raises(ValueError, match="33 elements is not a multiple of 32"):
    fmt.mxfp4_nbytes(33)


# ---- wrappers (interpret mode) -------------------------------------------------------


def test_an_empty_contraction_gives_zeros_and_an_empty_gradient():
  """K = 0 (blocks [.., 0, 16], which quantize writes for an empty axis): x @ W^T is all zeros, as
  the dense maths, instead of a ZeroDivisionError from the tile sizes."""
  blocks, scales = np.zeros((2, 5, 0, 16), np.uint8), np.zeros((2, 5, 0), np.uint8)
  y = ops.mxfp4_ragged_matmul(jnp.ones((3, 0)), blocks, scales, jnp.array([1, 2]))
  assert y.shape == (3, 5)
  np.testing.assert_array_equal(np.asarray(y), 0.0)
  x = jnp.ones((2, 3, 0))
  loss = lambda x: jnp.sum(ops.mxfp4_matmul(x, blocks[0], scales[0]))
  assert ops.mxfp4_matmul(x, blocks[0], scales[0]).shape == (2, 3, 5)
  assert jax.grad(loss)(x).shape == (2, 3, 0)
  # No rows or no features: empty results too.
  one = np.full((1, 5, 1, 16), 0x22, np.uint8), np.full((1, 5, 1), 127, np.uint8)
  assert ops.mxfp4_ragged_matmul(jnp.ones((0, 32)), *one, jnp.array([0])).shape == (0, 5)
  no_features = ops.mxfp4_ragged_matmul(jnp.ones((3, 32)), one[0][:, :0], one[1][:, :0], jnp.array([3]))
  assert no_features.shape == (3, 0)


def _value_and_dx(fn, x, dy):
  """fn(x) and the gradient dy^T d fn / dx, in one jitted program (interpret mode runs much faster
  compiled than eagerly)."""
  def both(x, dy):
    y, vjp = jax.vjp(fn, x)
    return y, vjp(dy)[0]
  return jax.jit(both)(x, dy)


def _garbage_past_the_end(monkeypatch):
  """Interpret mode pads a partial block past an array's end with NaN (floats) and the integer
  minimum (0 for uint8, which decodes to 0 and hides a missing mask). Real hardware reads whatever
  lies there: make it 0xFF, the NaN scale byte and the -6 codes."""
  from jax._src.pallas import primitives
  plain = primitives.uninitialized_value

  def garbage(shape, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
      return jnp.full(shape, jnp.iinfo(dtype).max, dtype)
    return plain(shape, dtype)

  monkeypatch.setattr(primitives, "uninitialized_value", garbage)


def test_partial_weight_tiles_ignore_what_lies_past_the_array(monkeypatch):
  """'tpu' grid with K = 96 in tiles of 64 and N = 20 in tiles of 16: the last tiles overhang the
  codes and scales (forward along K, backward along N). y = x W^T and dx = dy W against W written
  out from the E2M1 table and the E8M0 scales."""
  _garbage_past_the_end(monkeypatch)
  rng = np.random.default_rng(21)
  n, k = 20, 96
  codes = rng.integers(0, 16, (n, k))
  scale_bytes = rng.integers(124, 130, (n, k // 32))
  table = np.array(_TABLE + [-v for v in _TABLE])
  w = table[codes] * 2.0 ** (np.repeat(scale_bytes, 32, axis=1) - 127)  # [N, K]
  blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).reshape(n, k // 32, 16)
  x = rng.standard_normal((8, k)).astype(np.float32)
  dy = rng.standard_normal((8, n)).astype(np.float32)
  fn = lambda x: ops.mxfp4_matmul(x, blocks, scale_bytes.astype(np.uint8), backend="tpu",
                                  block=ops.BlockSizes(8, 16, 64), interpret=True)
  y, dx = _value_and_dx(fn, x, dy)
  np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(dx), dy.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def test_backward_keeps_a_float32_cotangent_for_bfloat16_x():
  """bf16 x with f32 outputs: dy arrives in f32 and the backward computes in f32 before the cast
  to bf16. W rows are all 1.0 (code 2, scale 127) and dy = (1 + 2^-10, -1): dx = 2^-10, which a
  dy rounded to bf16 (1 + 2^-10 -> 1) would turn into 0."""
  blocks = np.full((2, 1, 16), 0x22, np.uint8)
  scales = np.full((2, 1), 127, np.uint8)
  fn = lambda x: ops.mxfp4_matmul(x, blocks, scales, preferred_element_type=jnp.float32,
                                  backend="tpu", interpret=True)
  dy = jnp.array([[1.0 + 2.0 ** -10, -1.0]], jnp.float32)
  y, dx = _value_and_dx(fn, jnp.ones((1, 32), jnp.bfloat16), dy)
  assert y.dtype == jnp.float32 and dx.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y), [[32.0, 32.0]])
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.full((1, 32), 2.0 ** -10))


def _structs(m=37, g=2, n=45, k=96):
  s = jax.ShapeDtypeStruct
  return (s((m, k), jnp.bfloat16), s((g, n, k // 32, 16), jnp.uint8), s((g, n, k // 32), jnp.uint8),
          s((g,), jnp.int32))


def test_compiled_tpu_tiles_may_span_a_whole_odd_dimension():
  """Default TPU tiles clipped to 37 rows, 45 features and K = 96: whole dimensions, so Mosaic's
  (8, 128) rule does not apply (traced only; nothing is lowered)."""
  fn = lambda *a: ops.mxfp4_ragged_matmul(*a, backend="tpu", interpret=False)
  out = jax.eval_shape(fn, *_structs())
  assert out.shape == (37, 45) and out.dtype == jnp.bfloat16


def test_compiled_gpu_tiles_are_powers_of_two_from_16():
  fn = lambda *a: ops.mxfp4_ragged_matmul(*a, backend="gpu", interpret=False,
                                          block=ops.BlockSizes(8, 16, 32))
  with pytest.raises(ValueError, match="block_m=8 must be a power of two >= 16"):
    jax.eval_shape(fn, *_structs())
  # Clipped to the next power of two of each dimension, at least (16, 16, 32).
  assert ops._tile_sizes(ops.BlockSizes(64, 64, 128), "gpu", 5, 32, 64, False) == (16, 32, 64)
  assert ops._tile_sizes(ops.BlockSizes(64, 64, 128), "gpu", 100, 33, 1000, False) == (64, 64, 128)
  assert ops._tile_sizes(ops.BlockSizes(64, 64, 128), "tpu", 5, 33, 1000, True) == (5, 33, 128)


@pytest.mark.parametrize("platform, want", [("gpu", ("gpu", False)), ("tpu", ("tpu", False)),
                                            ("cpu", ("tpu", True))])
def test_backend_and_interpret_follow_the_platform(monkeypatch, platform, want):
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  assert ops._resolve(None, None) == want
  assert ops._resolve("gpu", True) == ("gpu", True)


def test_wrapper_refuses_float_group_sizes_no_groups_and_empty_tiles():
  x, blocks, scales, _ = _structs()
  with pytest.raises(ValueError, match="group_sizes must be an int array"):
    jax.eval_shape(ops.mxfp4_ragged_matmul, x, blocks, scales, jax.ShapeDtypeStruct((2,), jnp.float32))
  with pytest.raises(ValueError, match="groups >= 1"):
    jax.eval_shape(ops.mxfp4_ragged_matmul, *_structs(g=0))
  with pytest.raises(ValueError, match="block_m=0 must be a positive int"):
    ops.BlockSizes(block_m=0)
