"""Native image input: a ViT encoder and a projector into the language model.

The encoder follows ViT (Dosovitskiy et al., 2021, "An Image is Worth 16x16
Words"): non-overlapping patches are linearly embedded, a learned position
embedding is added, and pre-norm transformer blocks with bidirectional
attention run over the patches of each image. A two-layer MLP projector maps
each patch embedding to d_model (as in LLaVA), and the decoder substitutes those
vectors for the image placeholder tokens of the text, in order.

Einsum legend: n images, p patches, d encoder width, h heads, k head dim,
f MLP width, m model (language) dim, b batch rows, t tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import einsum, einsum_f32, param, rms_norm


class VisionBlock(nnx.Module):
  """Pre-norm transformer block with bidirectional multi-head attention."""

  def __init__(self, width: int, heads: int, mlp_dim: int, eps: float, *, rngs: nnx.Rngs,
               param_dtype, dtype):
    self.dtype, self.eps, self.heads = dtype, eps, heads
    k = width // heads
    self.norm1 = param(rngs, (width,), ("vit_embed",), param_dtype, init="ones")
    self.w_qkv = param(rngs, (width, 3, heads, k), ("vit_embed", None, "vit_heads", "head_dim"),
                       param_dtype, fan_in=width)
    self.w_o = param(rngs, (heads, k, width), ("vit_heads", "head_dim", "vit_embed"), param_dtype,
                     fan_in=width)
    self.norm2 = param(rngs, (width,), ("vit_embed",), param_dtype, init="ones")
    self.w_in = param(rngs, (width, mlp_dim), ("vit_embed", "vit_mlp"), param_dtype)
    self.b_in = param(rngs, (mlp_dim,), ("vit_mlp",), param_dtype, init="zeros")
    self.w_out = param(rngs, (mlp_dim, width), ("vit_mlp", "vit_embed"), param_dtype)
    self.b_out = param(rngs, (width,), ("vit_embed",), param_dtype, init="zeros")

  def __call__(self, x_npd: jax.Array) -> jax.Array:
    h = rms_norm(x_npd, self.norm1[...], self.eps)
    qkv = einsum("npd,dzhk->npzhk", h, self.w_qkv[...], self.dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = einsum_f32("nphk,nqhk->nhpq", q, k)
    probs = jax.nn.softmax(logits * q.shape[-1] ** -0.5, axis=-1)
    att = einsum("nhpq,nqhk->nphk", probs, v, self.dtype)
    x_npd = x_npd + einsum("nphk,hkd->npd", att, self.w_o[...], self.dtype)
    h = rms_norm(x_npd, self.norm2[...], self.eps)
    h = jax.nn.gelu(einsum("npd,df->npf", h, self.w_in[...], self.dtype) + self.b_in[...])
    return x_npd + einsum("npf,fd->npd", h, self.w_out[...], self.dtype) + self.b_out[...]


class VisionEncoder(nnx.Module):
  """ViT over images [n, H, W, C] -> projected patch embeddings [n, p, d_model]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v = cfg.vision
    self.cfg = v
    self.eps, self.dtype = cfg.norm_eps, cfg.jnp_dtype
    pdt = cfg.jnp_param_dtype
    patch_dim = v.patch_size * v.patch_size * v.num_channels
    self.w_patch = param(rngs, (patch_dim, v.width), (None, "vit_embed"), pdt)
    self.b_patch = param(rngs, (v.width,), ("vit_embed",), pdt, init="zeros")
    self.pos = param(rngs, (v.num_patches, v.width), (None, "vit_embed"), pdt, init="normal", scale=0.02)
    self.blocks = nnx.List([
        VisionBlock(v.width, v.num_heads, v.mlp_dim, cfg.norm_eps, rngs=rngs, param_dtype=pdt,
                    dtype=self.dtype) for _ in range(v.depth)])
    self.norm = param(rngs, (v.width,), ("vit_embed",), pdt, init="ones")
    self.w_proj1 = param(rngs, (v.width, cfg.d_model), ("vit_embed", "embed"), pdt)
    self.w_proj2 = param(rngs, (cfg.d_model, cfg.d_model), ("embed", "embed_out"), pdt)

  def patchify(self, images: jax.Array) -> jax.Array:
    """[n, H, W, C] -> [n, p, patch*patch*C] (row-major patches)."""
    v = self.cfg
    n, hh, ww, c = images.shape
    if (hh, ww, c) != (v.image_size, v.image_size, v.num_channels):
      raise ValueError(f"images: expected [n, {v.image_size}, {v.image_size}, {v.num_channels}] "
                       f"(config.model.vision), got {images.shape}; resize the images first.")
    g, ps = v.image_size // v.patch_size, v.patch_size
    x = images.reshape(n, g, ps, g, ps, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(n, g * g, ps * ps * c)

  def __call__(self, images: jax.Array) -> jax.Array:
    x = einsum("npc,cd->npd", self.patchify(images), self.w_patch[...], self.dtype)
    x = x + self.b_patch[...].astype(self.dtype) + self.pos[...].astype(self.dtype)
    for block in self.blocks:
      x = block(x)
    x = rms_norm(x, self.norm[...], self.eps)
    x = jax.nn.gelu(einsum("npd,dm->npm", x, self.w_proj1[...], self.dtype))
    return einsum("npm,mo->npo", x, self.w_proj2[...], self.dtype)


def merge_image_embeddings(tok_emb_btd: jax.Array, tokens_bt: jax.Array, img_emb_bpd: jax.Array,
                           image_token_id: int) -> jax.Array:
  """Replaces the image placeholder tokens of each row with that row's patches.

  The j-th placeholder of row b takes img_emb_bpd[b, j]. Rows with more
  placeholders than patches are a caller error (checked by the decoder when
  inputs are concrete); extra patches (padding images) are ignored.
  """
  is_img = tokens_bt == image_token_id
  slot = jnp.clip(jnp.cumsum(is_img, axis=1) - 1, 0, img_emb_bpd.shape[1] - 1)
  gathered = jnp.take_along_axis(img_emb_bpd, slot[..., None], axis=1)
  return jnp.where(is_img[..., None], gathered.astype(tok_emb_btd.dtype), tok_emb_btd)
