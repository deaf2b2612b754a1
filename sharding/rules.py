"""The one table from logical axis names to mesh axes.

Model code labels every weight dim (`model.layers.param(..., axes=...)`) and
key activations (`constrain(x, ('batch', 'length', 'embed'))`) with *logical*
names; only this file says which mesh axes those names are split over. The
table has two columns because parameters and activations differ: a weight's
`embed` dim is split over `fsdp` (ZeRO-3), while an activation's `embed` dim
is whole and its `batch` dim is split over every batch-like mesh axis.

Replicated on purpose (mapped to None): low-rank MLA dims (`q_lora`,
`kv_lora`), per-head dims (`head_dim`), norm scales, the delta conv taps
(`conv`), the projector's output dim (`embed_out`), the ViT width
(`vit_embed`). They are small, and splitting them would add a collective per
use for little memory. Heads, FFN widths (`mlp`, `vit_mlp`, `vit_heads`) and
the vocabulary are split over `tensor`, experts over `expert`.

A mesh axis is used at most once per array: if two dims of one weight map to
the same mesh axis, the later dim stays whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterator, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None

PARAM_RULES: Mapping[str, MeshAxes] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "embed_out": None,
    "heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",
    "q_lora": None,
    "kv_lora": None,
    "head_dim": None,
    "norm": None,
    "conv": None,
    "vit_embed": None,
    "vit_heads": "tensor",
    "vit_mlp": "tensor",
}

ACTIVATION_RULES: Mapping[str, MeshAxes] = {
    # Every mesh axis but `tensor` splits the batch: expert-parallel devices
    # are data-parallel outside the MoE layers.
    "batch": ("data", "fsdp", "expert"),
    "length": None,
    "embed": None,
    "heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "expert": None,
    "kv_lora": None,
    "head_dim": None,
}


class ShardingError(ValueError):
  """A weight or activation that cannot be laid out on the mesh as the rules say."""


@dataclasses.dataclass(frozen=True)
class Rules:
  params: Mapping[str, MeshAxes]
  activations: Mapping[str, MeshAxes]

  def replace(self, params: Mapping[str, MeshAxes] | None = None,
              activations: Mapping[str, MeshAxes] | None = None) -> "Rules":
    """A copy with some entries overridden (e.g. replace(params={'embed': None}) for no FSDP)."""
    return Rules({**self.params, **(params or {})}, {**self.activations, **(activations or {})})

  @property
  def batch_axes(self) -> tuple[str, ...]:
    return _as_tuple(self.activations["batch"])


DEFAULT_RULES = Rules(dict(PARAM_RULES), dict(ACTIVATION_RULES))

_CURRENT: contextvars.ContextVar[Rules] = contextvars.ContextVar("horizon_rules", default=DEFAULT_RULES)


@contextlib.contextmanager
def use_rules(rules: Rules) -> Iterator[Rules]:
  token = _CURRENT.set(rules)
  try:
    yield rules
  finally:
    _CURRENT.reset(token)


def current_rules() -> Rules:
  return _CURRENT.get()


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(logical: Sequence[str | None], table: Mapping[str, MeshAxes],
                    what: str = "array") -> P:
  """PartitionSpec for logical dim names under one column of the rules."""
  used: set[str] = set()
  out = []
  for name in logical:
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise ShardingError(f"{what}: logical axis {name!r} has no rule; add it to sharding/rules.py "
                          f"(known: {sorted(table)}).")
    axes = tuple(a for a in _as_tuple(table[name]) if a not in used)
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def _padded(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(spec))


def _axis_size(mesh_shape: Mapping[str, int], entry) -> int:
  return math.prod(mesh_shape[a] for a in _as_tuple(entry))


def check_divisible(what: str, shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int],
                    logical: Sequence[str | None] | None = None) -> None:
  """Raises ShardingError naming the array, the dim and the mesh axes if a split is uneven."""
  for i, (dim, entry) in enumerate(zip(shape, _padded(spec, len(shape)), strict=True)):
    n = _axis_size(mesh_shape, entry)
    if n > 1 and dim % n:
      name = f" ({logical[i]!r})" if logical else ""
      raise ShardingError(
          f"{what}: dim {i}{name} of size {dim} is split over mesh axes {_as_tuple(entry)} of total "
          f"size {n}, which does not divide it. Change the config dim to a multiple of {n}, change "
          f"the mesh, or map that logical axis to None in sharding/rules.py.")


def _variable_spec(path, var: nnx.Variable, mesh_shape, table) -> P:
  what = "param " + jax.tree_util.keystr(path)
  logical = var.get_metadata().get("axes")
  value = var.get_value()
  if logical is None:
    raise ShardingError(f"{what}: has no `axes` metadata; create it with model.layers.param or "
                        "pass axes=(...) to the Variable.")
  storage = var.get_metadata().get("storage_axes")
  if storage is not None:  # model.quant.MXFP4Weight: {'blocks', 'scales'} with their own axes
    storage, out = dict(storage), {}
    for part, arr in value.items():
      spec = logical_to_spec(storage[part], table, f"{what}[{part}]")
      check_divisible(f"{what}[{part}]", arr.shape, spec, mesh_shape, storage[part])
      out[part] = spec
    return out
  if isinstance(logical, str) or len(logical) > len(value.shape):  # zip() raised a bare ValueError
    raise ShardingError(f"{what}: axes={logical!r} is not a tuple of one logical name (or None) per dim "
                        f"of its shape {tuple(value.shape)}.")
  spec = logical_to_spec(logical, table, what)
  check_divisible(what, value.shape, spec, mesh_shape, logical)
  return spec


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def state_specs(state: Any, mesh_shape: Mapping[str, int], rules: Rules | None = None) -> Any:
  """Same tree as `state` (an nnx.State, possibly abstract), Variables holding PartitionSpecs."""
  table = (rules or current_rules()).params
  return jax.tree_util.tree_map_with_path(
      lambda p, v: v.replace(_variable_spec(p, v, mesh_shape, table)), state, is_leaf=_is_var)


def state_shardings(state: Any, mesh: jax.sharding.Mesh, rules: Rules | None = None) -> Any:
  """Same tree as `state`, Variables holding NamedShardings on `mesh`."""
  specs = state_specs(state, dict(mesh.shape), rules)
  def to_sharding(v):
    return v.replace(jax.tree.map(lambda spec: NamedSharding(mesh, spec), v.get_value(),
                                  is_leaf=lambda x: isinstance(x, P)))
  return jax.tree.map(to_sharding, specs, is_leaf=_is_var)


def activation_spec(logical: Sequence[str | None], shape: Sequence[int],
                    mesh_shape: Mapping[str, int], rules: Rules | None = None) -> P:
  """The activation PartitionSpec, leaving whole any dim its mesh axes do not divide.

  Activations have data-dependent shapes (a decode batch of 1, an odd prompt
  length), so an uneven split is not an error here: that dim is left to the
  partitioner.
  """
  spec = logical_to_spec(logical, (rules or current_rules()).activations, "activation")
  out = []
  for dim, entry in zip(shape, spec, strict=True):
    axes = tuple(a for a in _as_tuple(entry) if a in mesh_shape)
    out.append(entry if axes and dim % _axis_size(mesh_shape, axes) == 0 else None)
  return P(*out)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint by logical names; a no-op when no mesh is active."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  if len(logical) != x.ndim:
    raise ShardingError(f"constrain: {len(logical)} logical names {tuple(logical)} for shape {x.shape}.")
  return jax.lax.with_sharding_constraint(x, activation_spec(logical, x.shape, dict(mesh.shape)))


def per_shard(fn, args: Sequence[jax.Array], in_logical: Sequence[Sequence[str | None]],
              out_logical: Any) -> Any:
  """fn(*args) run on each device's shard, laid out by logical names (a no-op without a mesh).

  XLA cannot partition a Pallas kernel (a custom call): under a sharded jit it
  would gather every input to every device. The model's kernel calls go
  through here instead, so each device runs the kernel on its own rows (and
  heads, where the maths allows). Dims whose mesh axes do not divide them stay
  whole, for inputs and outputs alike, so fn always sees consistent shapes.

  Args:
    fn: a function of len(args) arrays; must be correct on any shard of the
      dims named in in_logical (e.g. independent over 'batch').
    in_logical: one tuple of logical names per arg (activation rules).
    out_logical: the same structure as fn's output, one tuple per array.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*args)
  shape = dict(mesh.shape)
  in_specs = tuple(activation_spec(lg, a.shape, shape)
                   for a, lg in zip(args, in_logical, strict=True))
  outs = jax.eval_shape(fn, *args)
  # outs is a prefix of out_logical: each array's leaf meets its whole tuple of names.
  out_specs = jax.tree.map(lambda o, lg: activation_spec(lg, o.shape, shape), outs, out_logical)
  return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def per_device_bytes(shape: Sequence[int], itemsize: float, spec: P,
                     mesh_shape: Mapping[str, int]) -> float:
  """Bytes one device holds of an array of `shape` laid out with `spec`."""
  n = 1
  for dim, entry in zip(shape, _padded(spec, len(shape)), strict=True):
    n *= -(-dim // _axis_size(mesh_shape, entry))
  return n * itemsize
