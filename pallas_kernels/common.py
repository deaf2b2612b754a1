"""Backend selection and tile arithmetic shared by the Pallas kernels.

Every kernel has a TPU body (Mosaic) and a GPU body (Triton). `interpret=None`
means: interpret mode on a CPU host (tests, CI), compiled on TPU/GPU.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu

BACKENDS = ("tpu", "triton")


def need(cond: bool, msg: str) -> None:
  """Raises ValueError(msg) unless cond: the argument checks of every ops.py."""
  if not cond:
    raise ValueError(msg)


def is_pow2(x) -> bool:
  """x is a positive int power of two (a valid Triton tensor size)."""
  return isinstance(x, int) and x > 0 and x & (x - 1) == 0


def round_up(x: int, m: int) -> int:
  """The smallest multiple of m that is >= x."""
  return -(-x // m) * m


def next_pow2(x: int, floor: int = 1) -> int:
  """The smallest power of two >= max(x, floor) (Triton tensor sizes; dots need >= 16)."""
  return max(floor, 1 << max(0, x - 1).bit_length())


def resolve_backend(backend: str | None) -> str:
  """None -> "tpu" on a TPU, else "triton" (GPU, or its interpret mode on CPU)."""
  if backend is None:
    return "tpu" if jax.default_backend() == "tpu" else "triton"
  need(backend in BACKENDS, f"backend={backend!r}: choose one of {BACKENDS} (or None for the default).")
  return backend


def resolve_interpret(interpret):
  """None -> interpret on CPU only; a pltpu.InterpretParams passes through (TPU body)."""
  if interpret is None:
    return jax.default_backend() == "cpu"
  return interpret if isinstance(interpret, pltpu.InterpretParams) else bool(interpret)
