"""The gated delta rule's contract: argument checks and the per-token reference.

Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025, "Gated Delta Networks: Improving Mamba2
with Delta Rule") keeps a fixed-size memory S per head; per token t it decays it by
a_t = exp(g_t) (g_t <= 0) and applies one delta-rule step:

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,      o_t = S_t^T q_t.

reset[b, t] zeroes the state before token t is applied (packed sequences). All maths runs in
float32 whatever the input dtype; outputs come back in v's dtype and states in float32.

Two fast paths compute it chunk by chunk: the Pallas kernel (ops.py) and the model's XLA
forms (model/attention/delta_rule.py: the chunkwise WY/UT form and the lax.scan decode form).
This module is what all of them must equal and what they share:

  * `check_inputs`: the argument checks of their common signature.
  * `initial_state_or_zeros`: the starting state (zeros when none is given).
  * `naive_gated_delta_rule`: a python loop over tokens, written straight from the equation.

Only jax: importing this module loads no Pallas.

Einsum legend: b batch, h heads, k key dim, v value dim.
"""

from __future__ import annotations

import jax.numpy as jnp


def check_inputs(fn: str, q, k, v, g, beta, initial_state, reset) -> None:
  """Raises a ValueError naming the offending argument and the expected shape."""
  if q.ndim != 4:
    raise ValueError(f"{fn}: q must be [b, t, h, kd]; got shape {q.shape}.")
  b, t, h, kd = q.shape
  if k.shape != q.shape:
    raise ValueError(f"{fn}: k has shape {k.shape}; it must match q's shape {q.shape} [b, t, h, kd].")
  if v.ndim != 4 or v.shape[:3] != (b, t, h):
    raise ValueError(f"{fn}: v has shape {v.shape}; expected [b, t, h, vd] = {(b, t, h)} + [vd].")
  for name, x in (("g", g), ("beta", beta)):
    if x.shape != (b, t, h):
      raise ValueError(f"{fn}: {name} has shape {x.shape}; expected [b, t, h] = {(b, t, h)}.")
  want = (b, h, kd, v.shape[-1])
  if initial_state is not None and initial_state.shape != want:
    raise ValueError(f"{fn}: initial_state has shape {initial_state.shape}; expected "
                     f"[b, h, kd, vd] = {want} (or None for a zero state).")
  if reset is not None and reset.shape != (b, t):
    raise ValueError(f"{fn}: reset has shape {reset.shape}; expected [b, t] = {(b, t)} (or None).")


def initial_state_or_zeros(initial_state, b, h, kd, vd, dt):
  """initial_state [b, h, kd, vd] in dtype dt, or zeros of that shape when it is None."""
  if initial_state is None:
    return jnp.zeros((b, h, kd, vd), dt)
  return initial_state.astype(dt)


def naive_gated_delta_rule(q, k, v, g, beta, initial_state=None, reset=None):
  """Reference: a python loop over tokens, written straight from the equation.

  Args:
    q, k: [b, t, h, kd] (already L2-normalised; q already scaled).
    v: [b, t, h, vd].
    g: [b, t, h] log-decay (<= 0); a_t = exp(g_t).
    beta: [b, t, h] write strength.
    initial_state: [b, h, kd, vd] or None (zeros).
    reset: [b, t] bool or None; True zeroes the state before token t.

  Returns:
    o [b, t, h, vd] in v's dtype, final state [b, h, kd, vd] in float32.
  """
  check_inputs("naive_gated_delta_rule", q, k, v, g, beta, initial_state, reset)
  dt = jnp.float32
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  s = initial_state_or_zeros(initial_state, b, h, kd, vd, dt)
  if reset is None:
    reset = jnp.zeros((b, t), bool)
  # One split per input (not t index ops): keeps eager reference calls cheap to compile.
  per_token = zip(*(jnp.split(x, t, axis=1) for x in (q, k, v, g, beta, reset)), strict=True)
  outs = []
  for q_i, k_i, v_i, g_i, beta_i, reset_i in per_token:
    q_i, k_i, v_i, g_i, beta_i = (x[:, 0].astype(dt) for x in (q_i, k_i, v_i, g_i, beta_i))
    s = jnp.where(reset_i[:, 0, None, None, None], 0.0, s)
    a = jnp.exp(g_i)[..., None, None]
    predicted = jnp.einsum("bhkv,bhk->bhv", a * s, k_i, preferred_element_type=dt)  # a_t S_{t-1}^T k_t
    correction = beta_i[..., None] * (v_i - predicted)
    s = a * s + k_i[..., :, None] * correction[..., None, :]
    outs.append(jnp.einsum("bhkv,bhk->bhv", s, q_i, preferred_element_type=dt))
  return jnp.stack(outs, axis=1).astype(v.dtype), s
