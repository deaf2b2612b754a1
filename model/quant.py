"""MXFP4 weights in the model: which weights, how they are stored, how they are read.

Storage follows the OCP Microscaling spec (MX v1.0) in the gpt-oss layout
(`pallas_kernels.mxfp4.format`): a dense weight whose block axis (its
contraction axis K) is moved last becomes `blocks` uint8 [..., K/32, 16] (two
E2M1 codes per byte, low nibble first) and `scales` uint8 [..., K/32] (E8M0,
exponent + 127): 4 + 8/32 = 4.25 bits per weight. A routed expert weight
w_gate [e, d, f] (contracting d) is stored as [e, f, d/32, 16] + [e, f, d/32],
exactly gpt-oss's [experts, out, in/32, 16].

`MXFP4Weight` is an `nnx.Variable` whose value is {'blocks', 'scales'}, so it
is checkpointed as two uint8 arrays and is not an `nnx.Param` (frozen: the
optimizer never sees it). Reading it like a parameter, `w[...]`, dequantizes
to the dense weight in its original layout and dtype; every linear layer
therefore runs unchanged (the XLA path: dequantize, then matmul). The MoE
experts with `config.model.kernels` = pallas read the packed bytes directly
through the fused MXFP4 grouped-matmul kernel instead.

Which weights (`config.model.quantization`), decided per tensor by `plan` --
a pure function of the model's shapes, so the model that loads a checkpoint
(`model.decoder.abstract_model`) quantizes exactly the tensors the converter
wrote as MXFP4:
  * "experts": the routed experts' w_gate, w_up, w_down. They hold ~97% of
    the full design's parameters, and MoE experts tolerate 4-bit weights
    best (gpt-oss ships exactly this). A layer's three are quantized together
    or not at all (the fused kernel reads them together), and only along
    their true contraction axis, so d_model and expert_dim must be multiples
    of 32.
  * "all-linear": additionally every other linear weight of the language
    model (attention projections, dense and shared-expert FFNs, Delta
    projections) that has an axis of a multiple of 32: its contraction axis
    K, else -- the XLA path dequantizes the whole weight, so any blocking is
    exact to read -- another axis (the plan notes which).
Kept dense, with the reason `plan` reports: the token embedding (a gather)
and LM head (the logits), the router (small; routing is sensitive), the
lightning indexer (its scores pick the top-k keys each query attends to, a
discrete choice 4-bit error would change, for 0.2% of `small`'s and 0.012% of
`full`'s weights), norms, biases and other vectors, the Delta depthwise conv,
the vision encoder, and weights without an axis of a multiple of 32.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention.dsa import GatedDSA
from model.moe import MoE
from pallas_kernels.mxfp4 import format as mx

BLOCK = mx.BLOCK  # elements per E8M0 scale
MXFP4_BITS = 4 + 8 / BLOCK  # an E2M1 nibble per weight + an E8M0 byte per block
WHATS = ("experts", "all-linear")
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
INDEXER_WEIGHTS = ("w_qi", "w_ki", "w_w")  # model.attention.dsa.GatedDSA's lightning indexer
_CONTRACTION_FIRST = frozenset({"expert", "heads", "vit_heads"})
_KEEP_DENSE = {
    "embed": "token embedding: a gather, not a matmul",
    "head": "LM head: the logits are kept in high precision",
    "w_router": "router: small, and routing is sensitive to its error",
    "conv_w": "Delta depthwise conv: not a matmul",
}
_INDEXER_REASON = ("lightning indexer: its scores pick each query's top-k keys, a choice 4-bit error "
                   "would change; 0.2% of small's weights")


class MXFP4Weight(nnx.Variable):
  """A frozen MXFP4 weight; `w[...]` is the dense weight (see the module docstring).

  Metadata: `axis` (position of the block axis in the dense weight),
  `dense_dtype` (dtype `w[...]` returns), `axes` (logical axes of the dense
  weight, for sharding rules), `storage_axes` (those of the packed arrays, see `storage_axes`).
  """

  def dense(self) -> jax.Array:
    meta = self.get_metadata()
    v = self.get_value()
    w = jnp.moveaxis(mx.dequantize(v["blocks"], v["scales"], jnp.dtype(meta["dense_dtype"])), -1,
                     meta["axis"])
    if jax.default_backend() == "cpu":
      # XLA:CPU folds the moveaxis into the dot that reads w, and its DotThunk then rejects some
      # bf16 batched dots (MLA's w_uk, 'bthk,chk->bthc': "Unsupported element type BF16 x BF16 =
      # F32"). The barrier keeps w in its own buffer; on CPU nothing fuses into a dot anyway.
      w = jax.lax.optimization_barrier(w)
    return w

  def __getitem__(self, key):
    return self.dense()[key]

  @property
  def blocks(self) -> jax.Array:
    return self.get_value()["blocks"]

  @property
  def scales(self) -> jax.Array:
    return self.get_value()["scales"]


@dataclasses.dataclass(frozen=True)
class Decision:
  """What `quantize_model` does with one variable: MXFP4 along `axis`, or dense (axis None).

  `reason` says why a tensor stays dense, or notes how a quantized one is
  blocked when that is not along its contraction axis.
  """
  path: str
  shape: tuple[int, ...]
  dtype: str
  axis: int | None
  reason: str = ""

  @property
  def mxfp4(self) -> bool:
    return self.axis is not None

  @property
  def elements(self) -> int:
    return int(np.prod(self.shape))

  @property
  def bits_per_weight(self) -> float:
    return MXFP4_BITS if self.mxfp4 else 8.0 * jnp.dtype(self.dtype).itemsize

  @property
  def bytes_before(self) -> int:
    return self.elements * jnp.dtype(self.dtype).itemsize

  @property
  def bytes_after(self) -> int:
    return self.elements * (BLOCK // 2 + 1) // BLOCK if self.mxfp4 else self.bytes_before


def storage_axes(axes: tuple, axis: int) -> tuple[tuple[str, tuple], ...]:
  """Logical axes of the packed arrays: K moved last, split into (K/32 blocks, 16 bytes).

  Pairs (part, axes), not a dict, so that a quantized model's graphdef hashes like a dense one's and
  engines over models of one quantized config share their compiled programs
  (`serving.batch.shared_by_graphdef`); `dict(...)` of it reads a part's axes."""
  rest = tuple(a for i, a in enumerate(axes) if i != axis)
  return (("blocks", rest + (None, None)), ("scales", rest + (None,)))


def contraction_axis(shape: tuple[int, ...], axes: tuple) -> int:
  """The input axis K of a dense weight: 1 for routed experts [e, in, out] and head-major
  projections [h, k, out], 0 otherwise."""
  return 1 if axes and axes[0] in _CONTRACTION_FIRST and len(shape) > 2 else 0


def block_axis(shape: tuple[int, ...], axes: tuple) -> tuple[int | None, str]:
  """(axis blocked in 32s, note): K when it is a multiple of 32, else another axis that is, else None."""
  k = contraction_axis(shape, axes)
  if shape[k] % BLOCK == 0:
    return k, ""
  for i, n in enumerate(shape):
    if n % BLOCK == 0:
      return i, f"blocks along axis {i} ({n}): K={shape[k]} is not a multiple of {BLOCK}"
  return None, f"K={shape[k]} not a multiple of {BLOCK}, nor any other axis"


def _axes(var: nnx.Variable, ndim: int) -> tuple:
  return tuple(var.get_metadata().get("axes") or (None,) * ndim)


def _experts_problem(moe: MoE) -> str:
  """Why a MoE layer's routed experts cannot be MXFP4 ('' when they can)."""
  bad = [f"{n} K={getattr(moe, n).get_value().shape[1]}" for n in EXPERT_WEIGHTS
         if isinstance(getattr(moe, n), nnx.Param) and getattr(moe, n).get_value().shape[1] % BLOCK]
  if not bad:
    return ""
  return (f"routed experts: {', '.join(bad)} not a multiple of {BLOCK} (a layer's w_gate, w_up and "
          "w_down are quantized together, as the fused kernel reads them)")


def _fixed_reason(path: tuple, module: nnx.Module, name: str, var: nnx.Variable) -> str:
  """Why a variable is never quantized, whatever `what` ('' for a linear weight)."""
  if "vision" in path:
    return "vision encoder: not quantized"
  if not isinstance(var, nnx.Param):
    return f"{type(var).__name__}: not a weight"
  if var.get_value().ndim < 2:
    return "vector (norm scale, bias, gate parameter): not a linear"
  if name in _KEEP_DENSE:
    return _KEEP_DENSE[name]
  if isinstance(module, GatedDSA) and name in INDEXER_WEIGHTS:
    return _INDEXER_REASON
  return ""


def _already_mxfp4(path: str, var: MXFP4Weight) -> Decision:
  meta, blocks = var.get_metadata(), var.blocks
  moved, k = tuple(blocks.shape[:-2]), blocks.shape[-2] * BLOCK
  shape = moved[:meta["axis"]] + (k,) + moved[meta["axis"]:]
  return Decision(path, shape, meta["dense_dtype"], meta["axis"], "already MXFP4")


def _decide(module: nnx.Module, name: str, var: nnx.Variable, path: tuple, what: str) -> Decision:
  text = "/".join(str(p) for p in (*path, name))
  if isinstance(var, MXFP4Weight):
    return _already_mxfp4(text, var)
  value = var.get_value()
  shape, axis = tuple(value.shape), None
  reason = _fixed_reason(path, module, name, var)
  if reason:
    pass
  elif isinstance(module, MoE) and name in EXPERT_WEIGHTS:
    reason = _experts_problem(module)
    axis = None if reason else 1
  elif what == "all-linear":
    axis, reason = block_axis(shape, _axes(var, len(shape)))
  else:
    reason = f"not selected by --what={what}"
  return Decision(text, shape, str(jnp.dtype(value.dtype)), axis, reason)


def _walk(model: nnx.Module) -> Iterator[tuple[nnx.Module, str, nnx.Variable, tuple]]:
  """(module, attribute, variable, module path) of every variable, in graph order."""
  for path, module in nnx.iter_graph(model):
    if isinstance(module, nnx.Module):
      for name, var in list(vars(module).items()):
        if isinstance(var, nnx.Variable):
          yield module, name, var, tuple(path)


def _planned(model: nnx.Module, what: str) -> list[tuple[nnx.Module, str, nnx.Variable, Decision]]:
  if what not in WHATS:
    raise ValueError(f"quantize: what={what!r}; choose 'experts' or 'all-linear'.")
  return [(m, name, var, _decide(m, name, var, path, what)) for m, name, var, path in _walk(model)]


def plan(model: nnx.Module, what: str) -> list[Decision]:
  """What `quantize_model(model, what)` does with each variable (real or abstract model).

  A pure function of the model's shapes and `what`: building a model from a
  config with `quantization=what` makes the same decisions, so a converted
  checkpoint loads into exactly its own structure.
  """
  return [d for *_, d in _planned(model, what)]


def _quantize_variable(var: nnx.Param, axis: int, mode: str) -> MXFP4Weight:
  value = var.get_value()
  axes = _axes(var, value.ndim)
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


def _check_fused_experts(module: nnx.Module, decision: Decision) -> None:
  """MoE layers of a quantized config on the Pallas path need their experts in MXFP4."""
  cfg = module.cfg
  if cfg.quantization != "none" and cfg.use_pallas:
    raise ValueError(f"quantize: {decision.path}: config.model.kernels={cfg.kernels!r} runs the "
                     f"routed experts through the fused MXFP4 kernel, but they stay dense "
                     f"({decision.reason}); use config.model.kernels='xla' for this model.")


def quantize_model(model: nnx.Module, what: str, mode: str = "floor") -> list[str]:
  """Replaces the nnx.Params that `plan(model, what)` marks MXFP4 by MXFP4Weight, in place.

  Works on real and abstract (`nnx.eval_shape`) models alike. Returns the
  paths of the quantized weights.
  """
  done = []
  for module, name, var, d in _planned(model, what):
    if d.mxfp4 and isinstance(var, nnx.Param):
      setattr(module, name, _quantize_variable(var, d.axis, mode))
      done.append(d.path)
    elif isinstance(module, MoE) and name == "w_gate" and not d.mxfp4:
      _check_fused_experts(module, d)
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
