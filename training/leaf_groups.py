"""One array per parameter role in the train step's per-parameter work, not one per layer.

The 93-layer stack has 1,945 trainable leaves: each layer holds its own copy of
`attn/w_q`, `ffn/w_gate`, ... Everything the train step does per leaf after the
gradient (finiteness checks, the global norm, clipping, AdamW's moments, the
update) was compiled once per leaf, and the step took over 3.5 minutes to
compile. Here the leaves that play the same role in different layers (same path
with the layer indices wildcarded, same dtype and shape, hence the same sharding
rule) are stacked into one array with a leading axis for that work, and split
back afterwards: the per-leaf maths compiles once per role (86 groups at 93
layers), and only the stack and the split stay per leaf. The maths per element
is unchanged; sums over all leaves (the global norm) add in another order. The train step also
adds the update to the parameters group by group (`grouped_apply`), so the split that remains
per leaf is plain slices, which XLA:CPU compiles once per (shape, offset) for the whole program.

`grouped(inner)` wraps an optax transformation: `inner` sees a dict
{group key: stacked array} (every leaf with one extra leading axis: a mask
function must allow for it, see `grouped_mask`), while the optimizer state is
stored per leaf, exactly as `inner` would store it ungrouped, so checkpoints
and shardings of the state are those of the plain optimizer. Subtrees of the
state with the structure of the parameters (AdamW's mu and nu) are stacked on
the way in and split on the way out; the rest (counts) passes through.

Stacking is a copy, so only leaves of at most `max_elements` elements are grouped
(`config.train.group_max_elements`, default 2^20; 0: none): the per-leaf cost
that grouping removes is per op, not per byte, while the copy costs per byte.
Grouping every leaf of the `small` step, 32-expert weights included, cost 12-18%
of its step time (two runs, each interleaved in one process: 3.12 -> 3.49 s and
3.17 -> 3.73 s; 9 stacks of [7, 32, 384, 256] f32 at ~38 ms each) and 9% of its
planned peak memory; with the default cap, 3.122 vs 3.115 s and +0.9%. Larger
leaves stay one group each (stacking one leaf is a reshape).
(MaxText stores the scanned layers' parameters stacked instead, which saves the
stack and split and that copy; that layout changes every consumer of the
parameter tree: checkpoints, sharding rules, decode, quantisation.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _role(path) -> str:
  """'blocks/*/attn/w_q' for the key path of blocks[7].attn.w_q (integer entries wildcarded)."""
  parts = []
  for entry in path:
    key = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry)))
    parts.append("*" if isinstance(key, int) or str(key).isdigit() else str(key))
  return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class LeafGroups:
  """Which leaves of a tree stack together: `members[i]` are the leaf indices (in
  jax.tree.leaves order) of the group named `keys[i]`, in first-occurrence order."""
  keys: tuple[str, ...]
  members: tuple[tuple[int, ...], ...]
  num_leaves: int

  @classmethod
  def of(cls, tree: Any, max_elements: int | None = None) -> "LeafGroups":
    """Groups the array leaves of `tree` by (role, dtype, shape); a leaf of more than
    `max_elements` elements (None: no limit) is a group of its own."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    groups: dict[str, list[int]] = {}
    for i, (path, leaf) in enumerate(flat):
      small = max_elements is None or math.prod(leaf.shape) <= max_elements
      role = _role(path) if small else jax.tree_util.keystr(path)
      groups.setdefault(f"{role}:{jnp.dtype(leaf.dtype).name}{list(leaf.shape)}", []).append(i)
    return cls(tuple(groups), tuple(tuple(m) for m in groups.values()), len(flat))

  def stack(self, leaves: Sequence[jax.Array]) -> dict[str, jax.Array]:
    """{key: [members, *leaf shape]} from the leaves (same order as the tree they came from)."""
    if len(leaves) != self.num_leaves:
      raise ValueError(f"LeafGroups.stack: {len(leaves)} leaves, grouped for {self.num_leaves}.")
    return {k: jnp.stack([leaves[i] for i in m]) for k, m in zip(self.keys, self.members, strict=True)}

  def unstack(self, groups: dict[str, jax.Array]) -> list[jax.Array]:
    """The leaves back in their order (inverse of `stack`)."""
    out: list[Any] = [None] * self.num_leaves
    for key, members in zip(self.keys, self.members, strict=True):
      stacked = groups[key]
      for j, i in enumerate(members):
        out[i] = stacked[j]
    return out

  def per_leaf(self, groups: dict[str, jax.Array], fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """[num_leaves]: fn(stacked) -> [members] per group, put back in leaf order."""
    if not self.keys:
      return jnp.zeros((0,), bool)
    values = jnp.concatenate([fn(groups[k]) for k in self.keys])
    return values[np.argsort(np.concatenate([np.asarray(m, np.int32) for m in self.members]))]


def finite(x: jax.Array, axis: tuple[int, ...] | None = None) -> jax.Array:
  """`jnp.all(jnp.isfinite(x), axis)` as one fused reduction.

  x * 0 is 0 for finite x and NaN for inf or NaN, so a sum of it is finite exactly when every
  summand is. `all(isfinite(x))` compiles to a bool array of x's shape written first and reduced
  after: ~10 ms for each [32, 384, 256] expert weight inside the `small` train step on XLA:CPU.
  """
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.all(jnp.ones_like(x, bool), axis)
  return jnp.isfinite(jnp.sum(x * 0, axis=axis, dtype=jnp.float32))


def rows_finite(stacked: jax.Array) -> jax.Array:
  """bool [members]: whether each stacked leaf is all finite."""
  return finite(stacked, tuple(range(1, stacked.ndim)))


def all_finite_per_leaf(tree: Any, max_elements: int | None = None) -> jax.Array:
  """bool [number of leaves]: whether each leaf of `tree` is all finite (one check per group)."""
  groups = LeafGroups.of(tree, max_elements)
  return groups.per_leaf(groups.stack(jax.tree.leaves(tree)), rows_finite)


def finite_and_norm(tree: Any, max_elements: int | None = None) -> tuple[jax.Array, jax.Array]:
  """(bool [number of leaves]: each leaf all finite, the global L2 norm), one reduction per group."""
  groups = LeafGroups.of(tree, max_elements)
  stacked = groups.stack(jax.tree.leaves(tree))
  return groups.per_leaf(stacked, rows_finite), optax.tree.norm(stacked)


def grouped_mask(leaf_mask: Callable[[Any], Any]) -> Callable[[dict], dict]:
  """A mask for `grouped`'s inner transformation from a mask written for the plain tree.

  leaf_mask(tree) -> tree of bools; it is called on shape/dtype stand-ins with the
  stack axis removed, so it may look at ndim, shape and dtype (not at values).
  """
  def mask(groups: dict) -> dict:
    shapes = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in groups.items()}
    return leaf_mask(shapes)
  return mask


def _convert(state: Any, to_groups: bool, groups: LeafGroups, treedef, gdef) -> Any:
  """Stacks (to_groups) or splits every subtree of `state` shaped like the parameters."""
  if to_groups:
    match = lambda x: not isinstance(x, jax.Array) and jax.tree.structure(x) == treedef  # noqa: E731
    fn = lambda x: groups.stack(jax.tree.leaves(x)) if match(x) else x  # noqa: E731
  else:
    match = lambda x: isinstance(x, dict) and jax.tree.structure(x) == gdef  # noqa: E731
    fn = lambda x: jax.tree.unflatten(treedef, groups.unstack(x)) if match(x) else x  # noqa: E731
  return jax.tree.map(fn, state, is_leaf=match)


def grouped(inner: optax.GradientTransformation,
            max_elements: int | None = None) -> optax.GradientTransformation:
  """`inner` run on same-role leaves stacked together (module docstring); state kept per leaf."""
  def init(params):
    leaves, treedef = jax.tree.flatten(params)
    if treedef.num_nodes == 1:  # a bare array: nothing to group, and its state could not be told apart
      return inner.init(params)
    groups = LeafGroups.of(params, max_elements)
    stacked = groups.stack(leaves)
    return _convert(inner.init(stacked), False, groups, treedef, jax.tree.structure(stacked))

  def update(updates, state, params=None):
    leaves, treedef = jax.tree.flatten(updates)
    if treedef.num_nodes == 1:
      return inner.update(updates, state, params)
    groups = LeafGroups.of(updates, max_elements)
    stacked = groups.stack(leaves)
    gdef = jax.tree.structure(stacked)
    inner_params = None if params is None else groups.stack(jax.tree.leaves(params))
    new_updates, new_state = inner.update(stacked, _convert(state, True, groups, treedef, gdef),
                                          inner_params)
    return (jax.tree.unflatten(treedef, groups.unstack(new_updates)),
            _convert(new_state, False, groups, treedef, gdef))

  return optax.GradientTransformation(init, update)


class GroupedSkip(NamedTuple):
  """`grouped(apply_if_finite(inner, max_consecutive_errors), max_elements)` as an optax
  transformation (`init`, `update`), which also keeps its parts so that `grouped_apply` can run it
  with the parameters' update inside (build it with `grouped_apply_if_finite`)."""
  init: Callable
  update: Callable
  inner: optax.GradientTransformation
  max_elements: int | None
  max_consecutive_errors: int


def grouped_apply_if_finite(inner: optax.GradientTransformation, max_elements: int | None,
                            max_consecutive_errors: int) -> GroupedSkip:
  """`grouped(apply_if_finite(inner, max_consecutive_errors), max_elements)`, as a GroupedSkip."""
  tx = grouped(apply_if_finite(inner, max_consecutive_errors), max_elements)
  return GroupedSkip(tx.init, tx.update, inner, max_elements, max_consecutive_errors)


def grouped_apply(tx: GroupedSkip, updates: Any, state: optax.ApplyIfFiniteState, params: Any
                  ) -> tuple[Any, optax.ApplyIfFiniteState]:
  """(new params, new state): `optax.apply_updates(params, u)` with `u, new state` from
  `tx.update(updates, state, params)`; the same arithmetic per element and the same state layout
  (bit for bit when compiled on its own, tests/test_leaf_groups.py; inside the whole train step
  XLA fuses it differently, see `train_step.apply_update`).

  The difference is for the compiler: here `p + u` is added on the stacked groups inside the
  finite branch, so everything split back into leaves afterwards (parameters, mu, nu) is a plain
  slice of an array the branch returned. XLA:CPU compiles a plain slice once per (shape, offset)
  for the whole program, while a per-leaf `p + slice(u)` was a kernel of its own for every leaf
  (1,392 of the 4,642 kernels of the 93-layer train step). A skipped step returns the parameters
  as they were (apply_updates would add zeros: the same, but for -0.0 turning into 0.0).
  """
  leaves, treedef = jax.tree.flatten(updates)
  groups = LeafGroups.of(updates, tx.max_elements)
  stacked, p = groups.stack(leaves), groups.stack(jax.tree.leaves(params))
  gdef = jax.tree.structure(stacked)
  inner_state = _convert(state.inner_state, True, groups, treedef, gdef)

  def apply():
    u, new_state = tx.inner.update(stacked, inner_state, p)
    return {k: (p[k] + u[k]).astype(p[k].dtype) for k in groups.keys}, new_state

  ok = jnp.all(jnp.stack([finite(v) for v in stacked.values()] or [jnp.array(True)]))
  new_p, new_state = _skip_unless(ok, apply, lambda: (p, inner_state), state, tx.max_consecutive_errors)
  return (jax.tree.unflatten(treedef, groups.unstack(new_p)),
          new_state._replace(inner_state=_convert(new_state.inner_state, False, groups, treedef, gdef)))


def _skip_unless(ok: jax.Array, apply: Callable, skip: Callable, state: optax.ApplyIfFiniteState,
                 max_consecutive_errors: int) -> tuple[Any, optax.ApplyIfFiniteState]:
  """optax.apply_if_finite's rule: (out, inner state) from `apply()` when ok or after more than
  max_consecutive_errors bad steps in a row, else from `skip()`; the counts move as optax's do."""
  bad_count = jnp.where(ok, 0, optax.safe_increment(state.notfinite_count))
  out, inner_state = jax.lax.cond(ok | (bad_count > max_consecutive_errors), apply, skip)
  total = jnp.where(ok, state.total_notfinite, optax.safe_increment(state.total_notfinite))
  return out, optax.ApplyIfFiniteState(notfinite_count=bad_count, last_finite=ok,
                                       total_notfinite=total, inner_state=inner_state)


def apply_if_finite(inner: optax.GradientTransformation,
                    max_consecutive_errors: int) -> optax.GradientTransformation:
  """`optax.apply_if_finite` (same state, `optax.ApplyIfFiniteState`, and the same rule) with the
  updates' finiteness checked by `finite`, one fused reduction per leaf."""
  def init(params):
    return optax.ApplyIfFiniteState(notfinite_count=jnp.zeros([], jnp.int32),
                                    last_finite=jnp.array(True, jnp.bool_),
                                    total_notfinite=jnp.zeros([], jnp.int32),
                                    inner_state=inner.init(params))

  def update(updates, state, params=None):
    ok = jnp.all(jnp.stack([finite(u) for u in jax.tree.leaves(updates)] or [jnp.array(True)]))
    return _skip_unless(ok, lambda: inner.update(updates, state.inner_state, params),
                        lambda: (optax.tree.zeros_like(updates), state.inner_state), state,
                        max_consecutive_errors)

  return optax.GradientTransformation(init, update)
