"""model/moe_grouped.py and model/moe_experts.py at their tile and block boundaries, against a plain
dense reference written out here (every expert on every token, masked by the routing), forward and
gradients, on random odd-shaped f32 inputs; the default tile/block sizes worked out by hand.

Routing is set by hand so expert runs are exactly `cap` rows, exactly `cap + tile`, one past it,
empty, and the last expert overflows (its last tile reads past the sorted rows)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import moe_experts, moe_grouped
from tests.helpers import assert_close

# Expert runs for cap=4, tile=3: exactly cap, empty, cap + tile, 1, cap + tile + 1 (the last expert).
SIZES = (4, 0, 7, 1, 8)


def _swiglu(x, wg, wu, wd):
  g = jnp.dot(x, wg, precision="highest")
  return jnp.dot(jax.nn.silu(g) * jnp.dot(x, wu, precision="highest"), wd, precision="highest")


def _plain_rows(x, ids_a, kslots, wg, wu, wd):
  """Row a = expert ids_a[a] on token a // k; zeros for id e ("no expert")."""
  rows = []
  for a, ex in enumerate(np.asarray(ids_a)):
    if ex == wg.shape[0]:
      rows.append(jnp.zeros((x.shape[1],), jnp.float32))
    else:
      rows.append(_swiglu(x[a // kslots], wg[ex], wu[ex], wd[ex]))
  return jnp.stack(rows)


def _plain_combined(x, idx, w, wg, wu, wd):
  """sum_j w_tj * expert_{idx_tj}(x_t), every expert run on every token and masked by the routing."""
  y = jnp.zeros(x.shape, jnp.float32)
  for ex in range(wg.shape[0]):
    c = jnp.sum(jnp.where(idx == ex, w, 0.0), axis=1)  # [t]
    y = y + c[:, None] * _swiglu(x, wg[ex], wu[ex], wd[ex])
  return y


def _inputs(seed, t, e, d, f):
  rng = np.random.default_rng(seed)
  r = lambda *s, scale=1.0: jnp.asarray(scale * rng.standard_normal(s), jnp.float32)  # noqa: E731
  return (r(t, d), r(e, d, f, scale=d ** -0.5), r(e, d, f, scale=d ** -0.5), r(e, f, d, scale=f ** -0.5),
          rng)


def _ids_for_sizes(sizes, rng, extra_none=0):
  """Token ids (k=1) with run `sizes`, plus `extra_none` "no expert" ids, in shuffled token order."""
  ids = np.concatenate([np.repeat(np.arange(len(sizes)), sizes), np.full(extra_none, len(sizes))])
  return rng.permutation(ids).astype(np.int32)


def _check(fast, plain, args, cot, what):
  loss = lambda fn: (lambda *a: jnp.sum(fn(*a) * cot))  # noqa: E731
  argnums = tuple(range(len(args)))
  y, g = fast(*args), jax.jit(jax.grad(loss(fast), argnums=argnums))(*args)
  y_ref, g_ref = plain(*args), jax.grad(loss(plain), argnums=argnums)(*args)
  assert_close(y, y_ref, what=f"{what} forward")
  for i, (a, b) in enumerate(zip(g, g_ref, strict=True)):
    assert_close(a, b, what=f"{what} grad of arg {i}")


@pytest.mark.parametrize("cap,tile", [(4, 3), (0, 3), (8, 8), (1, 1), (4, 7)])
def test_grouped_swiglu_runs_at_tile_boundaries(cap, tile):
  """Runs of exactly cap / cap + tile / cap + tile + 1 rows, an empty expert, "no expert" rows sorted
  last: forward and d(x, w_gate, w_up, w_down) per assignment row."""
  x, wg, wu, wd, rng = _inputs(cap * 10 + tile, sum(SIZES) + 2, len(SIZES), 6, 5)
  ids = _ids_for_sizes(SIZES, rng, extra_none=2)
  order = jnp.asarray(np.argsort(ids, kind="stable"), jnp.int32)
  sizes = jnp.asarray(SIZES, jnp.int32)
  fast = jax.jit(lambda x, wg, wu, wd: moe_grouped.grouped_swiglu(x, order, sizes, 1, wg, wu, wd,
                                                                  jnp.float32, tile=tile, cap=cap))
  plain = lambda x, wg, wu, wd: _plain_rows(x, ids, 1, wg, wu, wd)  # noqa: E731
  cot = jnp.asarray(rng.standard_normal((len(ids), x.shape[1])), jnp.float32)
  _check(fast, plain, (x, wg, wu, wd), cot, f"grouped cap={cap} tile={tile}")


def test_grouped_swiglu_k_slots_sum_dx_over_a_tokens_rows():
  """k=3: a token's three rows land in different runs; dx sums their three contributions."""
  t, e, k = 7, 4, 3
  x, wg, wu, wd, rng = _inputs(5, t, e, 5, 3)
  ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).reshape(-1).astype(np.int32)
  order = jnp.asarray(np.argsort(ids, kind="stable"), jnp.int32)
  sizes = jnp.asarray(np.bincount(ids, minlength=e), jnp.int32)
  fast = jax.jit(lambda x, wg, wu, wd: moe_grouped.grouped_swiglu(x, order, sizes, k, wg, wu, wd,
                                                                  jnp.float32, tile=2, cap=3))
  plain = lambda x, wg, wu, wd: _plain_rows(x, ids, k, wg, wu, wd)  # noqa: E731
  cot = jnp.asarray(rng.standard_normal((t * k, x.shape[1])), jnp.float32)
  _check(fast, plain, (x, wg, wu, wd), cot, "grouped k=3")


@pytest.mark.parametrize("impl,block", [("grouped", 3), ("grouped", None), ("blocked", 4), ("blocked", 1),
                                        ("blocked", None), ("ragged_dot", None)])
def test_dropless_experts_exact_runs_match_plain_reference(impl, block):
  """dropless_experts with the runs above (k=1 first slot) and a second slot on the next expert
  (k=2, weights not summing to 1): output and grads wrt x, the combine weights and every weight."""
  e = len(SIZES)
  x, wg, wu, wd, rng = _inputs(17, sum(SIZES), e, 6, 5)
  first = _ids_for_sizes(SIZES, rng)
  idx = jnp.asarray(np.stack([first, (first + 1) % e], axis=1), jnp.int32)
  w = jnp.asarray(rng.uniform(0.1, 1.0, idx.shape), jnp.float32)
  fast = jax.jit(lambda x, w, wg, wu, wd: moe_experts.dropless_experts(x, idx, w, wg, wu, wd, jnp.float32,
                                                                       impl=impl, block=block))
  plain = lambda x, w, wg, wu, wd: _plain_combined(x, idx, w, wg, wu, wd)  # noqa: E731
  cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  _check(fast, plain, (x, w, wg, wu, wd), cot, f"{impl} block={block}")


@pytest.mark.parametrize("impl", ["grouped", "blocked", "gather"])
def test_no_expert_ids_are_zero_against_plain_reference(impl):
  """Id e ("no expert") in some slots: those slots add nothing and get no gradient."""
  e = 4
  x, wg, wu, wd, rng = _inputs(3, 6, e, 5, 3)
  idx = jnp.asarray([[0, 4], [4, 4], [3, 1], [2, 4], [4, 0], [1, 3]], jnp.int32)
  w = jnp.asarray(rng.uniform(0.1, 1.0, idx.shape), jnp.float32)
  fast = jax.jit(lambda x, w, wg, wu, wd: moe_experts.dropless_experts(x, idx, w, wg, wu, wd, jnp.float32,
                                                                       impl=impl, block=2))
  plain = lambda x, w, wg, wu, wd: _plain_combined(x, idx, w, wg, wu, wd)  # noqa: E731
  cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  _check(fast, plain, (x, w, wg, wu, wd), cot, f"{impl} no-expert")


def test_default_sizes_worked_by_hand():
  """cap = ceil(rows / e) rounded up to 8; block = ceil(rows / e) to a power of 2 in [8, 128]."""
  for rows, e, want in ((17, 4, 8), (64, 4, 16), (65, 4, 24), (3, 8, 8), (0, 4, 8), (129, 8, 24)):
    assert moe_grouped.default_cap(rows, e) == want, (rows, e)
  for rows, e, want in ((40, 4, 16), (9, 1, 16), (300, 1, 128), (16, 2, 8), (33, 2, 32), (65, 4, 32)):
    assert moe_experts.default_block(rows, e) == want, (rows, e)


def test_auto_picks_gather_only_below_one_assignment_per_expert():
  assert moe_experts.resolve_impl("auto", 7, 8) == "gather"
  assert moe_experts.resolve_impl("auto", 8, 8) == "grouped"  # XLA:CPU in the tests
  assert moe_experts.resolve_impl("blocked", 1, 8) == "blocked"


def test_bad_tile_cap_and_block_are_refused():
  x, wg, wu, wd, _ = _inputs(1, 4, 2, 3, 2)
  order, sizes = jnp.arange(4, dtype=jnp.int32), jnp.asarray([2, 2], jnp.int32)
  for tile, cap in ((0, None), (2, -1)):
    with pytest.raises(ValueError, match="tile="):
      moe_grouped.grouped_swiglu(x, order, sizes, 1, wg, wu, wd, jnp.float32, tile=tile, cap=cap)
  idx, w = jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1), jnp.float32)
  with pytest.raises(ValueError, match="block=0"):
    functools.partial(moe_experts.dropless_experts, impl="blocked", block=0)(x, idx, w, wg, wu, wd,
                                                                              jnp.float32)


@pytest.mark.parametrize("impl", ["grouped", "gather", "blocked", "ragged_dot"])
def test_empty_batch_gives_an_empty_output_and_zero_weight_grads(impl):
  """Zero tokens (an empty batch) is valid input: [0, d] out, zero gradients (it used to crash)."""
  x, wg, wu, wd, _ = _inputs(2, 0, 4, 5, 3)
  idx, w = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2), jnp.float32)
  run = lambda wg: moe_experts.dropless_experts(x, idx, w, wg, wu, wd, jnp.float32, impl=impl)  # noqa: E731
  assert run(wg).shape == (0, 5)
  np.testing.assert_array_equal(jax.grad(lambda wg: jnp.sum(run(wg)))(wg), np.zeros(wg.shape, np.float32))


def test_blocked_worst_case_every_run_one_past_a_block():
  """Runs of 1, 5, 1 rows with block=4 need 1 + 2 + 1 = 4 blocks, the static bound
  (7 + 3 * (4 - 1)) // 4 exactly: every expert's last block holds one row."""
  x, wg, wu, wd, rng = _inputs(9, 7, 3, 5, 4)
  idx = jnp.asarray(_ids_for_sizes((1, 5, 1), rng)[:, None], jnp.int32)
  w = jnp.asarray(rng.uniform(0.1, 1.0, idx.shape), jnp.float32)
  fast = jax.jit(lambda x, w, wg, wu, wd: moe_experts.dropless_experts(x, idx, w, wg, wu, wd, jnp.float32,
                                                                       impl="blocked", block=4))
  plain = lambda x, w, wg, wu, wd: _plain_combined(x, idx, w, wg, wu, wd)  # noqa: E731
  cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  _check(fast, plain, (x, w, wg, wu, wd), cot, "blocked worst case")


def test_duplicate_ids_in_a_token_add_both_slots():
  """A token routed twice to one expert (e.g. replayed ids) gets both slots' weights: the dense
  reference and the grouped path sum them like the plain loop."""
  x, wg, wu, wd, rng = _inputs(6, 5, 3, 4, 3)
  idx = jnp.asarray([[1, 1], [0, 2], [2, 2], [0, 1], [0, 0]], jnp.int32)
  w = jnp.asarray(rng.uniform(0.1, 1.0, idx.shape), jnp.float32)
  want = _plain_combined(x, idx, w, wg, wu, wd)
  assert_close(moe_experts.dense_experts_reference(x, idx, w, wg, wu, wd, jnp.float32), want, what="dense")
  assert_close(moe_experts.dropless_experts(x, idx, w, wg, wu, wd, jnp.float32, impl="grouped"), want,
               what="grouped")


def test_route_replay_takes_the_given_ids_only_where_use_is_set(tiny_cfg):
  from flax import nnx  # noqa: PLC0415

  from model.moe import MoE  # noqa: PLC0415
  layer = MoE(tiny_cfg, rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(2), (2, 3, tiny_cfg.d_model), jnp.float32)
  own = np.asarray(layer.route(x)[2])
  ids = (own + 1) % tiny_cfg.num_experts  # differs from the router's choice everywhere
  use = np.array([[True, False, True], [False, False, True]])
  got = np.asarray(layer.route(x, replay=(jnp.asarray(ids), jnp.asarray(use)))[2])
  for b in range(2):
    for t in range(3):
      np.testing.assert_array_equal(got[b, t], ids[b, t] if use[b, t] else own[b, t])
