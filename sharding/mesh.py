"""Device meshes built from config: axes `data`, `fsdp`, `expert`, `tensor`.

`config.mesh` holds one size per axis; at most one may be -1 ("whatever is
left"). The product must equal the number of devices. Axes are Auto (XLA's
SPMD partitioner propagates shardings between the constraints we set), the
MaxText convention:

  data   -- pure data parallelism: batch split, parameters replicated.
  fsdp   -- batch split *and* parameters split over their model dim (ZeRO-3):
            weights are all-gathered per layer and gradients reduce-scattered.
  expert -- batch split for the dense parts; MoE expert weights split over
            their expert dim, tokens exchanged with all-to-all (see
            `sharding.expert_parallel`).
  tensor -- Megatron-style: attention heads, FFN width and vocab split; the
            batch is replicated over it.

`activate(mesh)` makes a mesh current for tracing: `jax.set_mesh` plus the
logical-axis rules (`sharding.rules`), which model code reads through
`sharding.rules.constrain` and the MoE layer through the abstract mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from sharding import rules as rules_lib

MESH_AXES = ("data", "fsdp", "expert", "tensor")


class MeshError(ValueError):
  """A mesh config that cannot be built on the available devices."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int
  fsdp: int
  expert: int
  tensor: int

  @classmethod
  def from_config(cls, mesh_cfg: Any) -> "MeshConfig":
    d = dict(mesh_cfg.items()) if hasattr(mesh_cfg, "items") else dict(mesh_cfg)
    unknown = sorted(set(d) - set(MESH_AXES))
    missing = sorted(set(MESH_AXES) - set(d))
    if unknown or missing:
      raise MeshError(f"config.mesh: unknown axes {unknown}, missing axes {missing}; config.mesh must "
                      f"have exactly {MESH_AXES} (sizes, one may be -1).")
    for name in MESH_AXES:
      v = d[name]
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or (v < 1 and v != -1):
        raise MeshError(f"config.mesh.{name}={v!r}: must be a positive int or -1 (fill).")
    if sum(d[n] == -1 for n in MESH_AXES) > 1:
      raise MeshError(f"config.mesh: at most one axis may be -1; got {d}.")
    return cls(**{n: int(d[n]) for n in MESH_AXES})

  @classmethod
  def parse(cls, text: str) -> "MeshConfig":
    """'data=2,expert=4' or '2,1,4,1' (data,fsdp,expert,tensor); unnamed axes default to 1."""
    text = text.strip()

    def size(value: str) -> int:
      try:
        return int(value)
      except ValueError:
        raise MeshError(f"--mesh={text!r}: {value.strip()!r} is not an axis size (int; -1 fills)") from None

    if "=" in text:
      d, given = {n: 1 for n in MESH_AXES}, set()
      for part in text.split(","):
        name, _, value = (x.strip() for x in part.partition("="))
        if name not in MESH_AXES:
          raise MeshError(f"--mesh: unknown axis {name!r} in {text!r}; axes are {MESH_AXES}.")
        if name in given:  # the last one silently won
          raise MeshError(f"--mesh={text!r}: axis {name!r} is given twice; give each axis once.")
        given.add(name)
        d[name] = size(value)
    else:
      parts = [size(p) for p in text.split(",")]
      if len(parts) != len(MESH_AXES):
        raise MeshError(f"--mesh={text!r}: give {len(MESH_AXES)} sizes {MESH_AXES} or name=size pairs.")
      d = dict(zip(MESH_AXES, parts, strict=True))
    # Checked here so that the errors name --mesh (from_config's name the config.mesh fields).
    bad = [f"{n}={v}" for n, v in d.items() if v < 1 and v != -1]
    if bad:
      raise MeshError(f"--mesh={text!r}: axis size {', '.join(bad)} must be a positive int or -1 (fill).")
    if list(d.values()).count(-1) > 1:
      raise MeshError(f"--mesh={text!r}: at most one axis may be -1 (fill); give the others their sizes.")
    return cls.from_config(d)

  def resolve(self, num_devices: int, where: str = "config.mesh") -> tuple[int, ...]:
    """Axis sizes with -1 filled in; checks num_devices >= 1 and that the product equals it.

    where: how errors name the mesh (the config field, or the flag it was parsed from).
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
      raise MeshError(f"{where}: a mesh needs at least 1 device, got num_devices={num_devices!r}.")
    sizes = [getattr(self, n) for n in MESH_AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise MeshError(f"{where} {dict(zip(MESH_AXES, sizes, strict=True))}: the fixed axes "
                        f"multiply to {known}, which does not divide {num_devices} devices.")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise MeshError(f"{where} {dict(zip(MESH_AXES, sizes, strict=True))} has "
                      f"{math.prod(sizes)} devices but {num_devices} are available; make the "
                      "product match or set one axis to -1.")
    return tuple(sizes)


def make_mesh(mesh_cfg: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh with axes MESH_AXES from `config.mesh` (a ConfigDict, dict or MeshConfig).

  devices: default all devices (every process's, for multi-host runs).
  jax.make_mesh orders devices for the physical topology (ICI rings on TPU).
  """
  cfg = mesh_cfg if isinstance(mesh_cfg, MeshConfig) else MeshConfig.from_config(mesh_cfg)
  devices = list(jax.devices() if devices is None else devices)
  shape = cfg.resolve(len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: rules_lib.Rules | None = None) -> Iterator[Mesh]:
  """Makes `mesh` (and `rules`) current while tracing/running model code."""
  with jax.set_mesh(mesh), rules_lib.use_rules(rules or rules_lib.DEFAULT_RULES):
    yield mesh
