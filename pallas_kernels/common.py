"""Argument checks, padding and tile arithmetic shared by the Pallas kernels and their references.

Only jax.numpy: the references (and the model, which imports them) use these helpers without
loading Pallas. Backend selection, which needs Pallas, is in backend.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def need(cond: bool, msg: str) -> None:
  """Raises ValueError(msg) unless cond: the argument checks of every ops.py and reference.py."""
  if not cond:
    raise ValueError(msg)


def pad_axis1(x: jax.Array, size: int, value) -> jax.Array:
  """Pads axis 1 of x up to `size` with `value`."""
  extra = size - x.shape[1]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def is_pow2(x) -> bool:
  """x is a positive int power of two (a valid Triton tensor size)."""
  return isinstance(x, int) and x > 0 and x & (x - 1) == 0


def round_up(x: int, m: int) -> int:
  """The smallest multiple of m that is >= x."""
  return -(-x // m) * m


def next_pow2(x: int, floor: int = 1) -> int:
  """The smallest power of two >= max(x, floor) (Triton tensor sizes; dots need >= 16)."""
  return max(floor, 1 << max(0, x - 1).bit_length())
