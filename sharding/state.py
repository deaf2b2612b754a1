"""Creating model state directly in its sharded layout.

`create_sharded_model` never materialises a full replica anywhere: the model's
shapes come from `nnx.eval_shape`, the shardings from the rules table, and the
initialiser runs under `jit` with those shardings as `out_shardings`, so each
device computes (and holds) only its own shards. For a 2.8T-parameter model
this is the only way to initialise it.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
from flax import nnx

from sharding import mesh as mesh_lib
from sharding import rules as rules_lib

M = TypeVar("M", bound=nnx.Module)


def create_sharded_model(build: Callable[[], M], mesh: jax.sharding.Mesh,
                         rules: rules_lib.Rules | None = None) -> M:
  """Builds `build()` with every Variable already sharded on `mesh`.

  Args:
    build: zero-argument constructor (e.g. `lambda: Horizon(cfg, rngs=nnx.Rngs(seed))`).
    mesh: the device mesh.
    rules: logical-axis rules (default: the current rules).

  Raises:
    ShardingError: a weight dim is not divisible by its mesh axes (names both).
  """
  rules = rules or rules_lib.current_rules()
  abstract = nnx.eval_shape(build)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = rules_lib.state_shardings(abstract_state, mesh, rules)

  def init():
    return nnx.state(build())

  with mesh_lib.activate(mesh, rules):
    state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def shard_model(model: M, mesh: jax.sharding.Mesh, rules: rules_lib.Rules | None = None) -> M:
  """Moves an existing model's Variables onto their rule shardings (e.g. a restored model)."""
  graphdef, state = nnx.split(model)
  shardings = rules_lib.state_shardings(state, mesh, rules)
  return nnx.merge(graphdef, jax.device_put(state, shardings))
