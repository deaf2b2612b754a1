"""MXFP4 (OCP Microscaling Formats v1.0): E2M1 elements, one E8M0 scale per 32.

The OCP MX v1.0 spec (Open Compute Project, "OCP Microscaling Formats (MX)
Specification", Sept. 2023, sec. 5 and 6.3) stores a block of k = 32 elements
P_i in a 4-bit float E2M1 (1 sign, 2 exponent, 1 mantissa bit: the values
+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) and one shared 8-bit power-of-two scale X in
E8M0 (the biased exponent byte: X = 2^(byte - 127), byte 0xFF = NaN). A block
decodes to V_i = X * P_i. MXFP4 therefore costs 4 + 8/32 = 4.25 bits/element.

Storage follows the gpt-oss checkpoints (OpenAI, 2025): the 32 elements of a
block sit along the *contraction* axis K of a weight, which is moved last:

  * `*_blocks` uint8 [..., K/32, 16]: two elements per byte, element 2i in the
    LOW nibble and element 2i + 1 in the high nibble of byte i;
  * `*_scales` uint8 [..., K/32]: the E8M0 byte (exponent + 127).

For the model's expert weights (`model/moe.py`): w_gate, w_up [e, d, f] contract
over d, so `quantize(w_gate, axis=1)` gives blocks [e, f, d/32, 16] and scales
[e, f, d/32] -- the [G, N, K/32, 16] right-hand side of
`ops.mxfp4_ragged_matmul` with N = f (gpt-oss's mlp1 layout); w_down [e, f, d]
contracts over f, so `quantize(w_down, axis=1)` gives [e, d, f/32, 16] with
N = d (gpt-oss's mlp2 layout). Both d and f must be multiples of 32.

Scale modes (`quantize(..., mode=...)`), with amax the block's largest |V_i|:

  * "floor" (DEFAULT): the spec's X = 2^(floor(log2 amax) - 2), 2 being E2M1's
    largest exponent. The scaled block max lies in [4, 8), so elements whose
    scaled magnitude exceeds 6 saturate to +-6 (at most the top ~25% of the
    block's range). It is the default because it is the conversion the spec
    defines -- bytes written here decode identically in any MX-conforming
    stack -- and because it keeps the finer of the two possible scales: when
    the modes differ, "ceil" doubles the step for all 32 elements to spare the
    one or two that clip. Measured (`experiments/bench/mxfp4_quality.py`):
    floor's relative error is 2% lower on Gaussian and 6% lower on
    heavy-tailed Student-t (nu = 3) weights, 0.6% higher on the randomly
    initialised `small` experts (which mode wins depends on where block maxima
    fall between powers of two).
  * "ceil": the non-clipping X = 2^ceil(log2(amax / 6)); every |V_i / X| <= 6.
    It differs from "floor" exactly when the block max's significand exceeds
    1.5, and then uses twice the scale.

Elements are rounded to nearest, ties to even (the even E2M1 code, mantissa
bit 0), exactly as `ml_dtypes.float4_e2m1fn`; scaled values beyond 6 saturate.
The exponent is clamped to E8M0's finite range [-127, 127].

Special blocks (documented choices where the spec leaves freedom):

  * all-zero block: scale byte 0x00 (X = 2^-127, the formula's clamped limit
    as amax -> 0, also what gpt-oss's converter writes), all codes +0;
  * subnormal inputs are exact: everything is computed on the f32 bit pattern
    with integer ops, because XLA:CPU (and TPUs) flush f32 subnormals to zero
    in float arithmetic;
  * NaN anywhere in a block: scale byte 0xFF (the spec's NaN scale, which
    makes the whole block NaN), codes 0 -- E2M1 has no NaN encoding;
  * +-inf anywhere in a block: also scale 0xFF. E2M1 has no infinity and the
    spec's shared exponent floor(log2 inf) overflows E8M0; silently saturating
    to +-6 X would turn a diverged weight into a plausible one, so the block
    becomes NaN and the failure stays visible.

Decoding (`dequantize`, `decode_e2m1_scaled`) builds the f32 bit pattern of
P_i * X with integer ops, so it is exact on every backend (including scale
bytes whose products are f32 subnormals); P * X beyond f32's range (>= 2^128:
byte 254 with |P| >= 2, byte 253 with |P| >= 4) decodes to +-inf. "ceil" can
write such a block from finite weights: elements >= 1.75 * 2^127 get
byte 253 and round to 4 X = 2^128; "floor" never does (its X <= 2^125).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # elements per MX block (the spec's k)
SCALE_BIAS = 127  # E8M0 exponent bias
NAN_SCALE = 0xFF  # E8M0 NaN
MODES = ("floor", "ceil")
DEFAULT_MODE = "floor"
E2M1_MAX = 6.0
# Values of the 16 E2M1 codes (bit 3 sign, bits 2-1 exponent, bit 0 mantissa).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# Round-to-nearest-even decision points between consecutive magnitudes
# (0, 0.5, 1, 1.5, 2, 3, 4, 6) and whether a tie rounds UP (to the even code).
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))

_EXP_MASK = 0xFF
_MANT_BITS = 23
_MANT_MASK = (1 << _MANT_BITS) - 1
_F32_NAN_BITS = 0x7FC00000
_F32_INF_BITS = 0x7F800000


# ---- E2M1 element codec ------------------------------------------------------


def _round_magnitude(mag: jax.Array) -> jax.Array:
  """|y| (f32, >= 0) -> magnitude code 0..7 with RNE and saturation at 6."""
  code = jnp.zeros(mag.shape, jnp.int32)
  for t, tie_up in _THRESHOLDS:
    passed = mag >= t if tie_up else mag > t
    code = code + passed.astype(jnp.int32)
  return code


def _sign_bit(x: jax.Array) -> jax.Array:
  """Sign bit (0/1, int32) of f32 x, from its bit pattern (so -0.0 -> 1)."""
  return (jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) >> 31).astype(jnp.int32)


def float_to_e2m1(x: jax.Array) -> jax.Array:
  """Rounds f32 values to E2M1 codes (no scale): RNE, saturating at +-6.

  Matches `ml_dtypes.float4_e2m1fn` for every finite input and +-inf (which
  saturate); the sign comes from the sign bit, so -0.0 and negative values that
  round to zero give code 8 (-0). NaN gives code 0 (E2M1 has no NaN; `quantize`
  marks NaN blocks through the scale instead).

  Args:
    x: [...] float array.

  Returns:
    [...] uint8 codes in [0, 16).
  """
  x = jnp.asarray(x, jnp.float32)
  mag = _round_magnitude(jnp.abs(x))
  code = jnp.where(jnp.isnan(x), 0, mag | (_sign_bit(x) << 3))
  return code.astype(jnp.uint8)


def e2m1_to_float(codes: jax.Array) -> jax.Array:
  """E2M1 codes [...] (uint8 in [0, 16)) -> their f32 values [...]."""
  return decode_e2m1_scaled(codes, jnp.full(jnp.shape(codes), SCALE_BIAS, jnp.int32))


def decode_e2m1_scaled(codes: jax.Array, scale_bytes: jax.Array) -> jax.Array:
  """Exact f32 value of E2M1 code * 2^(scale_byte - 127), built from bits.

  Pure integer ops + one bitcast, so it is exact on backends that flush f32
  subnormals and is usable inside Pallas kernels (TPU and Triton).

  Args:
    codes: [...] integer E2M1 codes in [0, 16).
    scale_bytes: [...] integer E8M0 bytes in [0, 256) (broadcast with codes).

  Returns:
    [...] f32: NaN for scale byte 0xFF; +-inf where the product overflows.
  """
  c = codes.astype(jnp.int32)
  s = scale_bytes.astype(jnp.int32)
  mag = c & 7
  e2 = mag >> 1
  m = mag & 1
  is_half = mag == 1  # 0.5 = 2^-1, E2M1's only subnormal
  # Normal f32 result: biased exponent (e2 - 1) + (s - 127) + 127, mantissa m.
  biased = jnp.where(is_half, 0, e2) + s - 1
  normal = (biased << _MANT_BITS) | (jnp.where(is_half, 0, m) << (_MANT_BITS - 1))
  # Subnormal f32 result (biased <= 0, only for s <= 1): value = q * 2^(s - 129)
  # with q the magnitude in quarters, i.e. q << (s + 20) units of 2^-149.
  quarters = jnp.where(is_half, 2, (2 + m) << e2)
  tiny = quarters << jnp.clip(s + 20, 0, 30)
  bits = jnp.where(biased >= 1, normal, tiny)
  bits = jnp.where(biased >= 255, _F32_INF_BITS, bits)
  bits = jnp.where(mag == 0, 0, bits) | ((c >> 3) << 31)
  bits = jnp.where(s == NAN_SCALE, _F32_NAN_BITS, bits)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)  # int32 -> f32, same width


# ---- nibble packing ----------------------------------------------------------


def pack_e2m1(codes: jax.Array) -> jax.Array:
  """Packs 4-bit codes [..., 2B] into bytes [..., B], element 2i in the low nibble.

  Args:
    codes: [..., 2B] integer codes in [0, 16) (higher bits are not checked).

  Returns:
    [..., B] uint8.
  """
  codes = jnp.asarray(codes)
  if codes.ndim == 0 or codes.shape[-1] % 2:
    raise ValueError(f"pack_e2m1: codes must have an even last dimension (two codes per byte); "
                     f"got shape {codes.shape}.")
  c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  return c[..., 0] | (c[..., 1] << 4)


def unpack_e2m1(packed: jax.Array) -> jax.Array:
  """Bytes [..., B] -> codes [..., 2B] uint8 (low nibble first); inverse of `pack_e2m1`."""
  packed = jnp.asarray(packed)
  if packed.dtype != jnp.uint8:
    raise ValueError(f"unpack_e2m1: packed must be uint8; got {packed.dtype}.")
  if packed.ndim == 0:  # an IndexError on shape[-1] before
    raise ValueError("unpack_e2m1: packed must have at least one axis (bytes [..., B]); got a scalar.")
  lo = packed & 0xF
  hi = packed >> 4
  return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---- block quantization --------------------------------------------------------


def _check_mode(mode: str) -> None:
  if mode not in MODES:
    raise ValueError(f"mxfp4: mode={mode!r}; choose one of {MODES} ('floor' is the OCP MX "
                     "v1.0 conversion, 'ceil' never clips).")


def _exponent_and_fraction(mag_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """floor(log2 v) and the 23-bit fraction of the normalised significand of v > 0.

  Works on the bit pattern of |v| (uint32 -> int32), subnormals included.
  """
  b = mag_bits.astype(jnp.int32)
  ebits = b >> _MANT_BITS
  mant = b & _MANT_MASK
  msb = 31 - jax.lax.clz(jnp.maximum(mant, 1))  # highest set bit of a subnormal's mantissa
  sub_exp = msb - 149
  sub_frac = (mant << jnp.clip(_MANT_BITS - msb, 0, _MANT_BITS)) & _MANT_MASK
  normal = ebits > 0
  return jnp.where(normal, ebits - 127, sub_exp), jnp.where(normal, mant, sub_frac)


def _block_exponents(mag_bits: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
  """Per-block scale exponent e (X = 2^e, int32 [..., nb]) and a non-finite flag.

  Args:
    mag_bits: [..., nb, 32] int32 bit patterns of |v|.
    mode: 'floor' or 'ceil'.
  """
  nonfinite = jnp.any((mag_bits >> _MANT_BITS) == _EXP_MASK, axis=-1)
  amax_bits = jnp.max(jnp.where((mag_bits >> _MANT_BITS) == _EXP_MASK, 0, mag_bits), axis=-1)
  fl, frac = _exponent_and_fraction(amax_bits)
  e = fl - 2
  if mode == "ceil":
    # amax / 6 = (significand / 1.5) * 2^(fl - 2): one more when significand > 1.5.
    e = e + (frac > (1 << (_MANT_BITS - 1))).astype(jnp.int32)
  e = jnp.where(amax_bits == 0, -SCALE_BIAS, e)  # zero block: the smallest scale
  return jnp.clip(e, -SCALE_BIAS, SCALE_BIAS), nonfinite


def _scaled_magnitude(mag_bits: jax.Array, e: jax.Array) -> jax.Array:
  """|v| / 2^e as an f32 built from bits (exact), or 0 where it is below 0.25.

  Values below 0.25 round to zero (0.25 itself ties to the even code 0), so
  only quotients >= 2^-2 need representing, and those are normal floats.
  """
  fl, frac = _exponent_and_fraction(mag_bits)
  ye = fl - e  # floor(log2 |v / X|)
  keep = (ye >= -2) & (mag_bits != 0)
  bits = (jnp.clip(ye + 127, 1, 254) << _MANT_BITS) | frac
  y = jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)
  return jnp.where(keep, y, 0.0)


def _move_contraction_last(w: jax.Array, axis: int) -> jax.ShapeDtypeStruct:
  """The shape of w with `axis` moved last (checked; nothing computed)."""
  if w.ndim == 0:
    raise ValueError("quantize: w must have at least one axis (the contraction axis K).")
  if not -w.ndim <= axis < w.ndim:
    raise ValueError(f"quantize: axis={axis} is out of range for w of shape {w.shape}.")
  return jax.eval_shape(lambda a: jnp.moveaxis(a, axis, -1), w)


def quantize(w: jax.Array, axis: int = -1, mode: str = DEFAULT_MODE) -> tuple[jax.Array, jax.Array]:
  """Quantizes a float array to MXFP4 along its contraction axis.

  Args:
    w: float array; `axis` (the contraction axis, K elements) is blocked by 32.
    axis: the contraction axis; it is moved last in the outputs.
    mode: 'floor' (default, the OCP spec) or 'ceil' (non-clipping); see the
      module docstring.

  Returns:
    (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]) where `...` are
    w's other axes in order.

  Raises:
    ValueError: K is not a multiple of 32, w is not floating point, or the mode
      or axis is unknown.
  """
  _check_mode(mode)
  w = jnp.asarray(w)
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"quantize: w must be a float array; got dtype {w.dtype}.")
  k = _move_contraction_last(w, axis).shape[-1]
  if k % BLOCK:
    raise ValueError(f"quantize: the contraction axis (axis={axis}) has K={k} elements, not a "
                     f"multiple of the MXFP4 block size {BLOCK}; pad that axis to "
                     f"{-(-k // BLOCK) * BLOCK} with zeros (or quantize another axis).")
  return _quantize(w, axis, mode)


@functools.partial(jax.jit, static_argnames=("axis", "mode"))
def _quantize(w: jax.Array, axis: int, mode: str) -> tuple[jax.Array, jax.Array]:
  """quantize() after validation (K % 32 == 0)."""
  w = jnp.moveaxis(w, axis, -1)
  k = w.shape[-1]
  bits = jax.lax.bitcast_convert_type(w.astype(jnp.float32), jnp.uint32)
  bits = bits.reshape(*w.shape[:-1], k // BLOCK, BLOCK)
  mag_bits = (bits & 0x7FFFFFFF).astype(jnp.int32)
  e, nonfinite = _block_exponents(mag_bits, mode)
  y = _scaled_magnitude(mag_bits, e[..., None])
  codes = _round_magnitude(y) | ((bits >> 31).astype(jnp.int32) << 3)
  codes = jnp.where(nonfinite[..., None], 0, codes)
  scales = jnp.where(nonfinite, NAN_SCALE, e + SCALE_BIAS).astype(jnp.uint8)
  return pack_e2m1(codes), scales


def check_mxfp4(blocks: jax.Array, scales: jax.Array, where: str = "mxfp4") -> None:
  """Raises ValueError unless (blocks [..., K/32, 16], scales [..., K/32]) are uint8 and match."""
  if blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
    raise ValueError(f"{where}: blocks and scales must be uint8 (gpt-oss layout); got "
                     f"{blocks.dtype} and {scales.dtype}.")
  if blocks.ndim < 2 or blocks.shape[-1] != BLOCK // 2:
    raise ValueError(f"{where}: blocks must be [..., K/32, {BLOCK // 2}] (two E2M1 codes per "
                     f"byte); got shape {blocks.shape}.")
  if scales.shape != blocks.shape[:-1]:
    raise ValueError(f"{where}: scales shape {scales.shape} != blocks shape without its last "
                     f"axis {blocks.shape[:-1]}; pass the scales written with these blocks.")


def dequantize(blocks: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Decodes MXFP4 blocks to a dense array with the contraction axis last.

  Args:
    blocks: uint8 [..., K/32, 16].
    scales: uint8 [..., K/32].
    dtype: output dtype (values are exact in f32 and bf16 up to range).

  Returns:
    [..., K] in `dtype`.
  """
  blocks = jnp.asarray(blocks)
  scales = jnp.asarray(scales)
  check_mxfp4(blocks, scales, "dequantize")
  return _dequantize(blocks, scales, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize(blocks: jax.Array, scales: jax.Array, dtype) -> jax.Array:
  codes = unpack_e2m1(blocks)  # [..., K/32, 32]
  values = decode_e2m1_scaled(codes, scales[..., None])
  return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK).astype(dtype)


def mxfp4_nbytes(num_elements: int) -> int:
  """Bytes of `num_elements` in MXFP4 (a multiple of 32): 4.25 bits per element."""
  if num_elements % BLOCK:
    raise ValueError(f"mxfp4_nbytes: {num_elements} elements is not a multiple of {BLOCK}.")
  return num_elements // 2 + num_elements // BLOCK
