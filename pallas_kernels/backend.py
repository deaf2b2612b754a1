"""Backend selection shared by the Pallas kernels.

Every kernel has a TPU body (Mosaic) and a GPU body (Triton). `interpret=None`
means: interpret mode on a CPU host (tests, CI), compiled on TPU/GPU.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import need

BACKENDS = ("tpu", "triton")


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
