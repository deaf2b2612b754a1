"""Grouped SwiGLU experts over expert-aligned row tiles, weights read in place ('grouped' impl).

The dropless experts of model/moe_experts.py sort token-assignments by expert,
so each expert owns a contiguous run of rows. This path walks those runs in
tiles that never straddle two experts and multiplies each tile by its expert's
weights, sliced in place (`w[e]`): no per-block copy of an expert's weights is
ever materialised, unlike the 'blocked' path, and the backward accumulates
dW[e] tile by tile into one [e, d, f] buffer instead of scatter-adding per-block
weight gradients. A `jax.custom_vjp` supplies that backward, because reverse
mode cannot differentiate a loop whose trip count depends on the routing.

Tiles come in two phases, both with data-dependent trip counts (a while loop;
only tiles that hold rows run):

1. one tile of `cap` rows per non-empty expert, `cap` ~ the mean run length
   (rows / e rounded up to 8), which covers most of a balanced run;
2. tiles of `tile` rows over what each run has beyond `cap`.

Wasted (masked) rows are ~0.4 std of the run lengths plus tile/2 per expert that
overflows, against up to `block - 1` per expert and a static worst-case count of
blocks for 'blocked'. On XLA:CPU a loop of 2-D dots also beat one batched
[e, cap, d] dot (experiments/bench/moe_dropless_vs_dense.py).

Permutations in and out of expert order are gathers in both directions
(`_expand`, `_unsort`): their backward is a gather too, not a scatter-add.

Einsum legend: m row within a tile, d model dim, f expert FFN width, e expert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from model.layers import einsum, einsum_f32, from_bits, to_bits, update_slice

DEFAULT_TILE = 32


def default_cap(rows: int, num_experts: int) -> int:
  """First-phase tile rows: the mean rows per expert, rounded up to a multiple of 8."""
  return -(-max(1, -(-rows // num_experts)) // 8) * 8


def _phase(sizes, starts, lo: int, hi: int, tile: int, max_tiles: int) -> dict:
  """Tiles of `tile` rows covering ranks [lo, min(hi, size)) of every expert's run.

  Returns {'n': live tile count, 'e', 'start', 'len': [max_tiles] int32}; tile i
  (i < n) is rows start..start+len-1 of the sorted rows, all routed to expert e.
  """
  e = sizes.shape[0]
  span = jnp.maximum(jnp.minimum(sizes, hi) - lo, 0)
  ntile = (span + tile - 1) // tile
  end = jnp.cumsum(ntile).astype(jnp.int32)
  i = jnp.arange(max_tiles, dtype=jnp.int32)
  te = jnp.minimum(jnp.searchsorted(end, i, side="right"), e - 1).astype(jnp.int32)
  j = i - (end[te] - ntile[te])
  return {"n": end[-1], "e": te, "start": starts[te] + lo + j * tile,
          "len": jnp.minimum(tile, span[te] - j * tile)}


def _silu_grad(g):
  s = jax.nn.sigmoid(g)
  return s * (1 + g * (1 - s))


def _pad_rows(a, n: int):
  return jnp.concatenate([a, jnp.zeros((n,) + a.shape[1:], a.dtype)])


def _tile_write(buf, start, mask, new):
  """buf[start:start+m] = new where mask (rows past the tile's run belong to the next expert).

  buf is a loop carry in `to_bits` form (uint16 for 16-bit floats, so the write is in place)."""
  return update_slice(buf, to_bits(new), (start, 0), keep_old=~mask)


def _accumulate(buf, i, v):
  """buf[i] += v, in place inside the loop (no scatter)."""
  return jax.lax.dynamic_update_index_in_dim(buf, jax.lax.dynamic_index_in_dim(buf, i, 0, False) + v, i, 0)


def _zeros(shape, dtype, *like):
  """Zeros that vary over the same shard_map axes as `like` (leaves of arrays).

  Under expert parallelism this runs inside `shard_map`, where a loop carry must
  have the same varying manual axes on entry as the body gives it; plain
  `jnp.zeros` varies over none. `zeros_like` keeps an operand's axes.
  """
  z = sum(jnp.zeros_like(a.reshape(-1)[0], dtype) for a in jax.tree.leaves(like))
  return jnp.zeros(shape, dtype) + z


def _tile(p: dict, i, tile: int):
  return p["e"][i], p["start"][i], (jnp.arange(tile) < p["len"][i])[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tiled_swiglu(tiles: tuple[int, ...], dtype, xs, phases, w_gate, w_up, w_down):
  """SwiGLU of the expert-sorted rows xs [r, d] over the phases' tiles; [r, d] in `dtype`."""
  return _tiled_fwd(tiles, dtype, xs, phases, w_gate, w_up, w_down)[0]


def _tiled_fwd(tiles, dtype, xs, phases, w_gate, w_up, w_down):
  pad = max(tiles)
  rows, d = xs.shape
  f = w_gate.shape[2]
  xs_p = _pad_rows(xs, pad)  # a tile may read up to `pad` rows past the last run
  like = (xs, phases, w_gate, w_up, w_down)
  carry = tuple(to_bits(_zeros((rows + pad, n), dtype, like)) for n in (d, f, f))
  for tile, p in zip(tiles, phases, strict=True):
    def body(i, carry, tile=tile, p=p):
      ys, gs, us = carry
      ex, start, mask = _tile(p, i, tile)
      xt = jax.lax.dynamic_slice_in_dim(xs_p, start, tile)
      g = einsum("md,df->mf", xt, w_gate[ex], dtype)
      u = einsum("md,df->mf", xt, w_up[ex], dtype)
      y = einsum("mf,fd->md", jax.nn.silu(g) * u, w_down[ex], dtype)
      return tuple(_tile_write(buf, start, mask, new) for buf, new in ((ys, y), (gs, g), (us, u)))
    carry = jax.lax.fori_loop(0, p["n"], body, carry)
  ys, gs, us = (from_bits(buf, dtype) for buf in carry)
  return ys[:rows], (xs_p, phases, w_gate, w_up, w_down, gs, us)


def _tiled_bwd(tiles, dtype, res, dys):
  """Same tiles; dW[e] accumulates in f32 in place, dx rows are written per tile."""
  xs_p, phases, w_gate, w_up, w_down, gs, us = res
  rows = dys.shape[0]
  dys_p = _pad_rows(dys, max(tiles))
  like = (xs_p, phases, w_gate, w_up, w_down, gs, us, dys)
  carry = tuple(_zeros(a.shape, jnp.float32, like) for a in (xs_p, w_gate, w_up, w_down))
  for tile, p in zip(tiles, phases, strict=True):
    def body(i, carry, tile=tile, p=p):
      dxs, dwg, dwu, dwd = carry
      ex, start, mask = _tile(p, i, tile)
      xt = jax.lax.dynamic_slice_in_dim(xs_p, start, tile)
      g = jax.lax.dynamic_slice_in_dim(gs, start, tile)
      u = jax.lax.dynamic_slice_in_dim(us, start, tile)
      dy = jnp.where(mask, jax.lax.dynamic_slice_in_dim(dys_p, start, tile).astype(dtype), 0)
      dwd = _accumulate(dwd, ex, einsum_f32("mf,md->fd", jax.nn.silu(g) * u, dy))
      dh = einsum_f32("md,fd->mf", dy, w_down[ex])
      dg = (dh * u * _silu_grad(g)).astype(dtype)
      du = (dh * jax.nn.silu(g)).astype(dtype)
      dwg = _accumulate(dwg, ex, einsum_f32("md,mf->df", xt.astype(dtype), dg))
      dwu = _accumulate(dwu, ex, einsum_f32("md,mf->df", xt.astype(dtype), du))
      dx = einsum_f32("mf,df->md", dg, w_gate[ex]) + einsum_f32("mf,df->md", du, w_up[ex])
      return _tile_write(dxs, start, mask, dx), dwg, dwu, dwd
    carry = jax.lax.fori_loop(0, p["n"], body, carry)
  dxs, dwg, dwu, dwd = carry
  no_grad = jax.tree.map(lambda _: None, phases)
  return (dxs[:rows].astype(xs_p.dtype), no_grad, dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype),
          dwd.astype(w_down.dtype))


_tiled_swiglu.defvjp(_tiled_fwd, _tiled_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _expand(x_td, order, inverse, kslots: int):
  """Rows of x in expert order: xs[r] = x[order[r] // k]."""
  return x_td[order // kslots]


def _expand_fwd(x_td, order, inverse, kslots):
  return x_td[order // kslots], (inverse, x_td.shape[0])


def _expand_bwd(kslots, res, dxs):
  inverse, t = res  # each token's k rows, gathered back and summed (no scatter-add)
  return dxs[inverse].reshape(t, kslots, dxs.shape[-1]).sum(1), None, None


_expand.defvjp(_expand_fwd, _expand_bwd)


@jax.custom_vjp
def _unsort(ys, inverse, order):
  """Expert-order rows back to assignment order: y[a] = ys[inverse[a]]."""
  return ys[inverse]


def _unsort_fwd(ys, inverse, order):
  return ys[inverse], order


def _unsort_bwd(order, dy):
  return dy[order], None, None


_unsort.defvjp(_unsort_fwd, _unsort_bwd)


def grouped_swiglu(x_td, order, group_sizes, kslots: int, w_gate, w_up, w_down, dtype,
                   tile: int | None = None, cap: int | None = None):
  """Routed SwiGLU rows in assignment order, [t*k, d] in `dtype` (see module docstring).

  Args:
    x_td: [t, d] tokens.
    order: [t*k] assignment ids (token * k + slot) sorted by expert (stable).
    group_sizes: [e] rows per expert; rows of id e ("no expert") sort last,
      belong to no run and come back as zeros.
    kslots: k, experts per token.
    w_gate, w_up: [e, d, f]; w_down: [e, f, d].
    dtype: compute dtype (f32 accumulation).
    tile: overflow tile rows (default `DEFAULT_TILE`).
    cap: first-phase tile rows (default `default_cap`; 0 = overflow tiles only).
  """
  rows = order.shape[0]
  e = w_gate.shape[0]
  tile = DEFAULT_TILE if tile is None else int(tile)
  cap = default_cap(rows, e) if cap is None else int(cap)
  if tile < 1 or cap < 0:
    raise ValueError(f"grouped experts: tile={tile} must be >= 1 and cap={cap} >= 0.")
  starts = (jnp.cumsum(group_sizes) - group_sizes).astype(jnp.int32)
  inverse = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
  tiles, phases = [], []
  if cap:
    tiles.append(cap)
    phases.append(_phase(group_sizes, starts, 0, cap, cap, e))
  tiles.append(tile)
  phases.append(_phase(group_sizes, starts, cap, rows, tile, -(-max(rows - cap, 0) // tile) + e))
  xs = _expand(x_td, order, inverse, kslots)
  # Inside shard_map, give every operand the same varying axes here, where autodiff
  # transposes the broadcast (a psum), so the custom VJP's cotangents match its inputs.
  # Outside it this adds zeros too, and serving/weights.py reads that as a use in f32, so the
  # engine keeps the routed experts in f32. Measured on XLA:CPU that is the faster layout:
  # with bf16-held experts its decode program converts every expert of a layer to f32 per
  # call (it runs these dots in f32), not just the gathered ones: decode up to 2-3x slower.
  z = _zeros((), jnp.float32, (xs, phases, w_gate, w_up, w_down))
  xs, w_gate, w_up, w_down = (a + z.astype(a.dtype) for a in (xs, w_gate, w_up, w_down))
  ys = _tiled_swiglu(tuple(tiles), dtype, xs, phases, w_gate, w_up, w_down)
  return _unsort(ys, inverse, order)
