"""Shared building blocks: parameters with logical axes, einsum, RMSNorm, RoPE.

Every parameter carries `axes`: a tuple of logical axis names, one per dim
(`vocab`, `embed`, `heads`, `q_lora`, `kv_lora`, `head_dim`, `mlp`, `expert`,
...). `sharding/` maps these names to mesh axes; model code never names a mesh.

Einsum legend used across model/: b batch, t query position, s key position,
d model dim, h heads, k head dim, v value head dim, e experts, f FFN width,
r low-rank (LoRA) dim, c latent (kv_lora) dim.
"""

from __future__ import annotations

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
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, axes=tuple(axes))


def einsum(spec: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """einsum in the compute dtype with f32 accumulation, result in `dtype`."""
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32).astype(dtype)


def einsum_f32(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """einsum with inputs in x's (compute) dtype and the f32 result kept.

  For attention logits and indexer scores, which feed softmax / top-k in f32
  (`einsum` would round the result back to the compute dtype).
  """
  return jnp.einsum(spec, x, y.astype(x.dtype), preferred_element_type=jnp.float32)


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
