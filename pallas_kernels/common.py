"""Argument checks, padding and tile arithmetic shared by the Pallas kernels and their references.

Only jax.numpy: the references (and the model, which imports them) use these helpers without
loading Pallas. Backend selection, which needs Pallas, is in backend.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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


def positive_int(x) -> int | None:
  """x as a Python int when it is a positive integer (Python's or NumPy's, not a bool), else None:
  the test of every tile size and count argument (True was taken as 1, np.int64(8) refused)."""
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 1:
    return None
  return int(x)


def as_python_ints(obj, *names: str) -> None:
  """Stores the named int fields of a frozen dataclass as Python ints (NumPy's pass the checks)."""
  for name in names:
    value = getattr(obj, name)
    if isinstance(value, np.integer):
      object.__setattr__(obj, name, int(value))


def is_pow2(x) -> bool:
  """x is a positive integer power of two (a valid Triton tensor size)."""
  v = positive_int(x)
  return v is not None and v & (v - 1) == 0


def round_up(x: int, m: int) -> int:
  """The smallest multiple of m that is >= x."""
  return -(-x // m) * m


def next_pow2(x: int, floor: int = 1) -> int:
  """The smallest power of two >= max(x, floor) (Triton tensor sizes; dots need >= 16)."""
  return max(floor, 1 << max(0, x - 1).bit_length())
