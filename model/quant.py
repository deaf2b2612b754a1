"""MXFP4 weights in the model: which weights, how they are stored, how they are read.

Storage follows the OCP Microscaling spec (MX v1.0) in the gpt-oss layout
(`pallas_kernels.mxfp4.format`): a dense weight whose contraction axis K is
moved last becomes `blocks` uint8 [..., K/32, 16] (two E2M1 codes per byte,
low nibble first) and `scales` uint8 [..., K/32] (E8M0, exponent + 127). A
routed expert weight w_gate [e, d, f] (contracting d) is stored as
[e, f, d/32, 16] + [e, f, d/32], exactly gpt-oss's [experts, out, in/32, 16].

`MXFP4Weight` is an `nnx.Variable` whose value is {'blocks', 'scales'}, so it
is checkpointed as two uint8 arrays and is not an `nnx.Param` (frozen: the
optimizer never sees it). Reading it like a parameter, `w[...]`, dequantizes
to the dense weight in its original layout and dtype; every linear layer
therefore runs unchanged (the XLA path: dequantize, then matmul). The MoE
experts with `config.model.kernels` = pallas read the packed bytes directly
through the fused MXFP4 grouped-matmul kernel instead.

What is quantized (`config.model.quantization`):
  * "experts": the routed experts' w_gate, w_up, w_down. They hold ~97% of
    the full design's parameters, and MoE experts tolerate 4-bit weights
    best (gpt-oss ships exactly this).
  * "all-linear": additionally every other linear weight of the language
    model (attention projections, dense and shared-expert FFNs, indexer,
    Delta projections). Kept in high precision on purpose: the token
    embedding and LM head (gathers / logits), the router (tiny, and routing is
    sensitive), norms, biases, the Delta depthwise conv and the vision encoder.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.mxfp4 import format as mx

BLOCK = mx.BLOCK  # elements per E8M0 scale
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
_KEEP_DENSE = frozenset({"embed", "head", "w_router", "conv_w"})
_CONTRACTION_FIRST = frozenset({"expert", "heads", "vit_heads"})


class MXFP4Weight(nnx.Variable):
  """A frozen MXFP4 weight; `w[...]` is the dense weight (see the module docstring).

  Metadata: `axis` (position of the contraction axis K in the dense weight),
  `dense_dtype` (dtype `w[...]` returns), `axes` (logical axes of the dense
  weight, for sharding rules).
  """

  def dense(self) -> jax.Array:
    meta = self.get_metadata()
    v = self.get_value()
    w = mx.dequantize(v["blocks"], v["scales"], jnp.dtype(meta["dense_dtype"]))
    return jnp.moveaxis(w, -1, meta["axis"])

  def __getitem__(self, key):
    return self.dense()[key]

  @property
  def blocks(self) -> jax.Array:
    return self.get_value()["blocks"]

  @property
  def scales(self) -> jax.Array:
    return self.get_value()["scales"]


def storage_axes(axes: tuple, axis: int) -> dict[str, tuple]:
  """Logical axes of the packed arrays: K moved last, split into (K/32 blocks, 16 bytes)."""
  rest = tuple(a for i, a in enumerate(axes) if i != axis)
  return {"blocks": rest + (None, None), "scales": rest + (None,)}


def contraction_axis(name: str, shape: tuple[int, ...], axes: tuple) -> int:
  """Which axis of a dense weight is quantized in blocks of 32.

  The contraction axis (the input dim): axis 1 for routed experts [e, in, out]
  and head-major projections [h, k, out], axis 0 otherwise. The XLA path
  dequantizes the whole weight, so when that axis is not a multiple of 32 any
  other axis that is serves as well; the fused expert kernel needs the true
  contraction axis (checked by `quantize_model`).
  """
  first = 1 if axes and axes[0] in _CONTRACTION_FIRST and len(shape) > 2 else 0
  if shape[first] % BLOCK == 0:
    return first
  for i, n in enumerate(shape):
    if n % BLOCK == 0:
      return i
  raise ValueError(f"quantize: weight {name} of shape {shape} has no axis divisible by {BLOCK} "
                   "(MXFP4 scales cover 32 consecutive elements); keep it dense or change the "
                   "model dims (config.model.*) to multiples of 32.")


def _targets(model: nnx.Module, what: str) -> list[tuple[nnx.Module, str, str, bool]]:
  """(module, attribute, path, is a routed expert weight) of every weight `what` selects."""
  from model.moe import MoE  # noqa: PLC0415 - model.moe imports this module

  if what not in ("experts", "all-linear"):
    raise ValueError(f"quantize: what={what!r}; choose 'experts' or 'all-linear'.")
  out = []
  for path, module in nnx.iter_graph(model):
    if not isinstance(module, nnx.Module) or "vision" in path:
      continue
    for name, var in list(vars(module).items()):
      if not isinstance(var, nnx.Param):
        continue
      is_expert = isinstance(module, MoE) and name in EXPERT_WEIGHTS
      dense_linear = (what == "all-linear" and name not in _KEEP_DENSE and var.ndim >= 2)
      if is_expert or dense_linear:
        out.append((module, name, "/".join(str(p) for p in (*path, name)), is_expert))
  return out


def _quantize_variable(var: nnx.Param, name: str, expert: bool, mode: str) -> MXFP4Weight:
  value = var.get_value()
  axes = tuple(var.get_metadata().get("axes") or (None,) * value.ndim)
  axis = contraction_axis(name, value.shape, axes)
  if expert and axis != 1:
    raise ValueError(f"quantize: routed expert weight {name} {value.shape} needs its contraction "
                     f"axis (1, size {value.shape[1]}) divisible by {BLOCK}; change "
                     "config.model.d_model / expert_dim to multiples of 32.")
  if isinstance(value, jax.ShapeDtypeStruct):
    moved = value.shape[:axis] + value.shape[axis + 1:]
    k = value.shape[axis]
    packed = {"blocks": jax.ShapeDtypeStruct(moved + (k // BLOCK, BLOCK // 2), jnp.uint8),
              "scales": jax.ShapeDtypeStruct(moved + (k // BLOCK,), jnp.uint8)}
  else:
    blocks, scales = mx.quantize(value, axis=axis, mode=mode)
    packed = {"blocks": blocks, "scales": scales}
  return MXFP4Weight(packed, axis=axis, dense_dtype=str(jnp.dtype(value.dtype)), axes=axes,
                     storage_axes=storage_axes(axes, axis))


def quantize_model(model: nnx.Module, what: str, mode: str = "floor") -> list[str]:
  """Replaces the selected nnx.Params of `model` by MXFP4Weight, in place.

  Works on real and abstract (`nnx.eval_shape`) models alike. Returns the
  paths of the quantized weights.
  """
  done = []
  for module, name, path, expert in _targets(model, what):
    setattr(module, name, _quantize_variable(getattr(module, name), path, expert, mode))
    done.append(path)
  return done


def quantized_bytes(model: nnx.Module) -> dict[str, int]:
  """Bytes held by MXFP4 weights and by everything else (for reports)."""
  q = other = 0
  for _, var in nnx.iter_graph(model):
    if isinstance(var, MXFP4Weight):
      q += sum(int(np.prod(a.shape)) for a in jax.tree.leaves(var.get_value()))
    elif isinstance(var, nnx.Variable):
      v = var.get_value()
      other += int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
  return {"mxfp4": q, "other": other}
