"""The assembled decoder: forward, packing, images, remat, and decode state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.decoder import build_model
from tests.helpers import assert_close, model_like, text_tokens


@pytest.fixture(scope="module")
def model(tiny_cfg):
  return build_model(tiny_cfg, seed=1)


# Jitted entry points: eager calls would compile every op separately.
@nnx.jit
def fwd(m, tok, pos=None, seg=None, images=None):
  return m(tok, pos, seg, images)


@nnx.jit
def prefill(m, tok, lengths, cache):
  return m.prefill(tok, lengths, cache)


@nnx.jit
def decode_step(m, tok, cache):
  return m.decode_step(tok, cache)


def _ce(logits, tok):
  return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tok[..., None], -1)[..., 0])




def test_forward_shapes_and_aux(model, tiny_cfg):
  tok = text_tokens(tiny_cfg, (2, 29))
  logits, aux = fwd(model, tok)
  assert logits.shape == (2, 29, tiny_cfg.vocab_size) and logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))
  n_moe = tiny_cfg.ffn_kinds.count("moe")
  assert aux["load"].shape == (n_moe, tiny_cfg.num_experts)
  np.testing.assert_allclose(aux["load"].sum(-1), 2 * 29 * tiny_cfg.experts_per_token)
  for k in ("indexer_loss", "z_loss", "seq_aux_loss"):
    assert aux[k].shape == () and np.isfinite(aux[k]) and float(aux[k]) > 0, k


def test_packed_segments_do_not_interact(model, tiny_cfg):
  a, b = text_tokens(tiny_cfg, (1, 19), 1), text_tokens(tiny_cfg, (1, 23), 2)
  packed = jnp.concatenate([a, b], 1)
  seg = jnp.concatenate([jnp.full((1, 19), 1), jnp.full((1, 23), 2)], 1).astype(jnp.int32)
  pos = jnp.concatenate([jnp.arange(19), jnp.arange(23)])[None].astype(jnp.int32)
  lp, _ = fwd(model, packed, pos, seg)
  la, _ = fwd(model, a)
  lb, _ = fwd(model, b)
  assert_close(lp[:, :19], la, what="segment A")
  assert_close(lp[:, 19:], lb, what="segment B")


def test_padding_leaves_logits_and_indexer_loss_alone(model, tiny_cfg):
  """Trailing padding (segment id 0) changes no real token's logits and adds nothing to the DSA
  indexer KL, which stays a mean over every position (the real rows' sum / all rows)."""
  tok = text_tokens(tiny_cfg, (1, 21), 5)
  padded = jnp.concatenate([tok, text_tokens(tiny_cfg, (1, 11), 6)], 1)
  seg = (jnp.arange(32) < 21).astype(jnp.int32)[None]
  pos = jnp.where(seg > 0, jnp.arange(32), 0).astype(jnp.int32)
  lp, aux_p = fwd(model, padded, pos, seg)
  lt, aux_t = fwd(model, tok)
  assert_close(lp[:, :21], lt, what="real tokens' logits")
  assert_close(aux_p["indexer_loss"], aux_t["indexer_loss"] * 21 / 32, what="indexer_loss")


def test_prefill_then_decode_equals_full_forward(model, tiny_cfg):
  """Rows with different prompt lengths; logits equal the full forward's (f32, 1e-4)."""
  total, lengths = 30, np.array([7, 18])
  seq = text_tokens(tiny_cfg, (2, total), 3)
  cache = model.init_cache(2, 40)
  plog, cache = prefill(model, seq[:, :18], jnp.asarray(lengths, jnp.int32), cache)
  dec = {r: [plog[r, : lengths[r]]] for r in range(2)}
  pos = lengths.copy()
  for _ in range(total - 18):
    lg, cache = decode_step(model, seq[np.arange(2), pos], cache)
    for r in range(2):
      dec[r].append(lg[r][None])
    pos += 1
  for r in range(2):
    got = jnp.concatenate(dec[r], 0)
    full, _ = fwd(model, seq[r: r + 1, : pos[r]])
    assert_close(got, full[0], rtol=1e-4, what=f"row {r}")


def test_chunked_prefill_equals_one_prefill(model, tiny_cfg):
  seq = text_tokens(tiny_cfg, (2, 27), 4)
  n = jnp.asarray([27, 27], jnp.int32)
  one, _ = prefill(model, seq, n, model.init_cache(2, 32))
  c = model.init_cache(2, 32)
  first, c = prefill(model, seq[:, :13], jnp.asarray([13, 13], jnp.int32), c)
  second, c = prefill(model, seq[:, 13:], jnp.asarray([14, 14], jnp.int32), c)
  assert_close(jnp.concatenate([first, second], 1), one, rtol=1e-4, what="chunked prefill")


def _image_inputs(cfg, seed):
  rng = np.random.default_rng(seed)
  p = cfg.vision.num_patches
  tok = np.array(text_tokens(cfg, (2, 2 * p + 9), seed))
  tok[0, 3: 3 + p] = cfg.image_token_id          # row 0: one image
  tok[1, 2: 2 + 2 * p] = cfg.image_token_id      # row 1: two images
  v = cfg.vision
  img = rng.normal(size=(2, 2, v.image_size, v.image_size, v.num_channels)).astype(np.float32)
  return jnp.asarray(tok), jnp.asarray(img)


def test_images_replace_placeholders_without_leakage(model, tiny_cfg):
  tok, img = _image_inputs(tiny_cfg, 5)
  logits, _ = fwd(model, tok, images=img)
  assert logits.shape == (2, tok.shape[1], tiny_cfg.vocab_size)
  # Changing row 1's images leaves row 0 alone; row 0's second image is unused.
  img2 = img.at[1].set(-img[1]).at[0, 1].set(img[0, 1] * 3)
  logits2, _ = fwd(model, tok, images=img2)
  assert_close(logits2[0], logits[0], what="row 0 unaffected")
  assert float(jnp.max(jnp.abs(logits2[1] - logits[1]))) > 1e-3
  # Text-only tokens before the first placeholder are unaffected by images.
  text_only, _ = fwd(model, tok)
  assert_close(logits[1, :2], text_only[1, :2], what="causal before image")


def test_chunked_prefill_with_image_embeds_equals_forward(model, tiny_cfg):
  """Chunks cut through images; each chunk gets its own placeholders' patches."""
  tok, img = _image_inputs(tiny_cfg, 7)
  full, _ = fwd(model, tok, images=img)
  p = tiny_cfg.vision.num_patches
  emb = np.asarray(nnx.jit(lambda m, x: m.encode_images(x))(
      model, img.reshape((-1,) + img.shape[2:]))).reshape(2, 2 * p, -1)
  t, cut = tok.shape[1], 3 + p // 2          # row 0's image is split across chunks
  cache = model.init_cache(2, t)
  outs = []
  for lo, hi in ((0, cut), (cut, t)):
    chunk = np.asarray(tok[:, lo:hi])
    before = np.sum(np.asarray(tok[:, :lo]) == tiny_cfg.image_token_id, axis=1)
    rows = np.zeros((2, hi - lo, emb.shape[-1]), np.float32)
    for r in range(2):
      n = int(np.sum(chunk[r] == tiny_cfg.image_token_id))
      rows[r, :n] = emb[r, before[r]: before[r] + n]
    lg, cache = nnx.jit(lambda m, x, n, c, e: m.prefill(x, n, c, image_embeds=e))(
        model, jnp.asarray(chunk), jnp.full((2,), hi - lo, jnp.int32), cache, jnp.asarray(rows))
    outs.append(lg)
  assert_close(jnp.concatenate(outs, 1), full, rtol=1e-4, what="chunked prefill with images")


def test_reset_cache_rows_empties_only_those_rows(model, tiny_cfg):
  from model.decoder import reset_cache_rows
  seq = text_tokens(tiny_cfg, (2, 9), 8)
  _, cache = prefill(model, seq, jnp.asarray([9, 9], jnp.int32), model.init_cache(2, 16))
  reset = reset_cache_rows(cache, jnp.asarray([False, True]))
  fresh = model.init_cache(2, 16)
  for a, r, f in zip(jax.tree.leaves(cache), jax.tree.leaves(reset), jax.tree.leaves(fresh),
                     strict=True):
    np.testing.assert_array_equal(np.asarray(r[1]), np.asarray(f[1]))
    np.testing.assert_array_equal(np.asarray(r[0]), np.asarray(a[0]))
  assert any(float(jnp.max(jnp.abs(a[0].astype(jnp.float32)))) > 0 for a in jax.tree.leaves(cache))


def test_gradient_flows_into_vision_encoder(model, tiny_cfg):
  tok, img = _image_inputs(tiny_cfg, 6)

  @nnx.jit
  def grad(m):
    return nnx.grad(lambda m: _ce(m(tok, images=img)[0], tok))(m)

  grads = grad(model)
  vis = jax.tree.leaves(nnx.state(grads, nnx.Param)["vision"])
  assert vis and all(np.all(np.isfinite(g)) for g in vis)
  assert sum(float(jnp.sum(jnp.abs(g))) for g in vis) > 0


def test_too_many_placeholders_is_a_clear_error(model, tiny_cfg):
  tok, img = _image_inputs(tiny_cfg, 7)
  with pytest.raises(ValueError, match="image placeholder tokens"):
    model(tok, images=img[:, :1])  # eager: the check needs concrete tokens
  # Part of an image (fewer placeholders than its patches) took the next image's first patches.
  partial = np.asarray(tok).copy()
  partial[0, np.flatnonzero(partial[0] == tiny_cfg.image_token_id)[-1]] = 5
  with pytest.raises(ValueError, match=f"each image takes exactly {tiny_cfg.vision.num_patches}"):
    model(jnp.asarray(partial), images=img)


def test_remat_matches_no_remat(tiny_cfg, model):
  tok = text_tokens(tiny_cfg, (2, 21), 8)

  @nnx.jit
  def loss_and_grad(m):
    def loss(m):
      lg, aux = m(tok)
      return _ce(lg, tok) + aux["indexer_loss"]

    return nnx.value_and_grad(loss)(m)

  l0, g0 = loss_and_grad(model)
  l1, g1 = loss_and_grad(model_like(model, tiny_cfg.replace(remat="full")))
  assert_close(l1, l0, what="loss")
  leaves = lambda g: jax.tree.leaves(nnx.state(g, nnx.Param))
  for a, b in zip(leaves(g1), leaves(g0), strict=True):
    assert_close(a, b, what="grad")


def test_bf16_compute_close_to_f32(tiny_cfg, model):
  """bf16 compute (f32 params) gives f32 logits and the f32 model's loss.

  Logits are compared through the loss: discrete choices (indexer top-k, expert
  routing) may flip on near-ties under bf16 rounding, which moves individual
  logits by more than bf16 precision without being a bug.
  """
  tok = text_tokens(tiny_cfg, (2, 17), 9)
  ref, _ = fwd(model, tok)
  got, _ = fwd(model_like(model, tiny_cfg.replace(dtype="bfloat16")), tok)
  assert got.dtype == jnp.float32 and np.all(np.isfinite(got))
  assert_close(_ce(got, tok), _ce(ref, tok), dtype="bfloat16", what="bf16 loss")


def test_bad_token_shapes(model):
  with pytest.raises(ValueError, match="tokens"):
    fwd(model, jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="segment_ids"):
    fwd(model, jnp.zeros((2, 5), jnp.int32), None, jnp.ones((2, 4), jnp.int32))


def test_bad_ids_dtypes_and_replay_arguments_are_named(model, tiny_cfg):
  """Called eagerly, ids outside [0, vocab) are refused before the embedding gather clamps them (in
  prefill only each row's real tokens count); float positions / segment ids / routing and a
  routing_mask without routing are refused under jit too."""
  v, n_moe, k = tiny_cfg.vocab_size, tiny_cfg.ffn_kinds.count("moe"), tiny_cfg.experts_per_token
  ok = jnp.asarray([[0, v - 1, 3]], jnp.int32)
  for bad, shown in (([[0, v, 3]], v), ([[2, -1, 5]], -1)):
    with pytest.raises(ValueError, match=rf"tokens: ids must lie in \[0, vocab_size={v}\); got {shown}\."):
      model(jnp.asarray(bad, jnp.int32))
  with pytest.raises(ValueError, match=rf"got {v}\."):
    model.prefill(jnp.asarray([[1, 2, 0], [4, v, -1]], jnp.int32), jnp.asarray([3, 2]), None)
  model._check_tokens(ok)
  model._check_tokens(jnp.asarray([[1, 2, -1], [v - 1, 2 * v, 7]], jnp.int32), jnp.asarray([2, 1]))  # padding
  with pytest.raises(ValueError, match="lengths: expected shape"):
    model.prefill(ok, jnp.asarray([3, 3]), None)
  f32 = jnp.zeros((1, 3), jnp.float32)
  for pos, seg, name in ((f32, None, "positions"), (None, f32, "segment_ids")):
    with pytest.raises(ValueError, match=rf"{name}: expected int \(1, 3\) like tokens, got float32\[1, 3\]"):
      fwd(model, ok, pos, seg)
  with pytest.raises(ValueError, match="routing_mask was given without routing"):
    model(ok, routing_mask=jnp.ones((1, 3), bool))
  with pytest.raises(ValueError, match=r"routing: expected int ids .* got float32"):
    model(ok, routing=jnp.zeros((1, 3, n_moe, k), jnp.float32), routing_mask=jnp.ones((1, 3), bool))


@pytest.mark.slow
def test_small_prefill_decode_matches_forward_beyond_topk():
  """`small` (f32) past its DSA top-k of 256: chunked prefill + decode == forward."""
  from configs import horizon
  from model.config import ModelConfig
  cfg = ModelConfig.from_config(horizon.get_config("small").model).replace(dtype="float32")
  m = build_model(cfg, seed=2)
  seq = text_tokens(cfg, (1, 300), 11)
  full, _ = fwd(m, seq)
  c = m.init_cache(1, 320)
  a, c = prefill(m, seq[:, :150], jnp.asarray([150], jnp.int32), c)
  b, c = prefill(m, seq[:, 150:290], jnp.asarray([140], jnp.int32), c)
  steps = []
  for i in range(290, 300):
    lg, c = decode_step(m, seq[:, i], c)
    steps.append(lg[:, None])
  got = jnp.concatenate([a, b] + steps, 1)
  assert_close(got, full, rtol=1e-4, what="small prefill+decode")
