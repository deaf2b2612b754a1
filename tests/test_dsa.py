"""Tests for model/attention/dsa.py (Gated DSA); its sparse kernels: tests/test_dsa_sparse.py.

Every fast path is checked against a plain dense reference on random, odd-sized
inputs, forward and gradients, in f32. The layer reference below is written
from the MLA equations in the non-absorbed form (explicit per-head keys
[latent W_uk, k_rope] and values latent W_uv), independently of the layer.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from model.attention.dsa import GatedDSA
from model.layers import apply_rope, scatter_set
from tests.helpers import assert_close, normal_data, packed_segments, row_positions, segment_positions


# ---------------------------------------------------------------------------
# Layer: independent dense reference (non-absorbed MLA).
# ---------------------------------------------------------------------------
def _rms(x, scale, eps):
  return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _ref_cq(p, x, cfg):
  return _rms(x @ p["w_dq"], p["q_norm"]["scale"], cfg.norm_eps)


def ref_index_scores(p, x, pos, cfg):
  """I[t,s] = sum_j w[t,j] relu(q_I[t,j] . k_I[s]) from the params, [b, t, s]."""
  r = cfg.qk_rope_dim
  qi = jnp.einsum("btr,rhk->bthk", _ref_cq(p, x, cfg), p["w_qi"])
  qi = jnp.concatenate([apply_rope(qi[..., :r], pos, cfg.rope_theta), qi[..., r:]], -1)
  ki = x @ p["w_ki"]
  mu, var = ki.mean(-1, keepdims=True), ki.var(-1, keepdims=True)
  ki = (ki - mu) / jnp.sqrt(var + cfg.norm_eps) * p["index_k_norm"]["scale"] + p["index_k_norm"]["bias"]
  ki = jnp.concatenate([apply_rope(ki[..., :r], pos, cfg.rope_theta), ki[..., r:]], -1)
  w = x @ p["w_w"] / np.sqrt(cfg.index_heads)
  return jnp.einsum("bth,bths->bts", w, jax.nn.relu(jnp.einsum("bthk,bsk->bths", qi, ki)))


def ref_topk_mask(scores, mask, k):
  """The reference top-k set as a [b, t, s] mask.

  Exact ties (relu makes many scores exactly 0) go to the lower key index, as
  lax.top_k and the layer do.
  """
  if k >= mask.shape[-1]:
    return mask
  ids = jax.lax.top_k(jnp.where(mask, scores, -jnp.inf), k)[1]
  return mask & jnp.any(ids[..., None] == jnp.arange(mask.shape[-1]), axis=-2)


@functools.partial(jax.jit, static_argnums=4)
def _near_ties(p, x, pos, seg, cfg):
  k, t = cfg.index_topk, x.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  mask = causal & (seg[:, :, None] == seg[:, None, :])
  vals = jax.lax.top_k(jnp.where(mask, ref_index_scores(p, x, pos, cfg), -jnp.inf), k + 1)[0]
  gap = vals[..., k - 1] - vals[..., k]
  return jnp.any((gap > 0) & (gap < 1e-4))


def assert_unambiguous_topk(p, x, pos, seg, cfg):
  """A near-tie (not exact) at the k-th score would make the reference set ambiguous."""
  if cfg.index_topk < x.shape[1]:
    assert not bool(_near_ties(p, x, pos, seg, cfg)), "near-tie at the top-k boundary; change seed"


def ref_layer(p, x, pos, seg, cfg, sparse_topk=True):
  """Returns (y, head-summed attention probs [b,t,s], key mask [b,t,s])."""
  nope, r, c = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
  b, t, _ = x.shape
  q = jnp.einsum("btr,rhk->bthk", _ref_cq(p, x, cfg), p["w_uq"])
  q = jnp.concatenate([q[..., :nope], apply_rope(q[..., nope:], pos, cfg.rope_theta)], -1)
  kv = x @ p["w_dkv"]
  lat = _rms(kv[..., :c], p["kv_norm"]["scale"], cfg.norm_eps)
  k_pe = apply_rope(kv[..., c:], pos, cfg.rope_theta)
  k = jnp.concatenate([jnp.einsum("btc,chk->bthk", lat, p["w_uk"]),
                       jnp.broadcast_to(k_pe[:, :, None], (b, t, cfg.num_heads, r))], -1)
  v = jnp.einsum("btc,chv->bthv", lat, p["w_uv"])
  i = jnp.arange(t)
  mask = (seg[:, :, None] == seg[:, None, :]) & (i[:, None] >= i[None, :])
  if sparse_topk:
    mask = ref_topk_mask(ref_index_scores(p, x, pos, cfg), mask, cfg.index_topk)
  logits = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(nope + r)
  prob = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), -1)
  o = jnp.einsum("bhts,bshv->bthv", prob, v)
  o = o * jax.nn.sigmoid(jnp.einsum("btd,dhv->bthv", x, p["w_g"]))
  y = jnp.einsum("bthv,hvd->btd", o, p["w_o"])
  return y, prob.sum(1) / cfg.num_heads, mask


def ref_indexer_loss(p, x, pos, seg, cfg, sparse_topk):
  _, prob, mask = ref_layer(p, x, pos, seg, cfg, sparse_topk)
  logq = jax.nn.log_softmax(jnp.where(mask, ref_index_scores(p, x, pos, cfg), -jnp.inf), -1)
  kl = jnp.where(mask, prob * (jnp.log(jnp.where(mask, prob, 1.0)) - jnp.where(mask, logq, 0.0)), 0.0)
  return kl.sum(-1).mean()


def _make(cfg, seed=0):
  """(layer, graphdef, params, rest) with random parameters, split for functional calls.

  Parameters are drawn with numpy (fan-in scaled; norm scales around 1 and
  LayerNorm bias non-zero, so the norms' parameters are exercised too) into an
  abstract layer: no compile per parameter shape.
  """
  abstract = nnx.eval_shape(lambda: GatedDSA(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  rng = np.random.default_rng(seed)

  def draw(path, a):
    name, z = jax.tree_util.keystr(path), rng.standard_normal(a.shape, np.float32)
    if "norm" in name:
      return jnp.asarray((1.0 if "scale" in name else 0.0) + 0.2 * z)
    return jnp.asarray(z / np.sqrt(np.prod(a.shape[:2]) if "w_o" in name else a.shape[0]))

  nnx.replace_by_pure_dict(params, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(params)))
  return nnx.merge(graphdef, params, rest), graphdef, params, rest


@functools.partial(jax.jit, static_argnums=0)
def _layer_fwd(graphdef, params, rest, x, pos, seg):
  y, aux = nnx.merge(graphdef, params, rest)(x, pos, seg)
  return y, aux["indexer_loss"]


@functools.partial(jax.jit, static_argnums=0)
def _layer_grads(graphdef, params, rest, x, pos, seg, cot):
  """y, indexer loss, grads of sum(y * cot) and of the indexer loss wrt (params, x)."""
  def f(ps, x, which):
    y, loss = _layer_fwd(graphdef, ps, rest, x, pos, seg)
    return (jnp.sum(y * cot), loss)[which], (y, loss)
  (_, (y, loss)), g_y = jax.value_and_grad(f, (0, 1), has_aux=True)(params, x, 0)
  g_loss = jax.grad(lambda ps, x: f(ps, x, 1)[0], (0, 1))(params, x)
  return y, loss, g_y, g_loss


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ref_grads(cfg, sparse_topk, p, x, pos, seg, cot):
  """Reference y, indexer loss and grads of sum(y * cot) wrt (params, x)."""
  def f(p, x):
    y = ref_layer(p, x, pos, seg, cfg, sparse_topk)[0]
    return jnp.sum(y * cot), y
  (_, y), g = jax.value_and_grad(f, (0, 1), has_aux=True)(p, x)
  return y, ref_indexer_loss(p, x, pos, seg, cfg, sparse_topk), g


def _flat(tree):
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("stage,t,segs,dense_len", [("sparse", 13, [], 0), ("sparse", 37, [15], 0),
                                                    ("sparse", 37, [15], 40), ("dense_warmup", 37, [20], 0)])
def test_layer_matches_dense_reference(tiny_cfg, stage, t, segs, dense_len):
  """Sparse stage: t <= topk is plain causal MLA, t > topk is MLA masked to the
  reference top-k set (gathered, or with t <= dsa_dense_len dense under the top-k mask);
  dense warm-up stage: dense MLA. Forward, indexer loss, gradients wrt every parameter and x."""
  cfg = tiny_cfg.replace(indexer_stage=stage, dsa_dense_len=dense_len)
  _, graphdef, params, rest = _make(cfg, seed=1)
  b = 2
  x = normal_data(60 + t, (b, t, cfg.d_model))
  seg = packed_segments(b, t, [segs, []])
  pos = segment_positions(seg)
  cot = normal_data(7, x.shape)
  p = nnx.to_pure_dict(params)
  sparse_topk = stage == "sparse"
  if sparse_topk:
    assert_unambiguous_topk(p, x, pos, seg, cfg)
  y, loss, (g_p, g_x), _ = _layer_grads(graphdef, params, rest, x, pos, seg, cot)
  y_r, loss_r, (r_p, r_x) = _ref_grads(cfg, sparse_topk, p, x, pos, seg, cot)
  assert_close(y, y_r, what="y")
  assert_close(loss, loss_r, what="indexer loss")
  assert_close(g_x, r_x, what="grad x")
  g_p, r_p = _flat(nnx.to_pure_dict(g_p)), _flat(r_p)
  assert g_p.keys() == r_p.keys()
  for name in g_p:
    assert_close(g_p[name], r_p[name], what=f"grad {name}")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _path_grads(graphdef, path, params, rest, x, pos, seg, cot):
  """y, indexer loss and the grads of sum(y * cot) + loss through one attention path: "sparse"
  (gathered top-k), "dense" (every allowed key) or "masked" (dense under the top-k mask)."""
  def f(ps, x):
    layer = nnx.merge(graphdef, ps, rest)
    c_q, q_lat, q_rope, latent, k_rope = layer.mla_projections(x, pos)
    q_i, w_i, k_i = layer.indexer_projections(x, c_q, pos)
    order = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
    args = (q_lat, q_rope, latent, k_rope, q_i, w_i, k_i, order, seg, order, seg)
    if path == "sparse":
      out, loss = layer._sparse(*args, with_loss=True)
    else:
      out, loss = layer._dense(*args, topk=layer.cfg.index_topk if path == "masked" else None)
    y = layer.output_projection(out, x)
    return jnp.sum(y * cot) + loss, (y, loss)
  (_, (y, loss)), g = jax.value_and_grad(f, (0, 1), has_aux=True)(params, x)
  return y, loss, g


@pytest.mark.parametrize("path,t,segs", [("dense", 13, [[6], []]), ("masked", 41, [[9], []]),
                                          ("masked", 64, [[30, 47], [5]])])
def test_call_paths_equal_the_sparse_path(tiny_cfg, path, t, segs):
  """The sparse stage's two dense computations, each taken by __call__ and equal to the gathered
  sparse path -- attention, indexer KL over the selected keys, gradients wrt every parameter (the
  indexer's included) and x:
  - "dense", t <= index_topk: top-k selects every allowed key, so one dense MQA over them;
  - "masked", index_topk < t <= dsa_dense_len: dense MQA under the exact top-k mask, on packed
    rows where some queries see fewer than top-k keys and others choose among many."""
  cfg = tiny_cfg.replace(indexer_stage="sparse", dsa_dense_len=t if path == "masked" else 0)
  assert (t > cfg.index_topk) == (path == "masked")
  _, graphdef, params, rest = _make(cfg, seed=5 + t)
  x = normal_data(90 + t, (2, t, cfg.d_model))
  seg = packed_segments(2, t, segs)
  pos = segment_positions(seg)
  cot = normal_data(91, x.shape)
  assert_unambiguous_topk(nnx.to_pure_dict(params), x, pos, seg, cfg)
  y_d, loss_d, (gp_d, gx_d) = _path_grads(graphdef, path, params, rest, x, pos, seg, cot)
  y_s, loss_s, (gp_s, gx_s) = _path_grads(graphdef, "sparse", params, rest, x, pos, seg, cot)
  y, loss = _layer_fwd(graphdef, params, rest, x, pos, seg)
  np.testing.assert_array_equal(y, y_d)  # __call__ took this path
  assert_close(y_d, y_s, what="y")
  assert_close(loss_d, loss_s, what="indexer loss")
  assert float(loss_s) > 0
  assert_close(gx_d, gx_s, what="grad x")
  gp_d, gp_s = _flat(nnx.to_pure_dict(gp_d)), _flat(nnx.to_pure_dict(gp_s))
  for name in gp_d:
    assert_close(gp_d[name], gp_s[name], what=f"grad {name}")
  assert any(float(jnp.abs(gp_d[n]).max()) > 0 for n in gp_d if "w_ki" in n)  # the indexer learns


def test_layer_check_grads(tiny_cfg):
  _, graphdef, params, rest = _make(tiny_cfg, seed=3)
  x = normal_data(80, (1, 5, tiny_cfg.d_model))
  pos, seg = row_positions(1, 5), jnp.zeros((1, 5), jnp.int32)
  f = lambda x: _layer_fwd(graphdef, params, rest, x, pos, seg)[0]
  check_grads(f, (x,), order=1, modes=["rev"], eps=1e-3)


def test_packed_segments_do_not_mix(tiny_cfg):
  """Two segments packed in one row == each segment run alone with positions from 0."""
  _, graphdef, params, rest = _make(tiny_cfg, seed=4)
  cut, t = 15, 37
  x = normal_data(90, (2, t, tiny_cfg.d_model))
  seg = packed_segments(2, t, [[cut], [cut]])
  y, _ = _layer_fwd(graphdef, params, rest, x, segment_positions(seg), seg)
  # Alone: row 0 = segment A (+ trailing tokens it cannot see), row 1 = segment B.
  x_alone = jnp.stack([x[0, :t - cut], x[0, cut:]])
  y_alone, _ = _layer_fwd(graphdef, params, rest, x_alone, row_positions(2, t - cut),
                          jnp.zeros((2, t - cut), jnp.int32))
  assert_close(y[0, :cut], y_alone[0, :cut], what="segment A")
  assert_close(y[0, cut:], y_alone[1], what="segment B")


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_indexer_loss_trains_only_the_indexer(tiny_cfg, stage):
  cfg = tiny_cfg.replace(indexer_stage=stage)
  _, graphdef, params, rest = _make(cfg, seed=5)
  b, t = 2, 37
  x, seg = normal_data(100, (b, t, cfg.d_model)), packed_segments(b, t, [[11], []])
  _, loss, _, (g_p, g_x) = _layer_grads(graphdef, params, rest, x, segment_positions(seg), seg,
                                        jnp.ones_like(x))
  assert np.isfinite(float(loss)) and float(loss) > 0
  assert float(jnp.abs(g_x).max()) == 0.0
  indexer = ("w_qi", "w_ki", "w_w", "index_k_norm")
  for name, g in _flat(nnx.to_pure_dict(g_p)).items():
    size = float(jnp.abs(g).max())
    if any(n in name for n in indexer):
      assert np.isfinite(size) and size > 0, f"indexer param {name} gets no gradient"
    else:
      assert size == 0.0, f"indexer loss leaks into {name}"


_INDEXER_PARAMS = ("w_qi", "w_ki", "w_w", "index_k_norm")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ref_indexer_grads(cfg, sparse_topk, p, x, pos, seg):
  """Grads of the reference indexer loss wrt the indexer's params; the main model's params (and so
  the target distribution and c_q) held constant, as the layer's stop_gradients do."""
  def f(pi):
    return ref_indexer_loss({**jax.lax.stop_gradient(p), **pi}, x, pos, seg, cfg, sparse_topk)
  return jax.grad(f)({k: p[k] for k in _INDEXER_PARAMS})


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_indexer_loss_gradients_match_reference(tiny_cfg, stage):
  """The indexer KL's gradient wrt every indexer parameter equals the plain log_softmax reference's
  (the value alone cannot tell a wrong softmax normaliser gradient)."""
  cfg = tiny_cfg.replace(indexer_stage=stage)
  _, graphdef, params, rest = _make(cfg, seed=1)
  b, t = 2, 37
  x = normal_data(60 + t, (b, t, cfg.d_model))
  seg = packed_segments(b, t, [[15], []])
  pos = segment_positions(seg)
  p = nnx.to_pure_dict(params)
  if stage == "sparse":
    assert_unambiguous_topk(p, x, pos, seg, cfg)
  _, _, _, (g_p, _) = _layer_grads(graphdef, params, rest, x, pos, seg, jnp.ones_like(x))
  got, want = _flat(nnx.to_pure_dict(g_p)), _flat(_ref_indexer_grads(cfg, stage == "sparse", p, x, pos, seg))
  assert want and set(want) <= set(got)
  for name, w in want.items():
    assert float(jnp.abs(w).max()) > 0, name
    assert_close(got[name], w, what=f"indexer loss grad {name}")


@functools.partial(jax.jit, static_argnums=0)
def _extend(graphdef, params, rest, x, valid, cache):
  return nnx.merge(graphdef, params, rest).extend(x, valid, cache)


def test_extend_whole_sequence_equals_call(tiny_cfg):
  layer, graphdef, params, rest = _make(tiny_cfg, seed=6)
  b, t = 2, 37
  x = normal_data(110, (b, t, tiny_cfg.d_model))
  y, _ = _layer_fwd(graphdef, params, rest, x, row_positions(b, t), jnp.zeros((b, t), jnp.int32))
  y_ext, cache = _extend(graphdef, params, rest, x, jnp.ones((b, t), bool), layer.init_cache(b, 45))
  assert_close(y_ext, y, what="extend vs call")
  np.testing.assert_array_equal(cache.lengths, [t, t])
  assert cache.latent.shape == (b, 45, tiny_cfg.kv_lora_rank)


def test_prefill_then_decode_matches_call(tiny_cfg):
  """Prompts of 13 and 4 tokens, sequences of 29 and 23: chunked prefill (two
  chunks), then one token per step; rows that are done feed invalid tokens."""
  layer, graphdef, params, rest = _make(tiny_cfg, seed=7)
  total, prompt = np.array([29, 23]), np.array([13, 4])
  # Tokens past a row's total are never fed; causality keeps them out of its reference outputs.
  x_all = normal_data(120, (2, 37, tiny_cfg.d_model))
  y_ref, _ = _layer_fwd(graphdef, params, rest, x_all, row_positions(2, 37), jnp.zeros((2, 37), jnp.int32))
  cache = layer.init_cache(2, 40)
  outs, fed = [[], []], np.zeros(2, int)
  steps = total - prompt
  chunks = [prompt - 2, np.array([2, 2])] + [(i < steps).astype(int) for i in range(steps.max())]
  for chunk in chunks:  # chunk[r] = number of tokens row r feeds now
    t = int(chunk.max())
    x = jnp.stack([jnp.pad(x_all[r, fed[r]:fed[r] + chunk[r]], ((0, t - chunk[r]), (0, 0)))
                   for r in range(2)])
    y, cache = _extend(graphdef, params, rest, x, jnp.arange(t)[None] < jnp.asarray(chunk)[:, None], cache)
    for r in range(2):
      outs[r].append(y[r, :chunk[r]])
    fed += chunk
  np.testing.assert_array_equal(cache.lengths, total)
  for r in range(2):
    assert_close(jnp.concatenate(outs[r]), y_ref[r, :total[r]], rtol=1e-4, what=f"row {r}")


def test_layer_bad_inputs(tiny_cfg):
  layer = _make(tiny_cfg, seed=8)[0]
  x = normal_data(130, (1, 5, tiny_cfg.d_model))
  pos, seg = row_positions(1, 5), jnp.zeros((1, 5), jnp.int32)
  with pytest.raises(ValueError, match="d_model"):
    layer(x[..., :-1], pos, seg)
  with pytest.raises(ValueError, match="positions"):
    layer(x, pos[:, :4], seg)
  with pytest.raises(ValueError, match="segment_ids"):
    layer(x, pos, seg.astype(jnp.float32))
  cache = layer.init_cache(1, 6)
  with pytest.raises(ValueError, match="max_len"):
    layer.extend(normal_data(131, (1, 7, tiny_cfg.d_model)), jnp.ones((1, 7), bool), cache)
  cache = cache.replace(lengths=jnp.array([5], jnp.int32))
  with pytest.raises(ValueError, match="max_len"):
    layer.extend(x[:, :2], jnp.ones((1, 2), bool), cache)
  with pytest.raises(ValueError, match="batch"):
    layer.extend(jnp.concatenate([x, x]), jnp.ones((2, 5), bool), cache)
  with pytest.raises(ValueError, match="valid"):
    layer.extend(x[:, :1], jnp.ones((1, 1), jnp.int32), cache)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_cache_write_moves_16_bit_floats_as_bits(dtype):
  """model.layers.scatter_set (the DSA cache write): the bits of `buf.at[...].set(..., mode="drop")`
  (out-of-range slots dropped), and for 16-bit floats no f32 copy of the buffer in the compiled
  program (XLA:CPU computes a bf16 scatter in f32, converting the whole cache there and back)."""
  rng = np.random.default_rng(3)
  buf = jnp.asarray(rng.standard_normal((5, 37, 11)), dtype)
  new = jnp.asarray(rng.standard_normal((5, 3, 11)), jnp.float32)  # cast to buf's dtype on the way
  rows = jnp.arange(5)[:, None]
  slot = jnp.asarray(rng.integers(0, 37, (5, 3)), jnp.int32).at[1, 2].set(37).at[4, 0].set(40)  # dropped

  def plain(b, n, s):
    return b.at[rows, s].set(n.astype(b.dtype), mode="drop")

  def ours(b, n, s):
    return scatter_set(b, (rows, s), n, mode="drop")
  want, got = jax.jit(plain)(buf, new, slot), jax.jit(ours)(buf, new, slot)
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  assert not np.array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(buf.astype(jnp.float32)))
  hlo = jax.jit(ours).lower(buf, new, slot).compile().as_text()
  assert ("f32[5,37,11]" in hlo) == (dtype == jnp.float32), "a 16-bit cache was written through f32"
