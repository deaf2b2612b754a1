"""MXFP4 format (OCP MX v1.0, gpt-oss layout) and the Pallas MXFP4 matmul kernels.

Format tests compare with numpy / ml_dtypes (which, unlike XLA:CPU, keep f32
subnormals). Kernel tests run both grid strategies ('tpu' Mosaic-style and
'gpu' Triton-style) in interpret mode against reference.py, forward and the
gradient w.r.t. x, on odd shapes with an empty group and rows past the last
group. Interpret mode fills every output and scratch buffer with NaN before the
kernel runs (checked below), and assert_close rejects non-finite values, so an
element the kernel never writes fails the test. Lowering is checked with
jax.export for TPU (Mosaic) and CUDA (Triton) at the `small` config's expert
shapes, forward and backward.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.mxfp4 import format as fmt
from pallas_kernels.mxfp4 import kernel, ops, reference
from tests.helpers import assert_close

# ---- format ----------------------------------------------------------------------


def _np_quantize_dequantize(w: np.ndarray, mode: str) -> np.ndarray:
  """Independent float64 model of the spec's conversion (ml_dtypes rounds the elements)."""
  blocks = w.astype(np.float64).reshape(-1, fmt.BLOCK)
  out = np.empty_like(blocks)
  for i, b in enumerate(blocks):
    amax = np.max(np.abs(b))
    if amax == 0:
      e = -127
    elif mode == "floor":
      e = int(np.floor(np.log2(amax))) - 2
    else:
      e = int(np.ceil(np.log2(amax / 6.0)))
    e = min(max(e, -127), 127)
    y = (b / 2.0 ** e).astype(np.float32).astype(ml_dtypes.float4_e2m1fn)
    out[i] = y.astype(np.float64) * 2.0 ** e
  return out.reshape(w.shape)


def test_hand_built_bytes_decode_to_known_values():
  blocks = np.zeros((4, 16), np.uint8)
  blocks[0, :8] = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]  # low nibble first
  blocks[1, :] = 0x7F  # low F = -6, high 7 = +6
  blocks[2, 0] = 0x21  # 0.5 and 1.0 at the smallest scale
  blocks[3, :] = 0x11
  scales = np.array([127, 130, 0, 0xFF], np.uint8)  # X = 1, 8, 2^-127, NaN
  got = np.asarray(fmt.dequantize(blocks, scales)).astype(np.float64)  # [K = 128]
  got = got.reshape(4, 32)
  want = np.zeros((4, 32))
  want[0, :16] = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
  want[1] = np.tile([-48.0, 48.0], 16)
  want[2, :2] = [2.0 ** -128, 2.0 ** -127]
  np.testing.assert_array_equal(got[:3].reshape(-1), want[:3].reshape(-1))
  assert np.all(np.isnan(got[3]))
  assert np.signbit(got[0, 8]) and got[0, 8] == 0  # code 8 is -0


def test_every_e2m1_code_matches_ml_dtypes():
  codes = np.arange(16, dtype=np.uint8)
  want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  got = np.asarray(fmt.e2m1_to_float(codes))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, fmt.E2M1_VALUES)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_round_to_nearest_even_matches_ml_dtypes():
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  eps = np.float32(1e-6)
  ties = np.concatenate([mids, mids - eps, mids + eps, [6.0, 6.5, 7.0, 1e30, np.inf, 1e-40, 0.0]])
  rng = np.random.default_rng(1)
  v = np.concatenate([ties, -ties, rng.uniform(-8, 8, 4001)]).astype(np.float32)
  want = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
  got = np.asarray(fmt.float_to_e2m1(v))
  np.testing.assert_array_equal(got, want)


def test_pack_unpack_exact_round_trip():
  rng = np.random.default_rng(2)
  codes = rng.integers(0, 16, (3, 5, 64), dtype=np.uint8)
  packed = fmt.pack_e2m1(codes)
  assert packed.shape == (3, 5, 32) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(fmt.unpack_e2m1(packed)), codes)
  np.testing.assert_array_equal(np.asarray(fmt.pack_e2m1(np.array([1, 2, 15, 0]))), [0x21, 0x0F])
  everything = np.arange(256, dtype=np.uint8)
  np.testing.assert_array_equal(np.asarray(fmt.pack_e2m1(fmt.unpack_e2m1(everything))), everything)
  with pytest.raises(ValueError, match="even last dimension"):
    fmt.pack_e2m1(np.zeros((3,), np.uint8))


@pytest.mark.parametrize("mode", fmt.MODES)
def test_quantize_matches_spec_model(mode):
  rng = np.random.default_rng(3)
  rows = [rng.standard_normal(64) * s for s in (1.0, 3e-3, 1e25, 1e-38, 1e-42)]
  rows.append(rng.standard_t(3, 64))
  w = np.stack(rows).astype(np.float32)  # blocks of normal, huge, tiny and subnormal values
  blocks, scales = fmt.quantize(w, mode=mode)
  assert blocks.shape == (6, 2, 16) and scales.shape == (6, 2)
  got = np.asarray(fmt.dequantize(blocks, scales)).astype(np.float64)
  np.testing.assert_array_equal(got, _np_quantize_dequantize(w, mode))


@pytest.mark.parametrize("mode", fmt.MODES)
def test_quantize_error_bounds(mode):
  w = np.random.default_rng(4).standard_normal((16, 256)).astype(np.float32)
  blocks, scales = fmt.quantize(w, mode=mode)
  q = np.asarray(fmt.dequantize(blocks, scales)).astype(np.float64).reshape(16, 8, 32)
  x = 2.0 ** (np.asarray(scales, np.float64) - 127)[..., None]  # [16, 8, 1]
  v = w.astype(np.float64).reshape(16, 8, 32)
  amax = np.max(np.abs(v), axis=-1, keepdims=True)
  inside = np.abs(v) <= 6 * x
  # Half the widest E2M1 gap (4 -> 6) is one scale step.
  assert np.all(np.abs(v - q)[inside] <= x.repeat(32, -1)[inside])
  if mode == "ceil":
    assert np.all(inside) and np.all(amax <= 6 * x) and np.all(amax > 3 * x)
  else:
    assert np.all((amax >= 4 * x) & (amax < 8 * x))
    np.testing.assert_array_equal(q[~inside], np.sign(v[~inside]) * 6 * x.repeat(32, -1)[~inside])
  rel = np.linalg.norm(v - q) / np.linalg.norm(v)
  assert 0.05 < rel < 0.15, rel  # ~4-bit precision, not garbage and not lossless


def test_floor_saturates_and_ceil_does_not():
  w = np.full((2, 32), 1.0, np.float32)
  w[0, 0] = 7.0  # significand 1.75 > 1.5: the modes differ
  w[1, 0] = 5.0  # significand 1.25: they agree
  bf, sf = fmt.quantize(w, mode="floor")
  bc, sc = fmt.quantize(w, mode="ceil")
  qf = np.asarray(fmt.dequantize(bf, sf))
  qc = np.asarray(fmt.dequantize(bc, sc))
  np.testing.assert_array_equal(np.asarray(sf).ravel(), [127, 127])  # X = 2^(floor(log2 7) - 2) = 1
  np.testing.assert_array_equal(np.asarray(sc).ravel(), [128, 127])  # X = 2^ceil(log2(7/6)) = 2
  assert qf[0, 0] == 6.0 and qf[0, 1] == 1.0  # 7 saturates to 6 X
  assert qc[0, 0] == 8.0 and qc[0, 1] == 1.0  # 7/2 = 3.5 ties to even 4 -> 8
  np.testing.assert_array_equal(qf[1], qc[1])
  assert qf[1, 0] == 4.0  # 5 is a tie between 4 and 6: even code (4)


def test_zero_subnormal_and_nonfinite_blocks():
  w = np.ones((5, 32), np.float32)
  w[0] = 0.0
  w[1] = np.float32(2.0 ** -128) * (np.arange(32) % 4)  # subnormals 2^-128 * {0, 1, 2, 3}
  w[2, 3] = np.nan
  w[3, 7] = -np.inf
  blocks, scales = fmt.quantize(w)
  s = np.asarray(scales)
  assert s[0] == 0 and not np.any(np.asarray(blocks)[0])  # zero block: smallest scale, +0 codes
  q = np.asarray(fmt.dequantize(blocks, scales))
  np.testing.assert_array_equal(q[0], 0.0)
  np.testing.assert_array_equal(q[1], w[1])  # exact: values are 2^-128 * {0..3}, no flush to zero
  assert np.count_nonzero(q[1]) > 0
  assert s[2] == 0xFF and s[3] == 0xFF and np.all(np.isnan(q[2:4]))
  np.testing.assert_array_equal(q[4], 1.0)  # other blocks unaffected


@pytest.mark.parametrize("mode", fmt.MODES)
def test_block_max_on_the_ceil_boundary(mode):
  """A block max whose significand is exactly 1.5 (amax / 6 a power of two: ceil keeps the
  floor scale) or just above it (ceil doubles the scale), for either sign, vs the spec model."""
  rng = np.random.default_rng(8)
  w = (rng.standard_normal((6, 32)) * 0.5).astype(np.float32)
  w[:, 0] = [6.0, -3.0 * 2.0 ** -10, 1.5 * 2.0 ** 20, np.nextafter(np.float32(6.0), np.float32(7.0)),
             -1.5, 0.75]
  blocks, scales = fmt.quantize(w, mode=mode)
  got = np.asarray(fmt.dequantize(blocks, scales)).astype(np.float64)
  np.testing.assert_array_equal(got, _np_quantize_dequantize(w, mode))


def test_nonfinite_blocks_store_zero_codes():
  """A NaN / inf block is marked by its scale (0xFF) and stores all-zero codes (documented)."""
  w = np.random.default_rng(9).standard_normal((3, 64)).astype(np.float32)
  w[0, 5], w[1, 40] = np.nan, np.inf
  blocks, scales = fmt.quantize(w)
  b, s = np.asarray(blocks), np.asarray(scales)
  np.testing.assert_array_equal(s[:2] == 0xFF, [[True, False], [False, True]])
  assert not b[0, 0].any() and not b[1, 1].any()
  assert b[0, 1].any() and b[1, 0].any() and b[2].any()


def test_quantize_axis_and_layout():
  w = np.random.default_rng(5).standard_normal((3, 64, 5)).astype(np.float32)  # [e, d, f]
  blocks, scales = fmt.quantize(w, axis=1)  # contraction d moved last
  assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
  back = np.asarray(fmt.dequantize(blocks, scales))  # [e, f, d]
  np.testing.assert_array_equal(back, _np_quantize_dequantize(np.swapaxes(w, 1, 2), "floor"))
  assert fmt.mxfp4_nbytes(64 * 5 * 3) * 8 / (64 * 5 * 3) == 4.25


def test_format_errors():
  with pytest.raises(ValueError, match=r"K=40 .*pad that axis to 64"):
    fmt.quantize(np.ones((4, 40), np.float32))
  with pytest.raises(ValueError, match="mode='round'"):
    fmt.quantize(np.ones((4, 32), np.float32), mode="round")
  with pytest.raises(ValueError, match="float array"):
    fmt.quantize(np.ones((4, 32), np.int32))
  with pytest.raises(ValueError, match="scales shape"):
    fmt.dequantize(np.zeros((4, 2, 16), np.uint8), np.zeros((4, 3), np.uint8))


# ---- kernels (interpret mode) -----------------------------------------------------

M, N, K = 37, 45, 96  # odd rows / features; K = 3 MX blocks
GROUP_SIZES = (10, 0, 20, 5)  # an empty group; rows 35, 36 belong to no group (zeros)


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = rng.standard_normal((len(GROUP_SIZES), N, K)).astype(np.float32)
  blocks, scales = fmt.quantize(w)
  cot = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  return x, blocks, scales, jnp.array(GROUP_SIZES, jnp.int32), cot


def _value_and_dx(fn, x, cot):
  y, vjp = jax.vjp(fn, x)
  return y, vjp(cot)[0]


def test_interpret_mode_poisons_unwritten_outputs():
  def writes_half(o_ref):
    o_ref[:4] = jnp.ones((4,), jnp.float32)

  out = pl.pallas_call(writes_half, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                       interpret=True)()
  assert np.all(np.asarray(out[:4]) == 1) and np.all(np.isnan(np.asarray(out[4:])))


# bk = 64 overhangs K = 96 (masked K tile), bn = 16 overhangs N (masked in the backward);
# the second setting tiles K exactly and splits every group across several row tiles.
@pytest.mark.parametrize("backend", kernel.BACKENDS)
@pytest.mark.parametrize("block", [ops.BlockSizes(16, 16, 64), ops.BlockSizes(8, 32, 32)])
def test_ragged_matches_reference(data, backend, block):
  x, blocks, scales, gs, cot = data
  fast = jax.jit(lambda x, c: _value_and_dx(
      lambda x: ops.mxfp4_ragged_matmul(x, blocks, scales, gs, block=block, backend=backend), x, c))
  ref = jax.jit(lambda x, c: _value_and_dx(
      lambda x: reference.mxfp4_ragged_matmul_reference(x, blocks, scales, gs), x, c))
  (y, dx), (y_ref, dx_ref) = fast(x, cot), ref(x, cot)
  assert_close(y, y_ref, what="forward")
  assert_close(dx, dx_ref, what="grad x")
  np.testing.assert_array_equal(np.asarray(y[35:]), 0.0)  # rows past the last group
  np.testing.assert_array_equal(np.asarray(dx[35:]), 0.0)


@pytest.mark.parametrize("backend", kernel.BACKENDS)
def test_dense_matches_reference(data, backend):
  x, blocks, scales, _, _ = data
  x3 = x[:35].reshape(5, 7, K)
  cot = jnp.asarray(np.random.default_rng(7).standard_normal((5, 7, N)), jnp.float32)
  fast = jax.jit(lambda x, c: _value_and_dx(
      lambda x: ops.mxfp4_matmul(x, blocks[1], scales[1], block=ops.BlockSizes(16, 32, 64),
                                 backend=backend), x, c))
  ref = jax.jit(lambda x, c: _value_and_dx(
      lambda x: reference.mxfp4_matmul_reference(x, blocks[1], scales[1]), x, c))
  (y, dx), (y_ref, dx_ref) = fast(x3, cot), ref(x3, cot)
  assert y.shape == (5, 7, N)
  assert_close(y, y_ref, what="forward")
  assert_close(dx, dx_ref, what="grad x")


def test_bf16_forward_with_f32_output(data):
  x, blocks, scales, gs, _ = data
  xb = x.astype(jnp.bfloat16)
  y = jax.jit(lambda x: ops.mxfp4_ragged_matmul(x, blocks, scales, gs,
                                                preferred_element_type=jnp.float32))(xb)
  y_ref = jax.jit(lambda x: reference.mxfp4_ragged_matmul_reference(
      x, blocks, scales, gs, preferred_element_type=jnp.float32))(xb)
  assert y.dtype == jnp.float32
  assert_close(y, y_ref, what="bf16 operands, f32 accumulation")


def test_tpu_visits_cover_every_tile_once_per_group():
  visits = jax.jit(kernel.tpu_visits, static_argnums=(1, 2))
  tiles, groups, count = visits(jnp.array([3, 0, 9, 4, 0], jnp.int32), 21, 4)
  tiles, groups = np.asarray(tiles), np.asarray(groups)
  assert len(tiles) == 6 + 5 - 1 and np.all(np.diff(tiles) >= 0)
  # rows 0-2 g0, 3-11 g2, 12-15 g3, 16-20 no group (id 5): each (tile, group) once
  pairs = list(zip(tiles[:count].tolist(), groups[:count].tolist(), strict=True))
  assert pairs == [(0, 0), (0, 2), (1, 2), (2, 2), (3, 3), (4, 5), (5, 5)]
  np.testing.assert_array_equal(tiles[count:], 5)  # padding repeats the last tile, never runs
  # Sizes summing past M are clamped: no group addresses a row beyond x.
  np.testing.assert_array_equal(np.asarray(kernel.group_bounds(jnp.array([5, 9]), 10)), [0, 5, 10])


def test_op_errors(data):
  x, blocks, scales, gs, _ = data
  with pytest.raises(ValueError, match="K = blocks.shape"):
    ops.mxfp4_ragged_matmul(x[:, :64], blocks, scales, gs)
  with pytest.raises(ValueError, match="group_sizes must be an int array of shape"):
    ops.mxfp4_ragged_matmul(x, blocks, scales, gs[:3])
  with pytest.raises(ValueError, match="blocks must be"):
    ops.mxfp4_matmul(x, blocks, scales)
  with pytest.raises(ValueError, match="block_k=48 must be a multiple of 32"):
    ops.BlockSizes(block_k=48)
  with pytest.raises(ValueError, match=r"block_n=16 must be a multiple of 128"):
    ops.mxfp4_ragged_matmul(x, blocks, scales, gs, block=ops.BlockSizes(8, 16, 32),
                            backend="tpu", interpret=False)
  with pytest.raises(ValueError, match="power of two"):
    ops.mxfp4_ragged_matmul(x, blocks, scales, gs, block=ops.BlockSizes(24, 16, 32),
                            backend="gpu", interpret=False)


# ---- lowering -----------------------------------------------------------------------


def _small_expert_shapes():
  from configs import horizon
  from model.config import ModelConfig
  cfg = ModelConfig.from_config(horizon.get_config("small").model)
  rows = 128 * cfg.experts_per_token  # sorted token-assignments of a 128-token batch
  e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
  return [(rows, f, d, e), (rows, d, f, e)]  # w_gate / w_up (K = d), w_down (K = f)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_export_lowers_forward_and_backward(platform):
  backend = "tpu" if platform == "tpu" else "gpu"
  checks = ([jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
            if platform == "cuda" else [])
  marker = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
  for m, n, k, g in _small_expert_shapes():
    def fwd_bwd(x, blocks, scales, gs, cot):
      fn = lambda x: ops.mxfp4_ragged_matmul(x, blocks, scales, gs, backend=backend, interpret=False)
      return _value_and_dx(fn, x, cot)

    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((g, n, k // 32, 16), jnp.uint8),
            jax.ShapeDtypeStruct((g, n, k // 32), jnp.uint8),
            jax.ShapeDtypeStruct((g,), jnp.int32), jax.ShapeDtypeStruct((m, n), jnp.bfloat16))
    exported = jax.export.export(jax.jit(fwd_bwd), platforms=[platform],
                                 disabled_checks=checks)(*args)
    text = exported.mlir_module()
    assert text.count(marker) >= 2, f"{platform}: expected forward and backward kernels"
