"""serving/weights.py edge cases that mutation testing found unchecked: which weights may be held in
the compute dtype (expected flags written out per weight)."""

import types

import jax
import jax.numpy as jnp

from serving.weights import castable_inputs, engine_castable

BF16 = jnp.bfloat16


def _flags(f, ws, x):
  return dict(zip(sorted(ws), castable_inputs(f, (ws, x), BF16), strict=True))


def test_conversion_to_another_dtype_or_later_f32_use_is_not_castable():
  @jax.jit
  def inner(w, x):
    return x @ w.astype(BF16)

  @jax.jit
  def flat(w):
    return w.reshape(-1)  # a moved copy of its input, returned from a nested call

  def f(ws, x):
    a = x @ ws["a"].astype(jnp.float16).astype(BF16)  # through f16 first: rounds differently
    b = ws["b"][0, 0] * 2  # used in f32, then converted inside a nested jit
    c = inner(ws["b"], x)
    d = jnp.sum(flat(ws["d"]) * 2)  # the nested call's moved output is used in f32
    e = inner(ws["e"], x) + inner(ws["e"].T, x)  # only ever converted: castable
    return a + b.astype(BF16) + c + d.astype(BF16) + e

  ws = {k: jnp.ones((2, 2), jnp.float32) for k in "abde"}
  assert _flags(f, ws, jnp.ones((3, 2), BF16)) == {"a": False, "b": False, "d": False, "e": True}


def test_integer_leaves_are_never_castable():
  def f(ws, x):
    rows = jnp.take(x, ws["idx"], axis=0)  # an int leaf as gather indices
    return rows + ws["n"].astype(BF16) + x @ ws["w"].astype(BF16)

  ws = {"idx": jnp.array([1, 0], jnp.int32), "n": jnp.ones((2, 2), jnp.int32), "w": jnp.ones((2, 2))}
  assert _flags(f, ws, jnp.ones((2, 2), BF16)) == {"idx": False, "n": False, "w": True}


def _fake_engine():
  """prefill and decode_loop programs with the engine's signatures; `b` is used in f32 only by the
  decode program at 2 rows (the MoE path depends on the row count B)."""
  def prefill(st, cache, *_):
    return st["a"].astype(BF16).sum() + st["b"].astype(BF16).sum() + st["c"].sum() + cache.sum()

  def decode_loop(st, cache, rows, *_):
    y = st["a"].astype(BF16).sum() + st["c"].sum()
    if rows.shape[0] == 2:
      return y + (st["b"] * 2).sum().astype(BF16)
    return y + st["b"].astype(BF16).sum()

  cfg = types.SimpleNamespace(jnp_dtype=BF16, d_model=4, vocab_size=8)
  state = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4)), "c": jnp.ones((4, 4), BF16)}
  return {"prefill": prefill, "decode_loop": decode_loop}, state, jnp.zeros((2,)), cfg


def test_engine_castable_needs_every_program_at_every_row_count():
  fns, state, cache, cfg = _fake_engine()
  assert engine_castable(fns, state, cache, cfg, 4, (1, 2), False) == [True, False, False]
  assert engine_castable(fns, state, cache, cfg, 4, (1,), False) == [True, True, False]
  as_bf16 = jax.tree.map(lambda x: x.astype(BF16), state)
  assert engine_castable(fns, as_bf16, cache, cfg, 4, (1, 2), False) is None
