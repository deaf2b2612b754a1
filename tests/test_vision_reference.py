"""model/vision.py against plain references: the ViT forward in float64 numpy, and the gradient of the
language-model loss into the encoder's parameters (through the projector and the placeholder merge)
against the chain rule over a separately written jnp encoder."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.decoder import build_model
from tests.helpers import text_tokens


@pytest.fixture(scope="module")
def model(tiny_cfg):
  return build_model(tiny_cfg, seed=3)


def _params(vision):
  """The encoder's parameters as {name: array} (blocks as a list of dicts)."""
  get = lambda m, n: np.asarray(getattr(m, n)[...], np.float64)  # noqa: E731
  names = ("norm1", "w_qkv", "w_o", "norm2", "w_in", "b_in", "w_out", "b_out")
  top = {n: get(vision, n) for n in ("w_patch", "b_patch", "pos", "norm", "w_proj1", "w_proj2")}
  top["blocks"] = [{n: get(b, n) for n in names} for b in vision.blocks]
  return top


def _gelu(x, xp):
  return 0.5 * x * (1 + xp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))  # jax.nn.gelu's default


def _reference(p, images, ps, eps, xp=np):
  """ViT + two-layer projector written out per image and per head (xp: numpy or jax.numpy)."""
  def norm(x, s):
    return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps) * s

  out = []
  for img in images:
    hh, ww, c = img.shape
    patches = [img[i:i + ps, j:j + ps].reshape(-1) for i in range(0, hh, ps) for j in range(0, ww, ps)]
    x = xp.stack(patches) @ p["w_patch"] + p["b_patch"] + p["pos"]
    for b in p["blocks"]:
      h = norm(x, b["norm1"])
      heads = []
      for k in range(b["w_qkv"].shape[2]):
        q, kk, v = (h @ b["w_qkv"][:, z, k] for z in range(3))
        logits = q @ kk.T / np.sqrt(q.shape[-1])
        w = xp.exp(logits - logits.max(axis=-1, keepdims=True))
        heads.append((w / w.sum(axis=-1, keepdims=True)) @ v @ b["w_o"][k])
      x = x + sum(heads)
      h = _gelu(norm(x, b["norm2"]) @ b["w_in"] + b["b_in"], xp)
      x = x + h @ b["w_out"] + b["b_out"]
    out.append(_gelu(norm(x, p["norm"]) @ p["w_proj1"], xp) @ p["w_proj2"])
  return xp.stack(out)


def _images(cfg, n, seed):
  v = cfg.vision
  return np.random.default_rng(seed).uniform(size=(n, v.image_size, v.image_size, v.num_channels)
                                             ).astype(np.float32)


def test_encoder_forward_matches_numpy_reference(model, tiny_cfg):
  assert tiny_cfg.jnp_dtype == jnp.float32
  imgs = _images(tiny_cfg, 3, 0)
  got = np.asarray(nnx.jit(lambda m, x: m.encode_images(x))(model, jnp.asarray(imgs)))
  want = _reference(_params(model.vision), imgs.astype(np.float64), tiny_cfg.vision.patch_size,
                    tiny_cfg.norm_eps)
  assert got.shape == (3, tiny_cfg.vision.num_patches, tiny_cfg.d_model)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())


@pytest.mark.slow  # two whole-model gradient programs: ~25 s on 2 busy cores
def test_lm_loss_gradient_into_encoder_matches_chain_rule_over_reference(model, tiny_cfg):
  cfg, p = tiny_cfg, tiny_cfg.vision.num_patches
  tok = np.array(text_tokens(cfg, (2, 2 * p + 9), 11))
  tok[0, 3:3 + p] = cfg.image_token_id  # row 0: one image (its second one is padding)
  tok[1, 2:2 + 2 * p] = cfg.image_token_id  # row 1: two images back to back
  imgs = _images(cfg, 4, 1).reshape((2, 2) + _images(cfg, 1, 0).shape[1:])
  tok, imgs = jnp.asarray(tok), jnp.asarray(imgs)
  mask = jnp.ones(tok.shape, jnp.float32).at[:, -1].set(0.0)

  def ce(logits):  # next-token loss, as the train step
    lg = logits[:, :-1]
    nll = jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tok[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * mask[:, :-1]) / jnp.sum(mask[:, :-1])

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def grad_model(params):
    return jax.grad(lambda q: ce(nnx.merge(graphdef, q, rest)(tok, images=imgs)[0]))(params)

  @jax.jit
  def grad_embeddings(emb):  # d loss / d patches, with the encoder replaced by these patches
    def loss(e):
      m = nnx.merge(graphdef, params, rest)
      with mock.patch.object(m, "vision", lambda x: e):
        return ce(m(tok, images=imgs)[0])
    return jax.grad(loss)(emb)

  flat = imgs.reshape((4,) + imgs.shape[2:])
  ref_p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _params(model.vision))
  ref = lambda q: _reference(q, flat, cfg.vision.patch_size, cfg.norm_eps, jnp)  # noqa: E731
  emb, vjp = jax.vjp(jax.jit(ref), ref_p)
  g_emb = grad_embeddings(emb)
  # Row 0's second image fills no placeholder: no gradient may reach it.
  assert float(jnp.max(jnp.abs(g_emb[1]))) == 0.0
  assert all(float(jnp.max(jnp.abs(g_emb[k]))) > 0 for k in (0, 2, 3))
  (want,) = vjp(g_emb)
  got = grad_model(params)["vision"]
  for path, w in jax.tree_util.tree_leaves_with_path(want):
    g = got
    for key in path:
      g = g[getattr(key, "key", getattr(key, "idx", None))]
    g = np.asarray(g.get_value() if isinstance(g, nnx.Variable) else g)
    scale = float(jnp.max(jnp.abs(w)))
    assert scale > 0, path
    np.testing.assert_allclose(g, np.asarray(w), rtol=1e-3, atol=1e-3 * scale, err_msg=str(path))
