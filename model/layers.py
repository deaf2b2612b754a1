"""Shared building blocks: parameters with logical axes, einsum, RMSNorm, RoPE.

Every parameter carries `axes`: a tuple of logical axis names, one per dim
(`vocab`, `embed`, `heads`, `q_lora`, `kv_lora`, `head_dim`, `mlp`, `expert`,
...). `sharding/` maps these names to mesh axes; model code never names a mesh.

Einsum legend used across model/: b batch, t query position, s key position,
d model dim, h heads, k head dim, v value head dim, e experts, f FFN width,
r low-rank (LoRA) dim, c latent (kv_lora) dim.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class KeyGen:
  """A deterministic parameter-key stream with a Python-side counter.

  Drop-in for `nnx.Rngs` in module constructors (`.params()` returns a fresh
  key). `nnx.Rngs` keeps its counter in a Variable whose every update, under
  tracing (`nnx.eval_shape`, jitted init), runs a check that scans the whole
  trace so far: building the 93-layer `full` model abstractly took ~90 s that
  way, and takes ~2 s with this stream.
  """

  def __init__(self, key: jax.Array):
    self._key, self._count = key, 0

  def params(self) -> jax.Array:
    key = jax.random.fold_in(self._key, self._count)
    self._count += 1
    return key


def param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], dtype,
          init: str = "fan_in", fan_in: int | None = None, scale: float = 1.0) -> nnx.Param:
  """A parameter with logical axes.

  init: 'fan_in' (normal, std = scale / sqrt(fan_in); fan_in defaults to
  shape[0]), 'normal' (std = scale), 'ones', 'zeros'.
  """
  shape = tuple(int(s) for s in shape)
  if len(axes) != len(shape):
    raise ValueError(f"param: {len(axes)} axis names {tuple(axes)} for shape {shape}.")
  if init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    std = scale if init == "normal" else scale / (fan_in or shape[0]) ** 0.5
    value = _normal(rngs.params(), shape, std, dtype)
  return nnx.Param(value, axes=tuple(axes))


# Eager draws of at most this many elements come from a power-of-two bucket (see _normal).
_BUCKET_MAX_ELEMENTS = 1 << 22


@functools.partial(jax.jit, static_argnums=1)
def _flat_normal(key: jax.Array, size: int) -> jax.Array:
  return jax.random.normal(key, (size,), jnp.float32)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _scaled_prefix(flat: jax.Array, std, shape: tuple[int, ...], dtype) -> jax.Array:
  return (std * flat[:math.prod(shape)].reshape(shape)).astype(dtype)


def _prefix_draws(key: jax.Array) -> bool:
  """Whether normal(key, shape) is the first prod(shape) draws of normal(key, (n,)), n larger.

  True for threefry keys with jax_threefry_partitionable (JAX's default since 0.5): element i's
  bits are threefry(key, i) for the row-major index i, whatever the shape.
  """
  if not jax.config.jax_threefry_partitionable:
    return False
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return str(jax.random.key_impl(key)) == "threefry2x32"
  return jax.config.jax_default_prng_impl == "threefry2x32"


def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
  """(std * normal(key, shape, f32)).astype(dtype), bit for bit.

  Built eagerly (no trace), a model would compile jax.random.normal once per distinct parameter
  shape, ~0.15 s each on XLA:CPU (86 shapes, ~14 s, for `tiny` at 6 layers). Eager draws
  up to _BUCKET_MAX_ELEMENTS instead come from a flat draw of the next power-of-two size, sliced:
  the same values (_prefix_draws) from one compile per size bucket. Traced draws (jitted or
  abstract init) and large ones draw the shape directly.
  """
  n = math.prod(shape)
  if isinstance(key, jax.core.Tracer) or n > _BUCKET_MAX_ELEMENTS or not _prefix_draws(key):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  return _scaled_prefix(_flat_normal(key, 1 << max(0, (n - 1).bit_length())), std, shape, jnp.dtype(dtype))


# Name scope of the maths that runs in f32 by design whatever the compute dtype (the delta rule's
# chunk algebra, router logits, indexer scores): the one place the precision policy allows f32 products in a
# bf16 train step (tests/test_precision.py reads it from the traced step).
F32_SCOPE = "f32_by_design"


def einsum(spec: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """einsum in the compute dtype with f32 accumulation, result in `dtype`.

  Below f32 (bf16 / f16 compute) the backward matmuls run in the compute dtype
  too, with f32 accumulation: the cotangent is rounded to `dtype` before its
  two products, and w's gradient comes out of the f32 accumulator in w's own
  dtype (f32 master weights get f32 gradients without a bf16 round trip).
  Autodiff of the plain form would instead carry the f32 cotangent of the
  final cast into f32 x f32 backward products (twice the work on bf16 units;
  XLA:CPU has no bf16 x bf16 -> bf16 product and upcasts it to f32).
  """
  dtype = jnp.dtype(dtype)
  if dtype.itemsize < 4 and not _PLAIN_AUTODIFF[0] and _transposable(spec):
    return _einsum_low(spec, dtype, dtype, jnp.dtype(x.dtype), jnp.dtype(w.dtype), x, w)
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32).astype(dtype)


_PLAIN_AUTODIFF = [False]


@contextlib.contextmanager
def plain_autodiff_matmuls():
  """Traces `einsum` as plain autodiff (f32 backward products) inside the block: the baseline
  the precision benchmark and tests compare against. Trace-time only; compiled programs keep
  what they were traced with."""
  _PLAIN_AUTODIFF[0] = True
  try:
    yield
  finally:
    _PLAIN_AUTODIFF[0] = False


@functools.lru_cache(maxsize=None)
def _transposable(spec: str) -> bool:
  """Whether both operand gradients are einsums of the other two terms: explicit output, no
  ellipsis, no repeated index in an operand, every operand index in the other operand or the out."""
  if "..." in spec or "->" not in spec:
    return False
  ins, out = spec.split("->")
  if ins.count(",") != 1:
    return False
  a, b = ins.split(",")
  if len(set(a)) != len(a) or len(set(b)) != len(b):
    return False
  return set(a) <= set(b) | set(out) and set(b) <= set(a) | set(out)


def _vma_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """ct summed over the manual mesh axes it varies on and primal does not (inside shard_map):
  the transpose of the implicit broadcast of an invariant operand (what autodiff inserts)."""
  extra = tuple(sorted(_varying(ct) - _varying(primal)))
  return jax.lax.psum(ct, extra) if extra else ct


def _varying(a: jax.Array) -> frozenset:
  """The manual mesh axes a value varies over inside shard_map (empty outside)."""
  aval = jax.typeof(a)
  mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.9; `vma` before
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _einsum_low(spec, dtype, out_dtype, x_dtype, w_dtype, x, w):
  """einsum of x, w rounded to `dtype` with f32 accumulation, result in out_dtype; the backward's
  two products take the cotangent rounded to `dtype` and return each operand's own dtype."""
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32).astype(out_dtype)


def _einsum_low_fwd(spec, dtype, out_dtype, x_dtype, w_dtype, x, w):
  xc, wc = x.astype(dtype), w.astype(dtype)
  return jnp.einsum(spec, xc, wc, preferred_element_type=jnp.float32).astype(out_dtype), (xc, wc)


def _einsum_low_bwd(spec, dtype, out_dtype, x_dtype, w_dtype, res, g):
  xc, wc = res
  a, b, out = spec.replace("->", ",").split(",")
  g = g.astype(dtype)
  dx = jnp.einsum(f"{out},{b}->{a}", g, wc, preferred_element_type=jnp.float32).astype(x_dtype)
  dw = jnp.einsum(f"{a},{out}->{b}", xc, g, preferred_element_type=jnp.float32).astype(w_dtype)
  return _vma_like(dx, xc), _vma_like(dw, wc)


_einsum_low.defvjp(_einsum_low_fwd, _einsum_low_bwd)


def einsum_f32(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """einsum with inputs in x's (compute) dtype and the f32 result kept.

  For attention logits and indexer scores, which feed softmax / top-k in f32
  (`einsum` would round the result back to the compute dtype). Below f32, the
  backward rounds the f32 cotangent to x's dtype for its products, as `einsum`.
  """
  dtype = jnp.dtype(x.dtype)
  if dtype.itemsize < 4 and not _PLAIN_AUTODIFF[0] and _transposable(spec):  # see `einsum`
    return _einsum_low(spec, dtype, jnp.dtype(jnp.float32), dtype, jnp.dtype(y.dtype), x, y)
  return jnp.einsum(spec, x, y.astype(x.dtype), preferred_element_type=jnp.float32)


def _is_16_bit_float(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def to_bits(x: jax.Array) -> jax.Array:
  """A 16-bit float array as its uint16 bits (other dtypes unchanged); `from_bits` inverts it."""
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if _is_16_bit_float(x.dtype) else x


def from_bits(x: jax.Array, dtype) -> jax.Array:
  """`to_bits`'s inverse: x as `dtype` (uint16 bits reinterpreted when dtype is a 16-bit float)."""
  return jax.lax.bitcast_convert_type(x, dtype) if _is_16_bit_float(dtype) else x


def check_prefix_mask(valid: jax.Array, who: str) -> None:
  """ValueError where a concrete valid [b, t] is not a prefix mask per row (a layer's extend
  writes its first sum(valid) slots); a traced one, under jit, is not checked."""
  if not isinstance(valid, jax.core.Tracer) and bool(jnp.any(valid[:, 1:] & ~valid[:, :-1])):
    raise ValueError(f"{who}: valid must be a prefix mask per row (real tokens first, then padding).")


def scatter_set(buf: jax.Array, index, new: jax.Array, mode: str | None = None) -> jax.Array:
  """`buf.at[index].set(new)` with `new` cast to buf's dtype; 16-bit floats move as uint16, the same
  bits: XLA:CPU computes a bf16/f16 scatter in f32, converting the whole buffer there and back (a
  decode step's cache write then costs the whole cache, not the new token). Not differentiable."""
  new = to_bits(new.astype(buf.dtype))
  return from_bits(to_bits(buf).at[index].set(new, mode=mode), buf.dtype)


def update_slice(buf: jax.Array, new: jax.Array, starts, keep_old: jax.Array | None = None) -> jax.Array:
  """`lax.dynamic_update_slice(buf, new, starts)` with `new` cast to buf's dtype, and, where
  `keep_old` (broadcast to new's shape) is True, buf's old values kept.

  16-bit floats move as uint16 bits, as in `scatter_set`: XLA:CPU computes a bf16 update (and a
  bf16 select) in f32, converting the whole buffer there and back. Inside a loop, carry the buffer
  as `to_bits` and write `to_bits(new)`: the update is then in place, where a bitcast back after
  it would still make the loop rewrite the whole buffer at every iteration. Not differentiable.
  """
  bits = to_bits(buf)
  new = to_bits(new.astype(buf.dtype))
  if keep_old is not None:
    new = jnp.where(keep_old, jax.lax.dynamic_slice(bits, starts, new.shape), new)
  return from_bits(jax.lax.dynamic_update_slice(bits, new, starts), buf.dtype)


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
  """RMSNorm computed in f32; returns x's dtype."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  return y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """Root-mean-square norm with a learned per-channel scale (init 1)."""

  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
               axis_name: str = "norm"):
    self.eps = eps
    self.scale = param(rngs, (dim,), (axis_name,), param_dtype, init="ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)


def rope_frequencies(dim: int, theta: float) -> jax.Array:
  """Inverse frequencies theta^(-2i/dim), i < dim/2, f32 [dim/2]."""
  return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (rotate-half convention) on the last dim of x.

  x: [b, t, ..., k] with k even; positions: [b, t] int. Computed in f32.
  """
  k = x.shape[-1]
  inv = rope_frequencies(k, theta)
  ang = positions.astype(jnp.float32)[..., None] * inv  # [b, t, k/2]
  ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., : k // 2], xf[..., k // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, dtype,
           spec_in: str = "btd,df->btf", spec_out: str = "btf,fd->btd") -> jax.Array:
  """SwiGLU feed-forward: (silu(x Wg) * x Wu) Wd."""
  g = einsum(spec_in, x, w_gate, dtype)
  u = einsum(spec_in, x, w_up, dtype)
  return einsum(spec_out, jax.nn.silu(g) * u, w_down, dtype)


def maybe_remat(fn: Callable, policy: str) -> Callable:
  """Wraps fn with nnx.remat according to the config's remat policy."""
  if policy == "none":
    return fn
  if policy == "full":
    return nnx.remat(fn)
  if policy == "save_dots":
    return nnx.remat(fn, policy=jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
  raise ValueError(f"unknown remat policy {policy!r}; choose 'none', 'full' or 'save_dots'.")


class MLP(nnx.Module):
  """Dense SwiGLU feed-forward (dense-FFN layers and shared experts)."""

  def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs, param_dtype, dtype):
    self.dtype = dtype
    self.w_gate = param(rngs, (d_model, hidden), ("embed", "mlp"), param_dtype)
    self.w_up = param(rngs, (d_model, hidden), ("embed", "mlp"), param_dtype)
    self.w_down = param(rngs, (hidden, d_model), ("mlp", "embed"), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return swiglu(x, self.w_gate[...], self.w_up[...], self.w_down[...], self.dtype)
