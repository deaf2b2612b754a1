"""Plain-JAX references for the MXFP4 matmuls: dequantize, then an XLA matmul.

`mxfp4_matmul_reference` is x @ W^T with W = dequantize(blocks, scales) [N, K];
`mxfp4_ragged_matmul_reference` is `jax.lax.ragged_dot` with the dequantized
per-group weights (rows of x sorted by group; rows past sum(group_sizes) give
zeros). Both materialise the dense weights in x's dtype -- exactly the memory
the kernels avoid -- and accumulate in f32 like them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp4.format import dequantize


def mxfp4_matmul_reference(x: jax.Array, blocks: jax.Array, scales: jax.Array, *,
                           preferred_element_type=None) -> jax.Array:
  """x [..., K] @ dequantize(blocks [N, K/32, 16], scales [N, K/32])^T -> [..., N]."""
  w = dequantize(blocks, scales, x.dtype)  # [N, K]
  y = jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)
  return y.astype(preferred_element_type or x.dtype)


def mxfp4_ragged_matmul_reference(x: jax.Array, blocks: jax.Array, scales: jax.Array,
                                  group_sizes: jax.Array, *, preferred_element_type=None) -> jax.Array:
  """lax.ragged_dot(x [M, K], W [G, K, N], group_sizes [G]) with W from MXFP4 [G, N, K/32, 16]."""
  w = jnp.swapaxes(dequantize(blocks, scales, x.dtype), 1, 2)  # [G, K, N]
  y = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
  return y.astype(preferred_element_type or x.dtype)
