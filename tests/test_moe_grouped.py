"""Tests for the 'grouped' (tile loop, custom VJP) and 'gather' (decode) expert paths.

Both are checked against `dense_experts_reference` on random odd-shaped f32
inputs, forward and the gradients wrt x, the combine weights and every expert
weight, including runs that overflow the first-phase tile, experts with no rows,
"no expert" ids and the choice `impl='auto'` makes.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import moe_experts, moe_grouped
from tests.helpers import assert_close
from tests.test_moe import _expert_inputs, _normal, _value_and_grads

GRAD_NAMES = ("x", "weights", "w_gate", "w_up", "w_down")


def _check_against_reference(args, fast, what):
  t, d = args[0].shape
  cot = _normal(jax.random.key(t * d), (t, d))
  y_ref, g_ref = _value_and_grads(lambda *a: moe_experts.dense_experts_reference(*a, jnp.float32),
                                  args, cot)
  y, g = _value_and_grads(fast, args, cot)
  assert_close(y, y_ref, what=f"{what} forward")
  for name, a, b in zip(GRAD_NAMES, g, g_ref, strict=True):
    assert_close(a, b, what=f"{what} grad {name}")


# (t, e, k, d, f, tile, cap): cap 0 = overflow tiles only; small caps force many overflow tiles.
GROUPED_SHAPES = [(14, 8, 2, 13, 5, None, None), (21, 11, 3, 7, 6, 4, 0), (21, 11, 3, 7, 6, 2, 3),
                  (30, 5, 2, 9, 7, 64, 16), (9, 13, 3, 11, 5, 3, 1)]


@pytest.mark.parametrize("t,e,k,d,f,tile,cap", GROUPED_SHAPES)
def test_grouped_tiles_match_dense_reference(t, e, k, d, f, tile, cap, monkeypatch):
  args = _expert_inputs(7 * t + e, t, e, k, d, f)
  if cap is not None:
    monkeypatch.setattr(moe_grouped, "default_cap", lambda rows, experts: cap)
  fast = functools.partial(moe_experts.dropless_experts, dtype=jnp.float32, impl="grouped", block=tile)
  _check_against_reference(args, fast, f"grouped tile={tile} cap={cap}")


def test_grouped_skewed_routing_overflows():
  """Most tokens on experts 0 and 3: long runs past the first tile, empty experts."""
  x, idx, w, wg, wu, wd = _expert_inputs(11, 19, 9, 2, 13, 5)
  idx = idx.at[:15].set(jnp.array([0, 3], jnp.int32))
  fast = functools.partial(moe_experts.dropless_experts, dtype=jnp.float32, impl="grouped", block=3)
  _check_against_reference((x, idx, w, wg, wu, wd), fast, "grouped skewed")


@pytest.mark.parametrize("t,e,k,d,f", [(1, 11, 3, 13, 7), (3, 17, 2, 9, 5), (5, 7, 3, 6, 11)])
def test_gather_matches_dense_reference(t, e, k, d, f):
  args = _expert_inputs(3 * t + e, t, e, k, d, f)
  fast = functools.partial(moe_experts.dropless_experts, dtype=jnp.float32, impl="gather")
  _check_against_reference(args, fast, "gather")


@pytest.mark.parametrize("impl", ["grouped", "gather", "blocked", "ragged_dot"])
def test_no_expert_ids_give_zero(impl):
  """Id e (expert parallelism's empty slot) contributes nothing, forward and backward."""
  x, idx, w, wg, wu, wd = _expert_inputs(5, 6, 7, 2, 9, 5)
  e = wg.shape[0]
  masked = idx.at[1, 0].set(e).at[4, 1].set(e)
  keep = jnp.where(masked < e, w, 0.0)
  ref = functools.partial(moe_experts.dense_experts_reference, dtype=jnp.float32)
  fast = functools.partial(moe_experts.dropless_experts, dtype=jnp.float32, impl=impl)
  cot = _normal(jax.random.key(8), x.shape)
  y_ref, g_ref = _value_and_grads(ref, (x, jnp.minimum(masked, e - 1), keep, wg, wu, wd), cot)
  y, g = _value_and_grads(fast, (x, masked, w, wg, wu, wd), cot)
  assert_close(y, y_ref, what=f"{impl} forward")
  for name, a, b in zip(("x", "w_gate", "w_up", "w_down"), g[:1] + g[2:], g_ref[:1] + g_ref[2:],
                        strict=True):
    assert_close(a, b, what=f"{impl} grad {name}")


def test_auto_rule():
  assert moe_experts.resolve_impl("auto", 4, 32) == "gather"  # decode: t * k < e
  assert moe_experts.resolve_impl("auto", 32, 32) == "grouped"  # CPU training
  assert moe_experts.resolve_impl("blocked", 4, 32) == "blocked"
  with pytest.raises(ValueError, match="impl"):
    moe_experts.resolve_impl("megablocks", 4, 32)


def test_grouped_has_no_per_block_weight_copies():
  """No [n, d, f] weight copy beyond the [e, d, f] weights and gradients, and no float scatter in the
  compiled fwd+bwd; the 'blocked' path fails both checks (so they can fail)."""
  e, d, f = 8, 16, 24
  args = _expert_inputs(2, 64, e, 2, d, f)
  cot = _normal(jax.random.key(3), (64, d))

  def hlo(impl):
    fn = functools.partial(moe_experts.dropless_experts, dtype=jnp.float32, impl=impl)
    loss = lambda *a: jnp.sum(fn(*a) * cot)
    return jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5))).lower(*args).compile().as_text()

  def weight_stacks(text):
    return set(re.findall(rf"f32\[(\d+),{d},{f}\]", text)) | set(re.findall(rf"f32\[(\d+),{f},{d}\]", text))

  float_scatter = r"f32\[[\d,]*\]\{[\d,]*\} scatter\("
  blocked, grouped = hlo("blocked"), hlo("grouped")
  assert weight_stacks(blocked) - {str(e)} and re.search(float_scatter, blocked)
  assert weight_stacks(grouped) <= {str(e), "1"}  # [1, d, f]: one expert's dW row, updated in place
  assert not re.search(float_scatter, grouped)


def test_grouped_bad_tile():
  x, idx, w, wg, wu, wd = _expert_inputs(0, 6, 4, 2, 5, 3)
  with pytest.raises(ValueError, match="block=0"):
    moe_experts.dropless_experts(x, idx, w, wg, wu, wd, jnp.float32, impl="grouped", block=0)


def test_reference_check_can_fail():
  """A perturbed expert weight changes the forward and its gradient beyond tolerance."""
  args = _expert_inputs(1, 14, 8, 2, 13, 5)
  x, idx, w, wg, wu, wd = args
  bad = (x, idx, w, wg.at[int(idx[0, 0])].multiply(1.01), wu, wd)
  fast = functools.partial(moe_experts.dropless_experts, dtype=jnp.float32, impl="grouped")
  y = jax.jit(fast)(*bad)
  y_ref = moe_experts.dense_experts_reference(*args, jnp.float32)
  assert not np.allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)


def _computations(hlo: str) -> dict[str, str]:
  """Name -> text of each computation in an HLO module's text."""
  blocks = re.split(r"\n(?=%|ENTRY )", hlo)
  return {re.match(r"(?:ENTRY )?%?([\w.\-]+)", b).group(1): b for b in blocks if b.strip()}


def _loop_converts(hlo: str, rows: int, widths: tuple[int, ...]) -> list[str]:
  """Converts of a whole [> rows, width] buffer inside a while body (in the fusions it calls)."""
  comps = _computations(hlo)
  pattern = rf"(?:f32|bf16)\[(\d+),(?:{'|'.join(map(str, widths))})\]\{{1,0\}} convert\("
  found = []
  for body in re.findall(r"body=%([\w.\-]+)", hlo):
    for name in [body] + re.findall(r"calls=%([\w.\-]+)", comps[body]):
      found += [f"{name}: [{n}, .]" for n in re.findall(pattern, comps[name]) if int(n) > rows]
  return found


def test_grouped_bf16_writes_tiles_in_place():
  """In bf16 the tile loops write their row buffers in place: no conversion of a whole [rows, d] or
  [rows, f] buffer inside a loop of the compiled fwd+bwd (XLA:CPU computes a bf16 update in f32, so
  a tile write rewrote the whole buffer for every tile), and the bf16 result is still the reference's
  to bf16 accuracy."""
  t, e, k, d, f = 64, 8, 2, 16, 24
  args = _expert_inputs(4, t, e, k, d, f)
  cot = _normal(jax.random.key(5), (t, d))
  fast = functools.partial(moe_experts.dropless_experts, dtype=jnp.bfloat16, impl="grouped")
  loss = lambda *a: jnp.sum(fast(*a).astype(jnp.float32) * cot)
  hlo = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5))).lower(*args).compile().as_text()
  assert re.search(r"body=%", hlo), "the grouped path has no tile loop"
  assert not _loop_converts(hlo, t * k, (d, f)), _loop_converts(hlo, t * k, (d, f))
  y = jax.jit(fast)(*args).astype(jnp.float32)
  y_ref = moe_experts.dense_experts_reference(*args, jnp.float32)
  scale = float(jnp.max(jnp.abs(y_ref)))
  assert float(jnp.max(jnp.abs(y - y_ref))) < 2 ** -6 * scale  # a few bf16 roundings of the operands
