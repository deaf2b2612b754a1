"""Expert parallelism: MoE experts split over the `expert` mesh axis.

Layout (from `sharding.rules`): tokens are split over the batch mesh axes
(which include `expert`, so expert-parallel devices are data-parallel outside
the MoE layers); expert weights [e, d, f] are split as (expert, -, tensor).
Inside `shard_map` every device

  1. takes its tokens' routing (computed per token, so locally: the router
     runs before the exchange on each device's own tokens),
  2. groups its token-assignments by destination shard (expert id // E_local),
  3. exchanges them over `expert` with an all-to-all,
  4. runs its E_local experts on what it received with the grouped matmul of
     `model.moe.dropless_experts` (passed in as `local_experts`, so this module
     has no model import), summing partial FFN-width products over `tensor`,
  5. sends the results back with the reverse all-to-all, and
  6. combines each token's k results with its router weights.

Two exchanges implement step 3/5:

* 'ragged' -- `lax.ragged_all_to_all`: variable-size slices, *dropless*. Each
  device exchanges its per-destination counts first (an all-gather of an [ep]
  vector) so every sender knows where its slice lands. The receive buffer is
  sized for the worst case (ep * local assignments rows); rows past what was
  received are marked "no expert" and the grouped matmul skips them
  (ragged_dot computes nothing for rows outside the groups). XLA:CPU has no
  ragged_all_to_all; there this path runs an exact emulation built from
  all_gather + scatter (for tests; it moves ep times the data).
* 'capacity' -- `lax.all_to_all` on fixed-size buckets: each (source,
  destination) pair gets C = ceil(capacity_factor * A_local / ep) rows, where
  A_local = local tokens * k. Assignments past C (in token order) are
  *dropped*: their expert output is 0, the token keeps its residual and the
  other experts' outputs. Drops are counted exactly and returned, never
  silent. capacity_factor >= ep guarantees no drops.

'auto' chooses 'ragged' on TPU/GPU and 'capacity' elsewhere.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding import rules as rules_lib

EXCHANGES = ("auto", "ragged", "capacity")

# local_experts(x_rows [R, d], ids [R, 1], weights [R, 1], w_gate, w_up, w_down) -> [R, d];
# ids == E_local means "no expert" and must give a zero row.
LocalExperts = Callable[..., jax.Array]


def resolve_exchange(exchange: str) -> str:
  if exchange not in EXCHANGES:
    raise ValueError(f"config.model.expert_exchange={exchange!r}; choose one of {EXCHANGES}.")
  if exchange == "auto":
    return "ragged" if jax.default_backend() in ("tpu", "gpu") else "capacity"
  return exchange


def capacity(local_assignments: int, ep: int, capacity_factor: float) -> int:
  """Rows per (source, destination) bucket of the capacity exchange."""
  if capacity_factor <= 0:
    raise ValueError(f"config.model.capacity_factor={capacity_factor} must be > 0.")
  return max(1, min(local_assignments, math.ceil(capacity_factor * local_assignments / ep)))


def _combine(out_ad: jax.Array, weights_tk: jax.Array) -> jax.Array:
  t, k = weights_tk.shape
  out = out_ad.reshape(t, k, -1).astype(jnp.float32)
  return jnp.einsum("tkd,tk->td", out, weights_tk.astype(jnp.float32)).astype(out_ad.dtype)


def _assignments(idx_tk, valid_t, e_local):
  t, k = idx_tk.shape
  flat = idx_tk.reshape(t * k).astype(jnp.int32)
  token = jnp.arange(t * k, dtype=jnp.int32) // k
  valid = jnp.repeat(valid_t, k)
  return flat, token, valid, flat // e_local, flat % e_local


def _num_experts(w) -> int:
  """Leading (expert) dim of a dense weight or of MXFP4 {'blocks', 'scales'} arrays."""
  return (w["blocks"] if isinstance(w, dict) else w).shape[0]


def _weight_specs(w, ep_axis, tp, contraction_sharded: bool):
  """PartitionSpecs of one expert weight: experts over `ep_axis`, FFN width f over `tp`.

  Dense: [e, d, f] (gate/up) or [e, f, d] (down). MXFP4 (gpt-oss layout, the
  contraction axis last in blocks of 32): gate/up [e, f, d/32, 16] + [e, f, d/32],
  down [e, d, f/32, 16] + [e, d, f/32], so f is axis 1 for gate/up and the
  block axis for down.
  """
  if not isinstance(w, dict):
    return P(ep_axis, tp, None) if contraction_sharded else P(ep_axis, None, tp)
  if contraction_sharded:  # down: f is the (blocked) contraction axis
    return {"blocks": P(ep_axis, None, tp, None), "scales": P(ep_axis, None, tp)}
  return {"blocks": P(ep_axis, tp, None, None), "scales": P(ep_axis, tp, None)}


def _capacity_body(x, idx, wts, valid_t, wg, wu, wd, *, ep_axis, tp_axes, batch_axes, cap,
                   local_experts):
  t, d = x.shape
  ep = jax.lax.axis_size(ep_axis)
  e_local = _num_experts(wg)
  flat, token, valid, dest, lid = _assignments(idx, valid_t, e_local)
  onehot = (dest[:, None] == jnp.arange(ep)) & valid[:, None]  # [A, ep]
  rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), dest[:, None], axis=1)[:, 0] - 1
  keep = valid & (rank < cap)
  n = ep * cap
  slot = jnp.where(keep, dest * cap + rank, n)  # n: a dump row, never sent
  send_x = jnp.zeros((n + 1, d), x.dtype).at[slot].set(x[token])[:n]
  send_id = jnp.full((n + 1,), e_local, jnp.int32).at[slot].set(lid)[:n]
  recv_x = jax.lax.all_to_all(send_x, ep_axis, 0, 0, tiled=True)
  recv_id = jax.lax.all_to_all(send_id, ep_axis, 0, 0, tiled=True)
  y_rows = local_experts(recv_x, recv_id[:, None], jnp.ones((n, 1), jnp.float32), wg, wu, wd)
  if tp_axes:
    y_rows = jax.lax.psum(y_rows, tp_axes)
  back = jax.lax.all_to_all(y_rows, ep_axis, 0, 0, tiled=True)
  out = jnp.concatenate([back, jnp.zeros((1, d), back.dtype)])[slot]
  dropped = jax.lax.psum(jnp.sum(valid & ~keep).astype(jnp.float32), batch_axes)
  return _combine(out, wts), dropped


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """`lax.ragged_all_to_all` semantics from all_gather + scatter (for XLA:CPU).

  Exact, differentiable, and ep times the traffic of the real collective.
  """
  del recv_sizes  # implied by the senders' send_sizes
  me = jax.lax.axis_index(axis_name)
  ops = jax.lax.all_gather(operand, axis_name)  # [ep, N, ...]
  in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [ep] source s's offset for me
  sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
  out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me]
  ep, n = ops.shape[:2]
  rel = jnp.arange(n)[None, :] - in_off[:, None]  # [ep, N]
  ok = (rel >= 0) & (rel < sizes[:, None])
  dst = jnp.where(ok, out_off[:, None] + rel, output.shape[0])
  return output.at[dst.reshape(-1)].set(ops.reshape((ep * n,) + ops.shape[2:]), mode="drop")


def ragged_collective() -> Callable[..., jax.Array]:
  """The native ragged_all_to_all on TPU/GPU, the emulation on XLA:CPU."""
  if jax.default_backend() in ("tpu", "gpu"):
    return jax.lax.ragged_all_to_all
  return emulated_ragged_all_to_all


def _ragged_body(x, idx, wts, valid_t, wg, wu, wd, *, ep_axis, tp_axes, batch_axes, local_experts,
                 exchange_fn):
  t, d = x.shape
  ep = jax.lax.axis_size(ep_axis)
  e_local = _num_experts(wg)
  flat, token, valid, _, _ = _assignments(idx, valid_t, e_local)
  a = flat.shape[0]
  key = jnp.where(valid, flat, ep * e_local)  # invalid assignments sort last, to no shard
  order = jnp.argsort(key, stable=True)
  s_e = key[order]
  send_sizes = jnp.bincount(s_e // e_local, length=ep).astype(jnp.int32)
  input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
  counts = jax.lax.all_gather(send_sizes, ep_axis)  # [src, dst]
  me = jax.lax.axis_index(ep_axis)
  recv_sizes = counts[:, me]
  output_offsets = (jnp.cumsum(counts, axis=0) - counts)[me]  # where my slice lands on each dst
  buf = ep * a  # worst case: every device sends all its assignments here
  xs = x[token[order]]
  recv_x = exchange_fn(xs, jnp.zeros((buf, d), x.dtype), input_offsets, send_sizes, output_offsets,
                       recv_sizes, axis_name=ep_axis)
  recv_id = exchange_fn((s_e % e_local).astype(jnp.int32), jnp.full((buf,), e_local, jnp.int32),
                        input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=ep_axis)
  y_rows = local_experts(recv_x, recv_id[:, None], jnp.ones((buf, 1), jnp.float32), wg, wu, wd)
  if tp_axes:
    y_rows = jax.lax.psum(y_rows, tp_axes)
  recv_offsets = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
  sender_offsets = (jnp.cumsum(counts, axis=1) - counts)[:, me]  # source s's input offset for me
  back = exchange_fn(y_rows, jnp.zeros((a, d), y_rows.dtype), recv_offsets, recv_sizes,
                     sender_offsets.astype(jnp.int32), send_sizes, axis_name=ep_axis)
  out = jnp.zeros((a, d), back.dtype).at[order].set(back)
  return _combine(out, wts), jnp.zeros((), jnp.float32)


def expert_parallel_experts(x_td: jax.Array, idx_tk: jax.Array, weights_tk: jax.Array,
                            w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                            local_experts: LocalExperts, exchange: str = "auto",
                            capacity_factor: float = 1.25,
                            rules: rules_lib.Rules | None = None) -> tuple[jax.Array, jax.Array]:
  """Routed experts over the current mesh (`jax.set_mesh` / `sharding.mesh.activate`).

  Args:
    x_td: [t, d] tokens (global view).
    idx_tk: [t, k] expert ids; weights_tk: [t, k] combine weights.
    w_gate, w_up: [e, d, f]; w_down: [e, f, d] (global view); or each as MXFP4
      {'blocks', 'scales'} (model.quant, gpt-oss layout), passed to
      local_experts as the device's shards.
    local_experts: grouped SwiGLU over one shard's experts (see LocalExperts).
    exchange: 'auto' | 'ragged' | 'capacity' (module docstring).
    capacity_factor: bucket size factor of the capacity exchange.
    rules: logical-axis rules (default: current).

  Returns:
    (y [t, d], dropped): dropped is the f32 number of token-assignments the
    capacity exchange could not place (0 for 'ragged').
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise rules_lib.ShardingError("expert_parallel_experts needs an active mesh (sharding.mesh.activate).")
  rules = rules or rules_lib.current_rules()
  ep_axis = rules.params["expert"]
  if not isinstance(ep_axis, str) or ep_axis not in mesh.axis_names:
    raise rules_lib.ShardingError(f"rules: 'expert' must map to one mesh axis of {mesh.axis_names}; "
                                  f"got {ep_axis!r}.")
  batch_axes = tuple(a for a in rules.batch_axes if a in mesh.axis_names)
  if ep_axis not in batch_axes:
    raise rules_lib.ShardingError(f"rules: the batch activation axes {batch_axes} must include the "
                                  f"expert axis {ep_axis!r} (tokens are exchanged over it).")
  tp_axes = tuple(a for a in rules_lib._as_tuple(rules.params["mlp"]) if a in mesh.axis_names)
  ep = mesh.shape[ep_axis]
  e = _num_experts(w_gate)
  if e % ep:
    raise rules_lib.ShardingError(f"num_experts={e} is not divisible by the expert mesh axis ({ep}); "
                                  "change config.model.num_experts or config.mesh.expert.")
  t, d = x_td.shape
  if t == 0:  # an empty batch: nothing to exchange (shard_map and the reshapes below need rows)
    return jnp.zeros((0, d), x_td.dtype), jnp.zeros((), jnp.float32)
  shards = math.prod(mesh.shape[a] for a in batch_axes)
  pad = -t % shards
  valid = jnp.arange(t + pad) < t
  if pad:  # odd token counts (e.g. decode): pad with masked tokens
    x_td = jnp.pad(x_td, ((0, pad), (0, 0)))
    idx_tk = jnp.pad(idx_tk, ((0, pad), (0, 0)))
    weights_tk = jnp.pad(weights_tk, ((0, pad), (0, 0)))
  kind = resolve_exchange(exchange)
  common = dict(ep_axis=ep_axis, tp_axes=tp_axes, batch_axes=batch_axes, local_experts=local_experts)
  if kind == "capacity":
    cap = capacity((t + pad) // shards * idx_tk.shape[1], ep, capacity_factor)
    body = lambda *a: _capacity_body(*a, cap=cap, **common)  # noqa: E731
  else:
    body = lambda *a: _ragged_body(*a, exchange_fn=ragged_collective(), **common)  # noqa: E731
  tok = P(batch_axes, None)
  tp = tp_axes if tp_axes else None
  w_in = _weight_specs(w_gate, ep_axis, tp, contraction_sharded=False)
  w_out = _weight_specs(w_down, ep_axis, tp, contraction_sharded=True)
  # MXFP4 experts run a Pallas kernel inside, whose outputs carry no varying-axes type.
  y, dropped = jax.shard_map(
      body, in_specs=(tok, tok, tok, P(batch_axes), w_in, w_in, w_out), out_specs=(tok, P()),
      check_vma=not isinstance(w_gate, dict),
  )(x_td, idx_tk, weights_tk, valid, w_gate, w_up, w_down)
  return y[:t], dropped
