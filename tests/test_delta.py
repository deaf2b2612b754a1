"""Tests for the gated delta rule (three forms) and the DeltaAttention layer.

Every fast path is checked against a plain reference on random, odd-shaped f32 inputs:
outputs, final states and gradients. Shapes: b=2, h=3, kd=5, vd=7 for the rule; the `tiny`
config (d_model 56, 2 q/k heads shared by 4 value heads) for the layer.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from model.attention.delta import DeltaAttention, DeltaCache
from model.attention.delta_rule import (
  chunk_gated_delta_rule,
  recurrent_gated_delta_rule,
  unit_lower_inverse,
  unit_lower_solve,
)
from pallas_kernels.delta_rule.reference import naive_gated_delta_rule
from tests.helpers import assert_close

B, H, KD, VD = 2, 3, 5, 7

# Jitted once at module level so tests sharing shapes share compilations (CPU time is tight).
chunk_jit = jax.jit(chunk_gated_delta_rule, static_argnames="chunk_size")
recurrent_jit = jax.jit(recurrent_gated_delta_rule)


def rule_inputs(seed, t, b=B, h=H, kd=KD, vd=VD, reset_p=0.15):
  """Random q, k, v, g, beta, initial_state, reset as the layer would produce them.

  Drawn with numpy: eager jax.random would compile a sampler per shape.
  """
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, h, kd))
  k = rng.standard_normal((b, t, h, kd))
  q = q / np.linalg.norm(q, axis=-1, keepdims=True) * kd ** -0.5
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((b, t, h, vd))
  g = -rng.uniform(0.02, 1.5, (b, t, h))
  beta = rng.uniform(0.05, 1.0, (b, t, h))
  s0 = rng.standard_normal((b, h, kd, vd))
  out = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0))
  return out + (jnp.asarray(rng.random((b, t)) < reset_p),)


# ---- the rule -----------------------------------------------------------------------------

@pytest.mark.parametrize("t,chunk,with_state", [(37, 8, True), (37, 8, False), (5, 16, True),
                                                 (12, 1, True)])
def test_forms_agree(t, chunk, with_state):
  q, k, v, g, beta, s0, reset = rule_inputs((t * 31 + chunk), t)
  if not with_state:
    s0, reset = None, None
  o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, s0, reset)
  o_rec, s_rec = recurrent_jit(q, k, v, g, beta, s0, reset)
  o_chk, s_chk = chunk_jit(q, k, v, g, beta, s0, reset, chunk_size=chunk)
  assert_close(o_rec, o_ref, what="recurrent o")
  assert_close(s_rec, s_ref, what="recurrent state")
  assert_close(o_chk, o_ref, what="chunk o")
  assert_close(s_chk, s_ref, what="chunk state")


def test_resets_at_chunk_edges_and_inside():
  """Resets on the first token of a chunk, mid-chunk, twice in a chunk and on the last token."""
  t, chunk = 37, 8
  q, k, v, g, beta, s0, _ = rule_inputs((3), t)
  reset = np.zeros((B, t), bool)
  reset[0, [0, 8, 11, 13, 15, 36]] = True
  reset[1, [7, 16, 23, 24, 32]] = True
  reset = jnp.asarray(reset)
  o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, s0, reset)
  o_chk, s_chk = chunk_jit(q, k, v, g, beta, s0, reset, chunk_size=chunk)
  assert_close(o_chk, o_ref, what="o")
  assert_close(s_chk, s_ref, what="state")


def _functional(seed, t):
  """A random linear functional of (o, final_state)."""
  rng = np.random.default_rng(seed)
  wo = jnp.asarray(rng.standard_normal((B, t, H, VD)), jnp.float32)
  ws = jnp.asarray(rng.standard_normal((B, H, KD, VD)), jnp.float32)
  return lambda out: jnp.sum(out[0] * wo) + jnp.sum(out[1] * ws)


@pytest.mark.parametrize("t,chunk", [(37, 8), (5, 16), (29, 6)])
def test_gradients_match_reference(t, chunk):
  q, k, v, g, beta, s0, reset = rule_inputs((7 + t), t)
  f = _functional((8), t)
  args = (q, k, v, g, beta, s0)
  argnums = tuple(range(6))
  ref = jax.grad(lambda *a: f(naive_gated_delta_rule(*a, reset)), argnums)(*args)
  rec = jax.jit(jax.grad(lambda *a: f(recurrent_gated_delta_rule(*a, reset)), argnums))(*args)
  chk = jax.jit(jax.grad(lambda *a: f(chunk_gated_delta_rule(*a, reset, chunk_size=chunk)),
                         argnums))(*args)
  for name, r, a, c in zip(("q", "k", "v", "g", "beta", "initial_state"), ref, rec, chk, strict=True):
    assert float(jnp.linalg.norm(r)) > 0, name
    assert_close(a, r, what=f"recurrent d{name}")
    assert_close(c, r, what=f"chunk d{name}")


@pytest.mark.parametrize("per_step", [1, 3, 7, 16])
def test_chunks_per_step(per_step):
  """Any number of chunks per scan step (the last step part padding, or more chunks per step
  than the sequence has) gives the reference's outputs, state and gradients."""
  # 10 chunks (the last one part padding): 10 steps of 1; 4 steps of 3 (2 padded chunks);
  # 2 steps of 7 (4 padded chunks); 16 > 10, so one step of all 10.
  t, chunk = 37, 4
  q, k, v, g, beta, s0, reset = rule_inputs(3 + per_step, t)
  f = _functional(2, t)
  rule = functools.partial(chunk_gated_delta_rule, chunk_size=chunk, chunks_per_step=per_step)
  o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, s0, reset)
  o_chk, s_chk = jax.jit(rule)(q, k, v, g, beta, s0, reset)
  assert_close(o_chk, o_ref, what="chunk o")
  assert_close(s_chk, s_ref, what="chunk state")
  args = (q, k, v, g, beta, s0)
  ref = jax.grad(lambda *a: f(naive_gated_delta_rule(*a, reset)), tuple(range(6)))(*args)
  chk = jax.jit(jax.grad(lambda *a: f(rule(*a, reset)), tuple(range(6))))(*args)
  for name, r, c in zip(("q", "k", "v", "g", "beta", "initial_state"), ref, chk, strict=True):
    assert float(jnp.linalg.norm(r)) > 0, name
    assert_close(c, r, what=f"chunk d{name}")


def test_check_grads_chunk():
  q, k, v, g, beta, s0, _ = rule_inputs((11), 6, b=1, h=2, kd=3, vd=2)
  reset = jnp.array([[False, False, False, True, False, False]])
  fn = jax.jit(lambda *a: chunk_gated_delta_rule(*a, reset, chunk_size=4))
  check_grads(fn, (q, k, v, g, beta, s0), order=1, modes=["rev"], eps=1e-3)


def test_continuation():
  n1 = 11  # mid-chunk split; the tail starts mid-chunk too
  t = 37
  q, k, v, g, beta, s0, reset = rule_inputs((5), t)
  full_o, full_s = chunk_jit(q, k, v, g, beta, s0, reset, chunk_size=8)
  head = [x[:, :n1] for x in (q, k, v, g, beta)]
  tail = [x[:, n1:] for x in (q, k, v, g, beta)]
  o1, s1 = chunk_jit(*head, s0, reset[:, :n1], chunk_size=8)
  o2, s2 = chunk_jit(*tail, s1, reset[:, n1:], chunk_size=8)
  assert_close(jnp.concatenate([o1, o2], axis=1), full_o, what="o")
  assert_close(s2, full_s, what="state")


@pytest.mark.parametrize("m", [37, 64])
def test_unit_lower_inverse(m):
  """Blocked (halving + product form) inverse, and its gradient through autodiff, vs numpy."""
  rng = np.random.default_rng(m)
  a = jnp.asarray(rng.standard_normal((2, 3, m, m)) * 0.3, jnp.float32)  # upper part ignored
  ct = jnp.asarray(rng.standard_normal((2, 3, m, m)), jnp.float32)
  lower = np.tril(np.asarray(a, np.float64), -1) + np.eye(m)
  inv = np.linalg.inv(lower)
  assert_close(jax.jit(unit_lower_inverse)(a), inv, what="inverse")
  # d<ct, L^-1>/da = -(L^-T ct L^-T), strictly lower part only.
  want = np.tril(-inv.swapaxes(-1, -2) @ np.asarray(ct, np.float64) @ inv.swapaxes(-1, -2), -1)
  got = jax.jit(jax.grad(lambda x: jnp.sum(unit_lower_inverse(x) * ct)))(a)
  assert_close(got, want, what="vjp")


@pytest.mark.parametrize("m", [13, 32])
def test_unit_lower_solve(m):
  """x = (I + A)^-1 r and its analytic VJP (dr = T^T dx, dA = -strict_lower(dr x^T)) vs numpy."""
  rng = np.random.default_rng(m + 1)
  a = jnp.asarray(rng.standard_normal((2, 3, m, m)) * 0.3, jnp.float32)
  r = jnp.asarray(rng.standard_normal((2, 3, m, 11)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((2, 3, m, 11)), jnp.float32)
  inv = np.linalg.inv(np.tril(np.asarray(a, np.float64), -1) + np.eye(m))
  x = inv @ np.asarray(r, np.float64)
  assert_close(jax.jit(unit_lower_solve)(a, r), x, what="solve")
  dr = inv.swapaxes(-1, -2) @ np.asarray(ct, np.float64)
  da = np.tril(-dr @ x.swapaxes(-1, -2), -1)
  got_a, got_r = jax.jit(jax.grad(lambda a, r: jnp.sum(unit_lower_solve(a, r) * ct), (0, 1)))(a, r)
  assert_close(got_r, dr, what="d rhs")
  assert_close(got_a, da, what="d a")


# One HLO instruction: "%name = <shape or (tuple shape)> opcode(" (ROOT optional).
_HLO_OP = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = (?:\(.*?\)|\S+) ([a-z][\w-]*)\(", re.M)


def _hlo_ops(t: int) -> dict:
  """Op-name counts of the compiled chunked rule (tiny heads, chunk 8) at length t."""
  q, k, v, g, beta, s0, reset = rule_inputs(0, t, b=1, h=2, kd=3, vd=4)
  fn = jax.jit(lambda *a: chunk_gated_delta_rule(*a, chunk_size=8))
  text = fn.lower(q, k, v, g, beta, s0, reset).compile().as_text()
  ops = [m.group(1) for m in _HLO_OP.finditer(text)]
  return {name: ops.count(name) for name in set(ops)}


def test_chunked_hlo_is_loop_free_inside_chunks():
  """One while loop (the scan over chunks), no reduce-window cumsums, and an op count that
  does not grow with the sequence length (no per-row or per-chunk unrolling)."""
  short, long = _hlo_ops(41), _hlo_ops(643)  # both pad their last chunk
  for ops in (short, long):
    assert ops.get("while", 0) == 1, ops.get("while")
    assert "reduce-window" not in ops
  assert sum(long.values()) == sum(short.values()), (sum(short.values()), sum(long.values()))


@pytest.mark.parametrize("rule", ["naive", "recurrent", "chunk"])
def test_reset_cuts_the_past(rule):
  fn = {"naive": naive_gated_delta_rule, "recurrent": recurrent_jit,
        "chunk": lambda *a: chunk_jit(*a, chunk_size=8)}[rule]
  t, r = 37, 10
  q, k, v, g, beta, s0, _ = rule_inputs((9), t)
  reset = jnp.zeros((B, t), bool).at[:, r].set(True)
  o, s = fn(q, k, v, g, beta, s0, reset)
  # Change every input before the reset and the initial state.
  q2, k2, v2, g2, beta2, s02, _ = rule_inputs((10), t)
  mix = lambda new, old: jnp.concatenate([new[:, :r], old[:, r:]], axis=1)
  o2, s2 = fn(mix(q2, q), mix(k2, k), mix(v2, v), mix(g2, g), mix(beta2, beta), s02, reset)
  assert_close(o2[:, r:], o[:, r:], what="o after reset")
  assert_close(s2, s, what="final state")
  assert float(jnp.abs(o2[:, :r] - o[:, :r]).max()) > 1e-3  # the past did change


def test_rule_bad_shapes():
  q, k, v, g, beta, s0, reset = rule_inputs((0), 6)
  with pytest.raises(ValueError, match="k has shape"):
    chunk_gated_delta_rule(q, k[..., :-1], v, g, beta)
  with pytest.raises(ValueError, match="initial_state has shape"):
    recurrent_gated_delta_rule(q, k, v, g, beta, s0[..., :-1])
  with pytest.raises(ValueError, match="reset has shape"):
    naive_gated_delta_rule(q, k, v, g, beta, s0, reset[:, :-1])
  with pytest.raises(ValueError, match="chunk_size"):
    chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=0)
  for bad in (0, True, 2.0):
    with pytest.raises(ValueError, match=f"chunks_per_step={bad!r} must be a positive int"):
      chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, chunks_per_step=bad)


# ---- the layer ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layer(tiny_cfg):
  return nnx.jit(lambda: DeltaAttention(tiny_cfg, rngs=nnx.Rngs(0)))()  # one compile, not many


def reference_layer(layer, x, segment_ids):
  """The layer written out plainly: per-token conv loop, explicit head map, naive rule."""
  cfg = layer.cfg
  b, t, _ = x.shape
  hqk, hv, kd, vd, width = (cfg.delta_qk_heads, cfg.delta_v_heads, cfg.delta_qk_dim,
                            cfg.delta_v_dim, cfg.delta_conv_size)
  proj = lambda w: jnp.einsum("btd,d...->bt...", x, w[...])
  pre = jnp.concatenate([proj(layer.w_q).reshape(b, t, -1), proj(layer.w_k).reshape(b, t, -1),
                         proj(layer.w_v).reshape(b, t, -1)], axis=-1)
  # Per-token conv: token i sums taps over tokens i-width+1..i of its own segment. (Inputs
  # are split once rather than indexed per token, so eager op compilation stays cheap.)
  tokens = [p[:, 0] for p in jnp.split(pre, t, axis=1)]
  segs = [sg[:, 0] for sg in jnp.split(segment_ids, t, axis=1)]
  taps = [w[0] for w in jnp.split(layer.conv_w[...], width, axis=0)]
  conv = []
  for i in range(t):
    acc = jnp.zeros_like(tokens[0])
    for back in range(min(width, i + 1)):
      same = (segs[i - back] == segs[i])[:, None]
      acc = acc + jnp.where(same, taps[width - 1 - back] * tokens[i - back], 0.0)
    conv.append(acc)
  feats = jax.nn.silu(jnp.stack(conv, axis=1))
  nq = hqk * kd
  l2 = lambda a: a / jnp.sqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-6)
  q = l2(feats[..., :nq].reshape(b, t, hqk, kd)) / np.sqrt(kd)
  k = l2(feats[..., nq:2 * nq].reshape(b, t, hqk, kd))
  v = feats[..., 2 * nq:].reshape(b, t, hv, vd)
  head_of = np.array([j // (hv // hqk) for j in range(hv)])
  q, k = q[:, :, head_of], k[:, :, head_of]
  beta = jax.nn.sigmoid(proj(layer.w_beta))
  g = -jnp.exp(layer.A_log[...]) * jax.nn.softplus(proj(layer.w_a) + layer.dt_bias[...])
  reset = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
  o, _ = naive_gated_delta_rule(q, k, v, g, beta, None, reset)
  o = o / jnp.sqrt(jnp.mean(o * o, -1, keepdims=True) + cfg.norm_eps) * layer.norm_scale[...]
  o = o * jax.nn.silu(proj(layer.w_z))
  return jnp.einsum("bthv,hvd->btd", o, layer.w_o[...])


@functools.partial(jax.jit, static_argnums=0)
def _call(graphdef, state, x, positions, segment_ids):
  return nnx.merge(graphdef, state)(x, positions, segment_ids)


@functools.partial(jax.jit, static_argnums=0)
def _extend(graphdef, state, x, valid, cache):
  return nnx.merge(graphdef, state).extend(x, valid, cache)


def call(layer, x, segment_ids=None, positions=None):
  """layer(x, positions, segment_ids), jitted."""
  return _call(*nnx.split(layer), x, positions, segment_ids)


def _x(seed, b, t, d):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, d)), jnp.float32)


def _segments(t, starts):
  return jnp.asarray(np.searchsorted(np.asarray(starts), np.arange(t), side="right"), jnp.int32)


def test_layer_matches_reference(layer, tiny_cfg):
  t = 19
  x = _x(1, 2, t, tiny_cfg.d_model)
  seg = jnp.stack([jnp.zeros((t,), jnp.int32), _segments(t, [0, 6, 8, 17])])
  y, aux = call(layer, x, seg, jnp.broadcast_to(jnp.arange(t), (2, t)))
  assert aux == {}
  assert_close(y, reference_layer(layer, x, seg), what="y")


def test_packed_segments_are_independent(layer, tiny_cfg):
  ta, tb = 9, 12
  x = _x(2, 1, ta + tb, tiny_cfg.d_model)
  seg = jnp.concatenate([jnp.full((1, ta), 3), jnp.full((1, tb), 4)], axis=1)
  y, _ = call(layer, x, seg)
  y_a, _ = call(layer, x[:, :ta])
  y_b, _ = call(layer, x[:, ta:])
  assert_close(y[:, :ta], y_a, what="segment A")
  assert_close(y[:, ta:], y_b, what="segment B")


def test_extend_whole_sequence_equals_call(layer, tiny_cfg):
  t = 17
  x = _x(3, 2, t, tiny_cfg.d_model)
  y, _ = call(layer, x)
  cache = layer.init_cache(2, 64, jnp.float32)
  y_ext, cache = _extend(*nnx.split(layer), x, jnp.ones((2, t), bool), cache)
  assert_close(y_ext, y, what="y")
  assert isinstance(cache, DeltaCache)


def test_prefill_then_decode_ragged(layer, tiny_cfg):
  """Rows with prompt lengths 5 and 11 prefilled together (t=13), then decoded to 20 tokens."""
  lengths, t_prefill, total = np.array([5, 11]), 13, 20
  x = _x(4, 2, total, tiny_cfg.d_model)
  extend = functools.partial(_extend, nnx.split(layer)[0])
  state = nnx.split(layer)[1]
  valid = jnp.asarray(np.arange(t_prefill)[None, :] < lengths[:, None])
  y_pre, cache = extend(state, x[:, :t_prefill], valid, layer.init_cache(2, total))
  got = [list(np.asarray(y_pre[r, :lengths[r]])) for r in range(2)]
  for step in range(total - lengths.min()):
    pos = lengths + step
    live = pos < total
    tok = x[np.arange(2), np.minimum(pos, total - 1)][:, None]
    y_step, cache = extend(state, tok, jnp.asarray(live)[:, None], cache)
    assert np.all(np.isfinite(np.asarray(y_step)))
    for r in np.nonzero(live)[0]:
      got[r].append(np.asarray(y_step[r, 0]))
  for r in range(2):
    want, _ = call(layer, x[r:r + 1])
    assert_close(np.stack(got[r])[None], want, what=f"row {r}")


def test_ragged_chunked_extends(layer, tiny_cfg):
  """Multi-token extends where rows take different, sometimes tiny (< conv width - 1), steps."""
  total = 16
  x = _x(8, 2, total, tiny_cfg.d_model)
  steps = [(6, 2), (1, 4), (0, 5), (5, 1), (2, 0), (2, 4)]  # valid tokens per row per extend
  assert [sum(col) for col in zip(*steps, strict=True)] == [total, total]
  graphdef, state = nnx.split(layer)
  cache = layer.init_cache(2, total)
  done, got = [0, 0], [[], []]
  width = 6  # one shape for every extend (one compile); >= 2 tokens takes the chunked path
  for counts in steps:
    xs = np.zeros((2, width, tiny_cfg.d_model), np.float32)
    for r, n in enumerate(counts):
      xs[r, :n] = x[r, done[r]:done[r] + n]
    valid = jnp.asarray(np.arange(width)[None, :] < np.array(counts)[:, None])
    y, cache = _extend(graphdef, state, jnp.asarray(xs), valid, cache)
    for r, n in enumerate(counts):
      got[r].append(np.asarray(y[r, :n]))
      done[r] += n
  want, _ = call(layer, x)
  assert_close(np.stack([np.concatenate(g) for g in got]), want, what="y")


def test_bfloat16_compute_tracks_float32(layer, tiny_cfg):
  """Same params, bf16 compute: outputs within the bf16 tolerance of the f32 layer."""
  graphdef, state = nnx.split(layer)
  bf16 = nnx.merge(graphdef, state)
  bf16.cfg = tiny_cfg.replace(dtype="bfloat16")
  x = _x(9, 2, 21, tiny_cfg.d_model)
  y = call(bf16, x)[0]
  assert y.dtype == jnp.bfloat16
  assert_close(y.astype(jnp.float32), call(layer, x)[0], dtype="bfloat16", what="y")
  cache = bf16.init_cache(2, 21)
  assert cache.conv.dtype == jnp.bfloat16 and cache.state.dtype == jnp.float32


def test_layer_gradients_match_reference(layer, tiny_cfg):
  t = 11
  x = _x(5, 2, t, tiny_cfg.d_model)
  seg = jnp.stack([jnp.zeros((t,), jnp.int32), _segments(t, [0, 4])])
  w = _x(6, 2, t, tiny_cfg.d_model)
  graphdef, params = nnx.split(layer, nnx.Param)

  def loss(p, xs, fn):
    return jnp.sum(fn(nnx.merge(graphdef, p), xs) * w)

  fast = lambda m, xs: m(xs, None, seg)[0]
  slow = lambda m, xs: reference_layer(m, xs, seg)
  g_fast = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(params, x, fast)
  g_slow = jax.grad(loss, argnums=(0, 1))(params, x, slow)
  flat_fast = dict(nnx.to_flat_state(g_fast[0]))
  flat_slow = dict(nnx.to_flat_state(g_slow[0]))
  assert set(flat_fast) == set(flat_slow) and len(flat_fast) == 11
  for path, value in flat_fast.items():
    value = value[...]
    assert np.all(np.isfinite(value)) and float(jnp.abs(value).max()) > 0, path
    assert_close(value, flat_slow[path][...], what=f"d{'.'.join(map(str, path))}")
  assert_close(g_fast[1], g_slow[1], what="dx")


def test_layer_bad_inputs(layer, tiny_cfg):
  d = tiny_cfg.d_model
  with pytest.raises(ValueError, match="x has shape"):
    layer(jnp.ones((2, 5, d + 1)))
  with pytest.raises(ValueError, match="segment_ids has shape"):
    layer(jnp.ones((2, 5, d)), None, jnp.zeros((2, 4), jnp.int32))
  cache = layer.init_cache(2, 8)
  with pytest.raises(ValueError, match="valid has shape"):
    layer.extend(jnp.ones((2, 3, d)), jnp.ones((2, 2), bool), cache)
  with pytest.raises(ValueError, match="init_cache"):
    layer.extend(jnp.ones((3, 1, d)), jnp.ones((3, 1), bool), cache)


def test_param_axes_and_cache_shapes(layer, tiny_cfg):
  for path, p in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
    axes = p.get_metadata()["axes"]
    assert len(axes) == p[...].ndim, path
  g = -jnp.exp(layer.A_log[...]) * jax.nn.softplus(layer.dt_bias[...])
  assert np.all(np.asarray(g) < 0)
  cache = layer.init_cache(3, 99)
  c = tiny_cfg
  assert cache.state.shape == (3, c.delta_v_heads, c.delta_qk_dim, c.delta_v_dim)
  assert cache.state.dtype == jnp.float32
  assert cache.conv.shape == (3, c.delta_conv_size - 1, layer.conv_channels)
