"""Per-device training memory of a config on a mesh, without any devices.

The library behind `experiments/memory_plan.py` (its docstring has the
commands). Rows, in bytes per device: parameters in their stored dtypes and,
as a second column, with the MoE routed-expert weights in MXFP4 (OCP MX v1.0:
4-bit E2M1 elements + one 8-bit E8M0 scale per 32 elements = 4.25
bits/element; everything else unchanged); AdamW state (mu and nu in f32 for
every nnx.Param, sharded like the params); gradients (param dtype, sharded like
the params: ZeRO-3/FSDP reduce-scatters them, so no device holds a full copy;
with gradient accumulation an accumulator of the same size is added, as
optax.MultiSteps keeps); activations of one micro-batch for the remat policy
(an ANALYTIC ESTIMATE, see `training.activation_memory`); totals; and whether
the total fits the device's HBM with 10% reserved (XLA's own scratch,
fragmentation, collectives' buffers).

Parameter bytes are exact: each Variable's shard shape comes from
`sharding.rules.state_specs` with the mesh axis sizes (ceil division, as
`per_device_bytes` does) on the abstract model (`model.decoder.abstract_model`),
so a mesh that does not divide a weight fails with the rules' ShardingError.

`validate` compiles the real train step (jax.jit of nnx.value_and_grad of a
cross-entropy loss) for a small config on one device and compares XLA's
`memory_analysis()` temp bytes with the activation estimate, per remat
policy, and the same for one block of each kind (the term the 'full' policy's
peak is made of). XLA:CPU does not realise remat's savings (a checkpointed
8-layer MLP plans the same temp bytes as an unchecked one), so on CPU the whole
step is comparable under 'none' only.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from model.config import ConfigError, ModelConfig
from model.decoder import Block, Horizon, abstract_model
from model.moe import RouterBias
from sharding import rules as rules_lib
from sharding.mesh import MESH_AXES, MeshConfig
from training import activation_memory as am

GIB = 2 ** 30
MXFP4_BITS = 4.25  # E2M1 nibble + an E8M0 byte per 32 elements
HEADROOM = 0.10  # share of HBM kept free for XLA scratch, fragmentation, collectives
REMATS = ("none", "full", "save_dots")


# ---- parameters, optimizer state, gradients (exact) ------------------------


def is_routed_expert(path: tuple, cfg: ModelConfig) -> bool:
  """blocks/<i>/ffn/{w_gate,w_up,w_down} of a MoE layer (not its shared expert)."""
  keys = [str(p) for p in path]
  return (len(keys) == 4 and keys[0] == "blocks" and keys[2] == "ffn"
          and keys[3] in ("w_gate", "w_up", "w_down") and cfg.ffn_kinds[int(keys[1])] == "moe")


def state_bytes(cfg: ModelConfig, mesh_shape: Mapping[str, int], micro_batches: int = 1,
                rules: rules_lib.Rules | None = None, state: Any = None) -> dict[str, float]:
  """Per-device bytes of parameters, optimizer state and gradients.

  Args:
    cfg: the model config.
    mesh_shape: {axis: size} for every mesh axis (no devices needed).
    micro_batches: > 1 adds a gradient accumulator (param dtype) to 'gradients'.
    rules: logical-axis rules (default: sharding.rules' table).
    state: the abstract state (default: built from cfg).

  Returns:
    bytes per device: 'params' (every Variable in its dtype, RouterBias
    included), 'params_mxfp4' (routed experts at 4.25 bits/element),
    'routed_experts', 'router_bias', 'optimizer' (AdamW mu + nu f32 per
    nnx.Param), 'gradients'; and 'param_count' (global nnx.Param elements).

  Raises:
    ShardingError: a weight dim is not divisible by its mesh axes.
  """
  if state is None:
    state = nnx.split(abstract_model(cfg))[1]
  specs = rules_lib.state_specs(state, mesh_shape, rules or rules_lib.DEFAULT_RULES)
  out = dict.fromkeys(("params", "routed_experts", "routed_expert_elems", "router_bias", "optimizer",
                       "gradients", "grad_accumulator", "param_count"), 0.0)
  flat_specs = dict(nnx.to_flat_state(specs))
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    spec = flat_specs[path].get_value()
    elems = rules_lib.per_device_bytes(value.shape, 1, spec, mesh_shape)
    nbytes = elems * jnp.dtype(value.dtype).itemsize
    out["params"] += nbytes
    if isinstance(var, RouterBias):
      out["router_bias"] += nbytes
      continue
    if not isinstance(var, nnx.Param):
      raise TypeError(f"state_bytes: {jax.tree_util.keystr(path)} is a {type(var).__name__}; "
                      "teach training/memory_plan.py how to count it.")
    out["param_count"] += math.prod(value.shape)
    out["optimizer"] += 2 * 4 * elems
    out["gradients"] += nbytes
    if micro_batches > 1:  # optax.MultiSteps-style accumulator, shaped and typed like the grads
      out["grad_accumulator"] += nbytes
    if is_routed_expert(path, cfg):
      out["routed_experts"] += nbytes
      out["routed_expert_elems"] += elems
  out["params_mxfp4"] = out["params"] - out["routed_experts"] + out["routed_expert_elems"] * MXFP4_BITS / 8
  out["gradients"] += out.pop("grad_accumulator")
  return out


# ---- activations (estimate) --------------------------------------------------


def local_batch(global_batch: int, micro_batches: int, mesh_shape: Mapping[str, int],
                rules: rules_lib.Rules | None = None) -> int:
  """Sequences per device per micro-batch: global_batch / (micro_batches * batch mesh axes)."""
  axes = (rules or rules_lib.DEFAULT_RULES).batch_axes
  shards = math.prod(mesh_shape.get(a, 1) for a in axes)
  if global_batch is None or global_batch < 1 or micro_batches < 1:
    raise ConfigError(f"--global_batch={global_batch} and --micro_batches={micro_batches} must be "
                      "positive integers.")
  if global_batch % (shards * micro_batches):
    raise ConfigError(
        f"--global_batch={global_batch} is not divisible by --micro_batches={micro_batches} x the batch "
        f"mesh axes {axes} of --mesh (product {shards}) = {shards * micro_batches}; choose a global "
        f"batch that is a multiple of {shards * micro_batches}.")
  return global_batch // (shards * micro_batches)


def check_batch_and_seq_len(cfg: ModelConfig, global_batch: int | None, seq_len: int) -> None:
  """Refuses --global_batch < 1 and --seq_len outside [1, max_seq_len] (raises naming the flag)."""
  if global_batch is None or global_batch < 1:
    raise ConfigError(f"--global_batch={global_batch} must be a positive integer (sequences per "
                      "optimizer step).")
  if seq_len < 1 or seq_len > cfg.max_seq_len:
    raise ConfigError(f"--seq_len={seq_len} must be in [1, config.model.max_seq_len={cfg.max_seq_len}].")


def plan(cfg: ModelConfig, mesh_shape: Mapping[str, int], *, global_batch: int, seq_len: int,
         micro_batches: int = 1, remat: str | None = None, backend: str = "tpu",
         exchange: str | None = None, hbm_gib: float | None = None,
         rules: rules_lib.Rules | None = None, state: Any = None) -> dict[str, Any]:
  """Everything the table prints, in bytes per device (see the module docstring)."""
  check_batch_and_seq_len(cfg, global_batch, seq_len)
  if hbm_gib is not None and (isinstance(hbm_gib, bool) or not isinstance(hbm_gib, numbers.Real)
                              or not 0 < hbm_gib < math.inf):
    raise ConfigError(f"hbm_gib={hbm_gib!r}: the device memory must be a positive number of GiB "
                      "(95: TPU v5p, 141: H200).")
  remat = remat or cfg.remat
  exchange_used = am.resolve_exchange(exchange or cfg.expert_exchange, backend)
  seqs = local_batch(global_batch, micro_batches, mesh_shape, rules)
  sb = state_bytes(cfg, mesh_shape, micro_batches, rules, state)
  loc = am.Local(seqs=seqs, seq_len=seq_len, tensor=mesh_shape.get("tensor", 1),
                 expert=mesh_shape.get("expert", 1), fsdp=mesh_shape.get("fsdp", 1),
                 backend=backend, exchange=exchange_used)
  act = am.model_activation_bytes(cfg, loc, remat)
  fixed = sb["optimizer"] + sb["gradients"] + act["total"]
  result = {
      "mesh": dict(mesh_shape), "devices": math.prod(mesh_shape.values()),
      "global_batch": global_batch, "seq_len": seq_len, "micro_batches": micro_batches,
      "local_seqs": seqs, "local_tokens": loc.tokens, "remat": remat, "backend": backend,
      "exchange": exchange_used if loc.expert > 1 else "none (expert axis 1)",
      "config_exchange": cfg.expert_exchange, "optimizer": "adamw (mu, nu f32)",
      "param_dtype": cfg.param_dtype, "param_count": int(sb["param_count"]),
      "bytes": {"params": sb["params"], "params_mxfp4": sb["params_mxfp4"],
                "routed_experts": sb["routed_experts"], "router_bias": sb["router_bias"],
                "optimizer": sb["optimizer"], "gradients": sb["gradients"],
                "activations": act["total"], "total": sb["params"] + fixed,
                "total_mxfp4": sb["params_mxfp4"] + fixed},
      "activation_detail": act,
  }
  if hbm_gib is not None:
    usable = hbm_gib * GIB * (1 - HEADROOM)
    result.update(hbm_gib=hbm_gib, usable_bytes=usable,
                  fits=result["bytes"]["total"] <= usable,
                  fits_mxfp4=result["bytes"]["total_mxfp4"] <= usable)
  return result


# ---- validation against XLA --------------------------------------------------


def compiled_train_step_temp(cfg: ModelConfig, batch: int, seq_len: int) -> int:
  """XLA's planned temp bytes of one train step (forward + backward) on the default device."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Horizon(cfg, rngs=nnx.Rngs(0))))

  def step(state, tokens, targets):
    model = nnx.merge(graphdef, state)

    def loss_fn(m):
      logits, aux = m(tokens)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
      return ce + 1e-3 * aux["z_loss"] + aux["indexer_loss"]

    return nnx.value_and_grad(loss_fn)(model)

  tok = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  compiled = jax.jit(step).lower(state, tok, tok).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def compiled_block_temp(cfg: ModelConfig, kind: str, ffn_kind: str, batch: int, seq_len: int) -> int:
  """XLA's planned temp bytes of one decoder block's forward + backward (input and weights are arguments)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Block(cfg, kind, ffn_kind, rngs=nnx.Rngs(0))))

  def step(state, x):
    def loss_fn(state, x):
      pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
      y, aux = nnx.merge(graphdef, state)(x, pos, jnp.ones((batch, seq_len), jnp.int32))
      return jnp.sum(y.astype(jnp.float32)) + sum(jnp.sum(v) for v in aux.values())

    return jax.value_and_grad(loss_fn, argnums=(0, 1))(state, x)

  x = jax.ShapeDtypeStruct((batch, seq_len, cfg.d_model), cfg.jnp_dtype)
  return int(jax.jit(step).lower(state, x).compile().memory_analysis().temp_size_in_bytes)


def _host_local(batch: int, seq_len: int) -> am.Local:
  backend = jax.default_backend()
  return am.Local(seqs=batch, seq_len=seq_len, backend=backend if backend in am.BACKENDS else "gpu")


VALIDATE_LIMIT = 16 * GIB  # what a validation compile may plan on this host


def check_validate_size(cfg: ModelConfig, batch: int, seq_len: int) -> None:
  """Refuses a bad --global_batch or --seq_len (as `plan` does) and a step too big for this host."""
  check_batch_and_seq_len(cfg, batch, seq_len)
  one = dict.fromkeys(MESH_AXES, 1)
  need = (3 * state_bytes(cfg, one)["params"]
          + am.model_activation_bytes(cfg, _host_local(batch, seq_len), "none")["total"])
  if need > VALIDATE_LIMIT:
    raise ConfigError(f"--validate skipped: needs {need / GIB:.1f} GiB (params, gradients and "
                      f"activations on one device) > {VALIDATE_LIMIT / GIB:.0f} GiB; use the tiny or "
                      "small config or a shorter --seq_len.")


def validate(cfg: ModelConfig, batch: int, seq_len: int,
             remats: tuple[str, ...] = REMATS) -> dict[str, dict[str, float]]:
  """{remat: {'xla_temp', 'estimate', 'ratio'}}: whole train step on one device of this host."""
  check_validate_size(cfg, batch, seq_len)
  loc = _host_local(batch, seq_len)
  out = {}
  for remat in remats:
    c = cfg.replace(remat=remat)
    temp = compiled_train_step_temp(c, batch, seq_len)
    est = am.model_activation_bytes(c, loc, remat)["total"]
    out[remat] = {"xla_temp": temp, "estimate": est, "ratio": est / temp}
  return out


def validate_blocks(cfg: ModelConfig, batch: int, seq_len: int) -> dict[str, dict[str, float]]:
  """{'<attn>+<ffn>': {'xla_temp', 'estimate', 'ratio'}} per block kind of cfg.

  One block's forward + backward is what the 'full' and 'save_dots' policies
  rebuild at their peak (`LayerMemory.saved + peak_extra`), and unlike the
  whole step it does not depend on the backend honouring remat.
  """
  check_batch_and_seq_len(cfg, batch, seq_len)
  loc = _host_local(batch, seq_len)
  kinds = dict.fromkeys(zip(cfg.layer_kinds, cfg.ffn_kinds, strict=True))
  blocks = {b.name: b for b in am.block_layers(cfg, loc)}
  out = {}
  for kind, ffn_kind in kinds:
    est = blocks[f"{kind}+{ffn_kind}"]
    temp = compiled_block_temp(cfg, kind, ffn_kind, batch, seq_len)
    total = est.saved + est.peak_extra
    out[est.name] = {"xla_temp": temp, "estimate": total, "ratio": total / temp}
  return out


# ---- formatting --------------------------------------------------------------


def mesh_shape_from_flags(text: str, devices: int | None) -> dict[str, int]:
  """{axis: size} from --mesh text ('data=1,fsdp=64,...'); a -1 axis is resolved with --devices."""
  if devices is not None and devices < 1:  # 0 filled a -1 axis with 0 and divided by it later
    raise ConfigError(f"--devices={devices} must be a positive device count (>= 1), or leave it out "
                      "and give every --mesh axis a size.")
  mesh = MeshConfig.parse(text)
  sizes = [getattr(mesh, a) for a in MESH_AXES]
  where = f"--mesh={text!r} (--devices={devices})"
  if -1 in sizes:
    if devices is None:
      raise ConfigError(f"--mesh={text!r} has a -1 axis; pass --devices=N to resolve it, or give "
                        "every axis a size.")
    sizes = list(mesh.resolve(devices, where=where))
  elif devices is not None:
    mesh.resolve(devices, where=where)  # checks the product
  return dict(zip(MESH_AXES, sizes, strict=True))


def _gib(x: float) -> str:
  return f"{x / GIB:10.2f}"


def format_table(res: dict[str, Any], name: str = "") -> str:
  b, pdt = res["bytes"], res["param_dtype"]
  mesh = ",".join(f"{k}={v}" for k, v in res["mesh"].items())
  grads = f"gradients ({pdt}{' + accumulator' if res['micro_batches'] > 1 else ''})"
  lines = [
      f"memory plan {name}: mesh {mesh} ({res['devices']} devices)",
      f"  global batch {res['global_batch']} x {res['seq_len']} tokens, {res['micro_batches']} "
      f"micro-batch(es) -> {res['local_seqs']} seq(s) = {res['local_tokens']} tokens per device per "
      f"micro-batch; remat {res['remat']}; backend {res['backend']}; expert exchange {res['exchange']}",
      f"{'row':<36}{'GiB/device':>10}",
      f"{'params (' + pdt + ')':<36}{_gib(b['params'])}",
      f"{'params (MXFP4 routed experts)':<36}{_gib(b['params_mxfp4'])}",
      f"{'optimizer (AdamW mu+nu f32)':<36}{_gib(b['optimizer'])}",
      f"{grads:<36}{_gib(b['gradients'])}",
      f"{'activations (estimate*)':<36}{_gib(b['activations'])}",
      f"{'total (' + pdt + ' params)':<36}{_gib(b['total'])}",
      f"{'total (MXFP4 experts)':<36}{_gib(b['total_mxfp4'])}",
  ]
  d = res["activation_detail"]
  lines.append(f"  activations = kept across the step {d['kept'] / GIB:.2f} + the larger of one block's "
               f"peak {d['peak_block'] / GIB:.2f} ({d['peak_block_name']}) and the LM head's "
               f"{d['head'] / GIB:.2f} GiB")
  lines.append("  largest buffers of that block: " + "; ".join(
      f"{n} {v / GIB:.2f}" for n, v in d["peak_block_top"]))
  if "hbm_gib" in res:
    verdict = lambda ok: "FITS" if ok else "DOES NOT FIT"  # noqa: E731
    lines.append(f"HBM {res['hbm_gib']:g} GiB, 10% reserved -> {res['usable_bytes'] / GIB:.1f} GiB usable: "
                 f"{pdt} params {verdict(res['fits'])}; MXFP4 experts {verdict(res['fits_mxfp4'])}")
  lines.append("* activations are an analytic estimate from the forward code (training/"
               "activation_memory.py), text-only batch; gradients assume FSDP reduce-scatter.")
  return "\n".join(lines)


def validate_report(cfg: ModelConfig, batch: int, seq_len: int) -> tuple[str, dict[str, Any]]:
  """`validate` and `validate_blocks` on this host: (a printable table, the numbers as JSON-able dict)."""
  res = validate(cfg, batch, seq_len)
  blocks = validate_blocks(cfg, batch, seq_len)
  lines = [f"validate: batch {batch} x {seq_len}, backend {jax.default_backend()}, 1 device",
           f"{'train step, remat':<22}{'XLA temp MiB':>14}{'estimate MiB':>14}{'est/XLA':>9}"]
  for name, r in [*res.items(), *(("block " + k, v) for k, v in blocks.items())]:
    lines.append(f"{name:<22}{r['xla_temp'] / 2**20:14.1f}{r['estimate'] / 2**20:14.1f}{r['ratio']:9.2f}")
  if jax.default_backend() == "cpu":
    lines.append("note: XLA:CPU does not realise remat savings (same temp for every policy): compare the "
                 "step under 'none', and single blocks (what 'full' rebuilds at its peak).")
  return "\n".join(lines), {"validate": res, "blocks": blocks, "batch": batch, "seq_len": seq_len}
