"""The mechanism behind conftest's `_release_compiled_programs`: every loaded XLA:CPU executable holds
memory maps of the test process until JAX's caches drop it, and `jax.clear_caches()` gives them back.

If a JAX upgrade changes either half (executables no longer map, or clearing no longer unmaps), this
fails and the per-file clearing in tests/conftest.py needs another look.
"""

import gc
import os

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import _memory_maps

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")


def test_compiled_programs_hold_memory_maps_until_the_caches_are_cleared():
  x = jnp.arange(12.0).reshape(3, 4)
  jax.clear_caches()
  gc.collect()
  before = _memory_maps()
  fns = [jax.jit(lambda v, i=i: jnp.sum(jnp.sin(v) * i) + jnp.sum(jnp.cos(v) @ v.T)) for i in range(40)]
  for f in fns:
    f(x).block_until_ready()
  held = _memory_maps() - before
  assert held >= 4 * len(fns), f"40 executables added only {held} maps"
  jax.clear_caches()
  gc.collect()
  assert _memory_maps() - before < held // 4, "clear_caches left the executables' maps in place"
