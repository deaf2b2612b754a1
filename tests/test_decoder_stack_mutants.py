"""model/decoder.py's plumbing, found unpinned by a mutation audit: the full-model tests compile for
minutes, so which block gets which cache, the prefill mask from `lengths`, decode_step's one-token
call, routing replay's MoE-layer numbering, the DSA block's padding segment and indexer-loss rescale,
the logits' final norm and `_collect_aux`'s means were pinned only through those. Here the blocks,
attention and FFN are affine stubs whose order matters (as in tests/test_scan_mutants.py), run
eagerly through the real Horizon / Block methods; the written-out chain is the reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import horizon
from model.config import ModelConfig
from model.decoder import Block, Horizon, _collect_aux, abstract_model, reset_cache_rows
from model.layers import RMSNorm

D, V = 2, 7
A, B = [2.0, -1.0, 0.5], [1.0, 3.0, -2.0]
SEEN = {}  # block index -> what its last call saw


@pytest.fixture(scope="module")
def cfg():
  base = ModelConfig.from_config(horizon.get_config("tiny").model)
  return base.replace(d_model=D, vocab_size=V, num_layers=3, dsa_period=2, num_dense_layers=1,
                      image_token_id=6)


class _Blk(nnx.Module):
  """Block stub: x -> a*x + b; extend adds the number of valid tokens to its cache and routes
  every token to [10*a, 10*a + 1] when MoE; __call__ records what it saw."""

  def __init__(self, i, ffn_kind):
    self.i, self.a, self.b, self.ffn_kind = i, A[i], B[i], ffn_kind

  def __call__(self, x, positions, segment_ids, replay):
    SEEN[self.i] = (positions, segment_ids, replay)
    aux = {"indexer_loss": jnp.float32(self.a)} if self.ffn_kind == "dense" else {
        "load": jnp.full((2,), self.a), "dropped": jnp.int32(0), "z_loss": jnp.float32(self.b),
        "seq_aux_loss": jnp.float32(2 * self.b), "routed": jnp.zeros((1,), jnp.int32)}
    return self.a * x + self.b, aux

  def extend(self, x, valid, cache):
    SEEN[self.i] = valid
    routed = None
    if self.ffn_kind == "moe":
      routed = jnp.broadcast_to(jnp.asarray([10 * self.a, 10 * self.a + 1], jnp.int32), x.shape[:2] + (2,))
    return self.a * x + self.b, cache + jnp.sum(valid, axis=1), routed


class _Micro(Horizon):
  """Horizon's methods on stub blocks: embed row i = [i, -i], final-norm scale [1, 2], head [[1, 0, ...],
  [0, 1, 0, ...]] (logit 0 = norm(x)_0, logit 1 = 2 * norm(x)_1, the rest 0)."""

  def __init__(self, cfg, blocks):
    self.cfg = cfg
    self.embed = nnx.Param(jnp.stack([jnp.arange(V), -jnp.arange(V)], 1).astype(jnp.float32))
    self.blocks = nnx.List(blocks)
    self.final_norm = RMSNorm(D, 0.0, rngs=None)
    self.final_norm.scale[...] = jnp.asarray([1.0, 2.0])
    self.head = nnx.Param(jnp.eye(D, V, dtype=jnp.float32))
    self.vision = None


def _micro(cfg):
  SEEN.clear()
  return _Micro(cfg, [_Blk(i, k) for i, k in enumerate(("dense", "moe", "moe"))])


def _chain(tok):
  """The written-out stack on embedding [tok, -tok]: x -> A[i]*x + B[i] in layer order, then the logits."""
  x = np.stack([tok, -tok], -1).astype(np.float64)
  for a, b in zip(A, B, strict=True):
    x = a * x + b
  return _chain_logits(x)


@pytest.fixture(scope="module")
def tok():
  return jnp.asarray([[1, 2, 3], [4, 5, 0]], jnp.int32)


def test_prefill_threads_each_cache_the_prefix_mask_and_routing(cfg, tok):
  m = _micro(cfg)
  cache = [jnp.asarray([100.0 * i, 100.0 * i + 50]) for i in range(3)]
  logits, new, routed = m.prefill(tok, jnp.asarray([3, 1], jnp.int32), cache, return_routing=True)
  np.testing.assert_allclose(logits, _chain(np.asarray(tok)), rtol=1e-6, atol=1e-6)
  for i in range(3):  # layer i's own cache, plus its row's real-token count
    np.testing.assert_array_equal(new[i], [100.0 * i + 3, 100.0 * i + 51])
    np.testing.assert_array_equal(SEEN[i], [[True, True, True], [True, False, False]])
  assert routed.shape == (2, 3, 2, 2)  # [b, t, MoE layers (1 and 2, in order), k]
  np.testing.assert_array_equal(routed[1, 2], [[-10, -9], [5, 6]])
  logits2, new2 = m.prefill(tok, jnp.asarray([0, 2], jnp.int32), cache)
  np.testing.assert_array_equal(new2[2], [200.0, 252.0])
  np.testing.assert_array_equal(SEEN[0], [[False, False, False], [True, True, False]])


def test_decode_step_is_one_real_token_per_row(cfg):
  m = _micro(cfg)
  cache = [jnp.asarray([10.0 * i, 10.0 * i + 5]) for i in range(3)]
  logits, new = m.decode_step(jnp.asarray([3, 5], jnp.int32), cache)
  np.testing.assert_allclose(logits, _chain(np.asarray([3, 5])), rtol=1e-6, atol=1e-6)
  for i in range(3):
    np.testing.assert_array_equal(new[i], [10.0 * i + 1, 10.0 * i + 6])
    np.testing.assert_array_equal(SEEN[i], [[True], [True]])


def test_forward_defaults_replay_numbering_and_aux_means(cfg, tok):
  m = _micro(cfg)
  routing = jnp.arange(2 * 3 * 2 * 2, dtype=jnp.int32).reshape(2, 3, 2, 2)
  mask = jnp.asarray([[1, 0, 1], [0, 1, 1]], jnp.int32)
  logits, aux = m(tok, routing=routing, routing_mask=mask)
  np.testing.assert_allclose(logits, _chain(np.asarray(tok)), rtol=1e-6, atol=1e-6)
  pos, seg, replay = SEEN[0]
  np.testing.assert_array_equal(pos, [[0, 1, 2], [0, 1, 2]])
  np.testing.assert_array_equal(seg, [[1, 1, 1], [1, 1, 1]])
  assert replay is None  # the dense layer takes no replay; MoE layer j takes routing[:, :, j]
  for i, j in ((1, 0), (2, 1)):
    ids, use = SEEN[i][2]
    np.testing.assert_array_equal(ids, np.asarray(routing)[:, :, j])
    assert use.dtype == jnp.bool_
    np.testing.assert_array_equal(use, [[True, False, True], [False, True, True]])
  np.testing.assert_allclose(aux["indexer_loss"], 2.0)
  np.testing.assert_allclose(aux["z_loss"], (3.0 - 2.0) / 2)
  np.testing.assert_allclose(aux["seq_aux_loss"], (6.0 - 4.0) / 2)
  np.testing.assert_array_equal(aux["load"], [[-1.0, -1.0], [0.5, 0.5]])
  with pytest.raises(ValueError, match="routing_mask"):
    m(tok, routing=routing)
  with pytest.raises(ValueError, match="routing"):
    m(tok, routing=routing[:, :, :1], routing_mask=mask)
  with pytest.raises(ValueError, match="positions"):
    m(tok, positions=jnp.zeros((2, 2), jnp.int32))


def test_collect_aux_without_moe_and_reset_rows():
  out = _collect_aux([{"indexer_loss": jnp.float32(1.0)}, {}, {"indexer_loss": jnp.float32(4.0)}])
  assert float(out["indexer_loss"]) == 2.5 and float(out["z_loss"]) == float(out["seq_aux_loss"]) == 0.0
  assert "load" not in out
  assert float(_collect_aux([{}])["indexer_loss"]) == 0.0
  cache = [{"k": jnp.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), "n": jnp.asarray([7, 8, 9])}]
  got = reset_cache_rows(cache, jnp.asarray([False, True, False]))
  np.testing.assert_array_equal(got[0]["k"], [[1.0, 2.0], [0.0, 0.0], [5.0, 6.0]])
  np.testing.assert_array_equal(got[0]["n"], [7, 0, 9])


class _Attn(nnx.Module):
  """Attention stub: 3 * x, indexer loss 4; records the segment ids it was given."""

  def __call__(self, x, positions, segment_ids):
    SEEN["attn"] = segment_ids
    return 3 * x, {"indexer_loss": jnp.float32(4.0)}

  def extend(self, x, valid, cache):
    return 3 * x, cache + 1


class _Ffn(nnx.Module):
  """FFN stub: 0.5 * x; the MoE form also takes (replay, valid) and returns aux with `routed`."""

  def __init__(self, moe):
    self.moe = moe

  def __call__(self, x, replay=None, valid=None):
    if not self.moe:
      return 0.5 * x
    SEEN["ffn"] = (replay, valid)
    return 0.5 * x, {"z_loss": jnp.float32(1.0), "routed": jnp.full(x.shape[:2] + (1,), 9, jnp.int32)}


class _Blk2(Block):
  def __init__(self, kind, ffn_kind):
    self.kind, self.ffn_kind = kind, ffn_kind
    self.attn_norm, self.ffn_norm = RMSNorm(D, 0.0, rngs=None), RMSNorm(D, 0.0, rngs=None)
    self.attn_norm.scale[...] = jnp.asarray([1.0, 2.0])
    self.ffn_norm.scale[...] = jnp.asarray([-1.0, 1.0])
    self.attn, self.ffn = _Attn(), _Ffn(ffn_kind == "moe")


X = np.asarray([[[3.0, 4.0], [1.0, -1.0], [0.0, 2.0], [-2.0, 1.0]]])


def _block_ref(x):
  """x + 3*norm1(x), then y + 0.5*norm2(y): pre-norm residuals with scales [1, 2] and [-1, 1]."""
  def norm(v, scale):
    return v / np.sqrt(np.mean(v * v, -1, keepdims=True)) * np.asarray(scale)
  y = x + 3 * norm(x, [1.0, 2.0])
  return y + 0.5 * norm(y, [-1.0, 1.0])


@pytest.mark.parametrize("kind,ffn_kind", [("dsa", "moe"), ("delta", "dense")])
def test_block_residuals_padding_segment_and_indexer_rescale(kind, ffn_kind):
  SEEN.clear()
  seg = jnp.asarray([[1, 1, 2, 0]], jnp.int32)
  replay = (jnp.zeros((1, 4, 1), jnp.int32), jnp.ones((1, 4), bool))
  y, aux = _Blk2(kind, ffn_kind)(jnp.asarray(X, jnp.float32), jnp.zeros((1, 4), jnp.int32), seg, replay)
  np.testing.assert_allclose(y, _block_ref(X), rtol=1e-6, atol=1e-6)
  if kind == "dsa":  # padding is segment -1 for DSA; its indexer mean over 3 live rows -> over all 4
    np.testing.assert_array_equal(SEEN["attn"], [[1, 1, 2, -1]])
    np.testing.assert_allclose(aux["indexer_loss"], 4.0 * 3 / 4)
    assert SEEN["ffn"][0] is replay
    np.testing.assert_array_equal(SEEN["ffn"][1], [[True, True, True, False]])
    assert float(aux["z_loss"]) == 1.0
  else:
    np.testing.assert_array_equal(SEEN["attn"], [[1, 1, 2, 0]])
    np.testing.assert_allclose(aux["indexer_loss"], 4.0)
  h, cache, routed = _Blk2(kind, ffn_kind).extend(jnp.asarray(X, jnp.float32), None, jnp.int32(5))
  np.testing.assert_allclose(h, _block_ref(X), rtol=1e-6, atol=1e-6)
  assert int(cache) == 6
  if ffn_kind == "moe":
    np.testing.assert_array_equal(routed, np.full((1, 4, 1), 9))
  else:
    assert routed is None


def test_logits_run_in_the_compute_dtype_and_come_out_f32(cfg):
  x = jnp.asarray([[[0.3, 0.7], [1.1, -0.2]]], jnp.float32)
  got = _micro(cfg.replace(dtype="bfloat16")).logits(x)
  assert got.dtype == jnp.float32
  ref = _chain_logits(np.asarray(x, np.float64))
  np.testing.assert_array_equal(got, np.asarray(jnp.asarray(ref, jnp.bfloat16), np.float32))
  assert not np.array_equal(np.asarray(jnp.asarray(ref, jnp.float32)), np.asarray(got))
  np.testing.assert_allclose(_micro(cfg).logits(x), ref, rtol=1e-6)


def _chain_logits(x):
  n = x / np.sqrt(np.mean(x * x, -1, keepdims=True))
  out = np.zeros(x.shape[:-1] + (V,))
  out[..., 0], out[..., 1] = n[..., 0], 2 * n[..., 1]
  return out


def test_embed_inputs_places_each_rows_patches_in_order(cfg):
  assert _micro(cfg.replace(dtype="bfloat16")).embed_inputs(jnp.asarray([[1]])).dtype == jnp.bfloat16
  m = _micro(cfg)
  tok = jnp.asarray([[6, 1, 6], [2, 6, 3]], jnp.int32)  # 6: the image placeholder
  emb = jnp.asarray([[[10.0, 11.0], [12.0, 13.0]], [[20.0, 21.0], [22.0, 23.0]]])
  got = m.embed_inputs(tok, image_embeds=emb)
  np.testing.assert_array_equal(got, [[[10, 11], [1, -1], [12, 13]], [[2, -2], [20, 21], [3, -3]]])
  np.testing.assert_array_equal(m.embed_inputs(tok),
                                [[[6, -6], [1, -1], [6, -6]], [[2, -2], [6, -6], [3, -3]]])
  with pytest.raises(ValueError, match="not both"):
    m.embed_inputs(tok, images=jnp.zeros((2, 1, 4, 4, 3)), image_embeds=emb)
  with pytest.raises(ValueError, match="vision.enabled is False"):
    m.embed_inputs(tok, images=jnp.zeros((2, 1, 4, 4, 3)))


def test_image_embeds_too_few_patches_or_wrong_width_is_a_clear_error(cfg):
  """Row 0 has two placeholders but one patch: the merge would silently repeat the patch."""
  m = _micro(cfg)
  tok = jnp.asarray([[6, 1, 6], [2, 6, 3]], jnp.int32)
  with pytest.raises(ValueError, match="2 image placeholder tokens but only 1 image patches"):
    m.embed_inputs(tok, image_embeds=jnp.ones((2, 1, D)))
  with pytest.raises(ValueError, match="image_embeds: expected"):
    m.embed_inputs(tok, image_embeds=jnp.ones((2, 2, D + 1)))
  with pytest.raises(ValueError, match="image_embeds: expected"):
    m.embed_inputs(tok, image_embeds=jnp.ones((1, 2, D)))
  # Under jit the tokens are traced: nothing to check, and the call compiles.
  out = nnx.jit(lambda m, t, e: m.embed_inputs(t, image_embeds=e))(m, tok, jnp.ones((2, 1, D)))
  assert out.shape == (2, 3, D)


def test_input_checks(cfg, tok):
  m = _micro(cfg)
  with pytest.raises(ValueError, match="tokens"):
    m.prefill(tok.astype(jnp.float32), jnp.asarray([3, 3]), [None] * 3)
  with pytest.raises(ValueError, match="tokens: expected int"):
    m.prefill(tok[0], jnp.asarray([3]), [None] * 3)
  with pytest.raises(ValueError, match="lengths"):
    m.prefill(tok, jnp.asarray([3]), [None] * 3)
  with pytest.raises(ValueError, match="decode_step"):
    m.decode_step(tok, [None] * 3)
  with pytest.raises(ValueError, match="max_seq_len"):
    m.init_cache(1, cfg.max_seq_len + 1)


@pytest.mark.parametrize("changes,kinds,ffns", [
    ({}, ("dsa", "delta", "dsa", "delta"), ("dense", "moe", "moe", "moe")),
    ({"dsa_offset": 1, "num_dense_layers": 2, "dtype": "bfloat16"}, ("delta", "dsa", "delta", "dsa"),
     ("dense", "dense", "moe", "moe")),
])
def test_each_layer_gets_its_attention_and_ffn_kind(changes, kinds, ffns):
  from model.attention.delta import DeltaAttention
  from model.attention.dsa import GatedDSA
  from model.layers import MLP
  from model.moe import MoE
  cfg = ModelConfig.from_config(horizon.get_config("tiny").model).replace(**changes)
  m = abstract_model(cfg)
  attn = {"dsa": GatedDSA, "delta": DeltaAttention}
  for blk, kind, ffn in zip(m.blocks, kinds, ffns, strict=True):
    assert (blk.kind, blk.ffn_kind) == (kind, ffn)
    assert type(blk.attn) is attn[kind] and type(blk.ffn) is (MoE if ffn == "moe" else MLP)
  assert m.embed.shape == (cfg.vocab_size, cfg.d_model) and m.embed.axes == ("vocab", "embed")
  assert m.head.shape == (cfg.d_model, cfg.vocab_size) and m.head.axes == ("embed", "vocab")
  assert m.blocks[0].ffn.w_gate.shape == (cfg.d_model, cfg.dense_ffn_dim)
  assert m.blocks[0].ffn.dtype == cfg.jnp_dtype  # the dense FFN computes in bf16 with f32 weights
  if changes:
    return
  cache = m.init_cache(2, 12)
  assert cache[0].latent.shape == (2, 12, cfg.kv_lora_rank) and cache[0].latent.dtype == jnp.float32
  assert cache[1].state.shape[0] == 2
  assert m.init_cache(1)[2].k_rope.shape == (1, cfg.max_seq_len, cfg.qk_rope_dim)
  with pytest.raises(ValueError, match="max_len=0 must be > 0"):  # not silently the full max_seq_len
    m.init_cache(1, 0)


def test_embedding_is_unit_normal_and_the_head_fan_in():
  """Embedding rows N(0, 1) (`param` init="normal"), head N(0, 1/d_model), norms ones: a one-layer model."""
  import dataclasses

  from model.decoder import build_model
  base = ModelConfig.from_config(horizon.get_config("tiny").model)
  m = build_model(base.replace(num_layers=1, vision=dataclasses.replace(base.vision, enabled=False)))
  assert m.vision is None and len(m.blocks) == 1
  assert abs(float(jnp.std(m.embed[...])) - 1.0) < 0.05
  assert abs(float(jnp.std(m.head[...])) - base.d_model ** -0.5) < 0.05 * base.d_model ** -0.5
  np.testing.assert_array_equal(m.final_norm.scale[...], np.ones(base.d_model))
