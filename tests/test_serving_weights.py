"""serving/weights.py: the engine holds compute-dtype copies of the weights it only uses in that
dtype, and computes exactly what it computed with the f32 weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.engine import Engine, Request
from serving.types import SamplingParams
from serving.weights import castable_inputs, compute_dtype_state


def test_castable_follows_conversions_nested_calls_and_moves():
  @jax.jit
  def inner(w, x):
    return x @ w.astype(jnp.bfloat16)

  def f(ws, x):
    a = inner(ws["a"], x)  # converted inside a nested jit: castable
    b = x @ jnp.take(ws["b"], jnp.array([1, 0]), axis=0).astype(jnp.bfloat16)  # gathered, then converted
    c = x.astype(jnp.float32) @ ws["c"]  # used in f32: not castable
    d = x @ ws["d"].astype(jnp.bfloat16) + ws["d"][0, 0]  # also used in f32 once: not castable
    return a + b + c.astype(jnp.bfloat16) + d, ws["e"]  # returned: not castable

  ws = {k: jnp.ones((2, 2), jnp.float32) for k in "abcde"}
  flags = castable_inputs(f, (ws, jnp.ones((3, 2), jnp.bfloat16)), jnp.bfloat16)
  assert dict(zip(sorted(ws), flags, strict=True)) == {"a": True, "b": True, "c": False, "d": False,
                                                       "e": False}
  cast = compute_dtype_state(ws, flags, jnp.bfloat16)
  assert cast["a"].dtype == jnp.bfloat16 and cast["c"].dtype == jnp.float32
  with pytest.raises(ValueError, match="structure changed"):
    compute_dtype_state(ws, flags[:2], jnp.bfloat16)


def test_castable_follows_while_loop_bodies():
  def f(ws, x):
    def body(carry):
      i, y, c = carry
      y = y @ ws["a"].astype(jnp.bfloat16)  # a body const converted: castable
      y = y + (ws["b"][0, 0] * 2).astype(jnp.bfloat16)  # computed with in f32 first: not castable
      return i + 1, y, c * 2  # c rides in the carry: not castable

    def cond(carry):
      return carry[0] < (ws["d"][0, 0] > 0).astype(jnp.int32) + 2  # a cond const compared in f32

    return jax.lax.while_loop(cond, body, (0, x, ws["c"]))[1]

  ws = {k: jnp.ones((2, 2), jnp.float32) for k in "abcd"}
  flags = castable_inputs(f, (ws, jnp.ones((3, 2), jnp.bfloat16)), jnp.bfloat16)
  assert dict(zip(sorted(ws), flags, strict=True)) == {"a": True, "b": False, "c": False, "d": False}


@pytest.fixture(scope="module")
def bf16_model():
  from configs import serve
  from serving.build import build_engine
  config = serve.get_config("tiny")
  config.model.dtype = "bfloat16"  # f32 master weights, bf16 compute: the case this is for
  config.serving.update(slots=2, max_context=96, prefill_chunk=16, prefix_cache_mb=0)
  eng = build_engine(config)
  return eng


def test_engine_computes_the_same_bits_with_compute_dtype_weights(bf16_model):
  eng = bf16_model
  plain = Engine(eng.model, eng.tokenizer, slots=2, max_context=96, prefill_chunk=16,
                 compute_dtype_weights=False)
  leaves = jax.tree.leaves(eng._state)
  n_bf16 = sum(x.dtype == jnp.bfloat16 for x in leaves)
  assert n_bf16 > len(leaves) // 3  # the projections are held in bf16 (routed experts: model/moe_grouped) ...
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(plain._state) if x.dtype.kind == "f")
  stored = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_flatten_with_path(eng._state)[0]}
  assert all(v == jnp.float32 for k, v in stored.items() if "norm" in k or "router" in k)  # ... not these
  prompt = [int(t) for t in np.random.default_rng(0).integers(3, 300, 37)]
  np.testing.assert_array_equal(eng.next_token_logits(prompt), plain.next_token_logits(prompt))
  params = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
  a = eng.submit(Request(prompt, params))
  b = plain.submit(Request(prompt, params))
  ev_a, ev_b = list(eng._drive(a)), list(plain._drive(b))
  assert [t for e in ev_a for t in e.token_ids] == [t for e in ev_b for t in e.token_ids]
  assert [lp for e in ev_a for lp in e.logprobs] == [lp for e in ev_b for lp in e.logprobs]
  # New weights are converted again.
  eng.update_weights()
  assert sum(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(eng._state)) == n_bf16
