"""Serving weights in the compute dtype, converted once instead of at every step.

Checkpoints keep f32 master weights, and the model converts each weight to the compute
dtype where it uses it (`model.layers.einsum`: `w.astype(dtype)`). In training that is
the mixed-precision recipe; in serving it makes every decode step read 4 bytes per weight,
write a 2-byte copy and read that again, for a result that never changes. The engine
converts those weights once, at load and at every `update_weights`.

Which weights: exactly those whose every use in the engine's programs is a conversion to
the compute dtype. They are found by tracing the programs (`jax.make_jaxpr`) and following
each weight through nested calls (`jit`, `custom_vjp`, `checkpoint`, `scan` and `while` bodies, ...):
a weight that is also used in f32 (norm scales, the delta rule's gates, the router, the
conv taps), returned, or passed to a construct the walk does not follow stays as stored.
Converting x to bf16 once or at every use gives the same bits, so the programs compute
exactly what they computed before (tests/test_serving_weights.py checks it bitwise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serving import decode_loop

__all__ = ["castable_inputs", "compute_dtype_state", "engine_castable"]


def _nested(eqn: Any) -> list[Any]:
  """The eqn's sub-jaxprs (open) whose inputs are the eqn's inputs, position for position."""
  out = []
  for v in eqn.params.values():
    inner = v.jaxpr if isinstance(v, jax.extend.core.ClosedJaxpr) else v
    if isinstance(inner, jax.extend.core.Jaxpr) and len(inner.invars) == len(eqn.invars):
      out.append(inner)
  return out


# Data movement that commutes with a conversion (convert(op(w)) == op(convert(w)), bit for bit):
# a weight's rows gathered, sliced or reshaped before their conversion count as the weight.
_MOVES = frozenset({"gather", "dynamic_slice", "slice", "reshape", "transpose", "broadcast_in_dim",
                    "squeeze", "expand_dims", "rev", "copy", "copy_p"})


def _walk(jaxpr: Any, dtype: Any) -> tuple[list[bool], list[int | None]]:
  """(for each input: is every use a conversion to `dtype`, a move of it, or such a use inside a
  nested call; for each output: the input it is a moved copy of, or None)."""
  ok = [True] * len(jaxpr.invars)
  root = {id(v): i for i, v in enumerate(jaxpr.invars)}  # a tracked value -> the input it moves
  for eqn in jaxpr.eqns:
    uses = [(pos, v) for pos, v in enumerate(eqn.invars) if id(v) in root]
    if not uses:
      continue
    name = eqn.primitive.name
    if name == "convert_element_type" and np.dtype(eqn.params["new_dtype"]) == dtype:
      continue
    if name in _MOVES and [pos for pos, _ in uses] == [0]:
      root[id(eqn.outvars[0])] = root[id(eqn.invars[0])]
      continue
    if name == "while":
      _walk_while(eqn, uses, ok, root, dtype)
      continue
    nested = _nested(eqn)
    if len(nested) != 1:  # a primitive that computes with it, or a construct not followed
      for _, v in uses:
        ok[root[id(v)]] = False
      continue
    inner_ok, inner_alias = _walk(nested[0], dtype)
    for pos, v in uses:
      ok[root[id(v)]] = ok[root[id(v)]] and inner_ok[pos]
    if len(inner_alias) == len(eqn.outvars):
      for out, a in zip(eqn.outvars, inner_alias, strict=True):
        if a is not None and id(eqn.invars[a]) in root:
          root[id(out)] = root[id(eqn.invars[a])]
  return ok, [root.get(id(v)) for v in jaxpr.outvars]


def _walk_while(eqn: Any, uses: list, ok: list[bool], root: dict, dtype: Any) -> None:
  """A `while` loop (the engine's decode loop): its inputs are cond consts, body consts, carry. A
  weight entering as a body or cond const is followed into that body; one in the carry (it would
  flow around the loop and out) counts as a use that computes with it."""
  nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
  body_ok, _ = _walk(eqn.params["body_jaxpr"].jaxpr, dtype)
  cond_ok, _ = _walk(eqn.params["cond_jaxpr"].jaxpr, dtype)
  for pos, v in uses:
    inner = cond_ok[pos] if pos < nc else body_ok[pos - nc] if pos < nc + nb else False
    ok[root[id(v)]] = ok[root[id(v)]] and inner


def _castable(jaxpr: Any, dtype: Any) -> list[bool]:
  """For each input of a whole program: may it be converted to `dtype` before the program?"""
  ok, returned = _walk(jaxpr, dtype)
  for r in returned:
    if r is not None:
      ok[r] = False
  return ok


def castable_inputs(fn: Callable, args: Sequence[Any], dtype: Any) -> list[bool]:
  """Per leaf of args[0]: float leaves that `fn(*args)` only ever converts to `dtype`."""
  closed = jax.make_jaxpr(fn)(*args)
  flags = _castable(closed.jaxpr, np.dtype(dtype))
  leaves = jax.tree.leaves(args[0])
  return [f and jnp.issubdtype(leaf.dtype, jnp.floating) and np.dtype(leaf.dtype) != np.dtype(dtype)
          for f, leaf in zip(flags[:len(leaves)], leaves, strict=True)]


def compute_dtype_state(state: Any, castable: Sequence[bool], dtype: Any) -> Any:
  """`state` with the castable leaves converted to `dtype` (the others as they are)."""
  leaves, treedef = jax.tree.flatten(state)
  if len(leaves) != len(castable):
    raise ValueError(f"compute_dtype_state: {len(leaves)} leaves, {len(castable)} flags; the state's "
                     "structure changed since the programs were traced.")
  out = [x.astype(dtype) if c else x for x, c in zip(leaves, castable, strict=True)]
  return jax.tree.unflatten(treedef, out)


def engine_castable(fns: Mapping[str, Any], state: Any, cache: Any, cfg: Any, prefill_chunk: int,
                    decode_rows: Sequence[int], has_vision: bool) -> list[bool] | None:
  """Per leaf of `state`: do all of the engine's programs `fns` (prefill, decode_loop, and the vision
  encoder when the model has one) only convert it to the compute dtype? None when every leaf
  already is in that dtype. cache: the engine's decode state; prefill_chunk, decode_rows: its program
  shapes (the decode program at each row count B it runs: the MoE path depends on B)."""
  dtype = cfg.jnp_dtype
  if all(np.dtype(a.dtype) == np.dtype(dtype) for a in jax.tree.leaves(state)):
    return None
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  st, cache = jax.tree.map(spec, state), jax.tree.map(spec, cache)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
  c = prefill_chunk
  programs = [(fns["prefill"], (st, cache, i32(), i32(1, c), i32(1),
                                jax.ShapeDtypeStruct((1, c, cfg.d_model), dtype))),
              *((fns["decode_loop"], (st, cache, *decode_loop.input_specs(b, cfg.vocab_size)))
                for b in decode_rows)]
  if has_vision:
    v = cfg.vision
    shape = (1, v.image_size, v.image_size, v.num_channels)
    programs.append((fns["encode"], (st, jax.ShapeDtypeStruct(shape, jnp.float32))))
  flags = [castable_inputs(fn, args, dtype) for fn, args in programs]
  return [all(f) for f in zip(*flags, strict=True)]
