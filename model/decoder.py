"""The Horizon decoder: embedding, a hybrid stack of pre-norm blocks, LM head.

Layer kinds come from data (`ModelConfig.layer_kinds` / `ffn_kinds`): each
block is Gated DSA (`model.attention.dsa`, DeepSeek-V3.2) or Delta attention
(`model.attention.delta`, Gated DeltaNet), followed by a dense SwiGLU FFN (the
first `num_dense_layers`) or a Mixture-of-Experts FFN (`model.moe`). Images
enter through `model.vision`: their projected patch embeddings replace the
image placeholder tokens.

Two ways to run it:
  * `__call__(tokens, positions, segment_ids, images)` — the whole (packed)
    sequence at once, for training; returns f32 logits and auxiliary outputs
    (indexer loss, router z-loss / sequence aux loss, per-layer expert load).
  * `init_cache` → `prefill(tokens, lengths, cache)` → `decode_step(tok, cache)`
    — generation with a decode state (DSA: latent, RoPE key and indexer key per
    position; Delta: recurrent + conv state). Prefill may be called repeatedly
    (chunked prefill continues from the cache). Prefill + decode equals the
    full forward.

Einsum legend: b batch, t tokens, d model dim, v vocab.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention.delta import DeltaAttention
from model.attention.dsa import GatedDSA
from model.config import ModelConfig
from model.layers import MLP, KeyGen, RMSNorm, einsum, maybe_remat, param
from model.moe import MoE
from model.scan import run_blocks
from model.vision import VisionEncoder, merge_image_embeddings
from sharding.rules import constrain

_ATTENTION = {"dsa": GatedDSA, "delta": DeltaAttention}
_ACT = ("batch", "length", "embed")  # logical names of the residual stream


class Block(nnx.Module):
  """x + attn(norm(x)), then x + ffn(norm(x))."""

  def __init__(self, cfg: ModelConfig, kind: str, ffn_kind: str, *, rngs: nnx.Rngs):
    self.kind, self.ffn_kind = kind, ffn_kind
    pdt = cfg.jnp_param_dtype
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=pdt)
    self.attn = _ATTENTION[kind](cfg, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=pdt)
    if ffn_kind == "moe":
      self.ffn = MoE(cfg, rngs=rngs)
    else:
      self.ffn = MLP(cfg.d_model, cfg.dense_ffn_dim, rngs=rngs, param_dtype=pdt, dtype=cfg.jnp_dtype)

  def _ffn(self, x, replay=None, valid=None):
    if self.ffn_kind == "moe":
      y, aux = self.ffn(self.ffn_norm(x), replay, valid)
      return x + y, aux
    return x + self.ffn(self.ffn_norm(x)), {}

  def __call__(self, x, positions, segment_ids, replay=None):
    """replay: optional MoE routing replay (ids [b, t, k], use [b, t]); see MoE.route.

    Padding (segment id 0) adds nothing to the auxiliary losses, which stay means over every
    position (so a gradient-accumulated batch's micro-batch means average to the whole batch's):
    the MoE leaves it out of load and balance statistics, and DSA sees it as segment -1 (attends
    to nothing, never attended), its indexer KL then being the real query rows' sum over all
    rows. Delta layers need no such id: padding trails its row and its state is dropped."""
    if self.kind == "dsa":
      h, attn_aux = self.attn(self.attn_norm(x), positions, jnp.where(segment_ids > 0, segment_ids, -1))
      # GatedDSA averages over its live query rows; rescale to a mean over every row.
      attn_aux = {**attn_aux, "indexer_loss": attn_aux["indexer_loss"] * jnp.mean(segment_ids > 0)}
    else:
      h, attn_aux = self.attn(self.attn_norm(x), positions, segment_ids)
    x, ffn_aux = self._ffn(x + h, replay, segment_ids > 0)
    return x, {**attn_aux, **ffn_aux}

  def extend(self, x, valid, cache):
    """Generation: (x, cache, the MoE layer's routed expert ids [b, t, k] or None)."""
    h, cache = self.attn.extend(self.attn_norm(x), valid, cache)
    x, aux = self._ffn(x + h)
    return x, cache, aux.get("routed")


def _block_forward(block: Block, x, positions, segment_ids, replay):
  return block(x, positions, segment_ids, replay)


class Horizon(nnx.Module):
  """The language model (plus optional vision encoder)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt = cfg.jnp_param_dtype
    rngs = KeyGen(rngs.params())
    self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdt, init="normal")
    self.blocks = nnx.List([Block(cfg, kind, ffn, rngs=rngs)
                            for kind, ffn in zip(cfg.layer_kinds, cfg.ffn_kinds, strict=True)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=pdt)
    self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)
    self.vision = VisionEncoder(cfg, rngs=rngs) if cfg.vision.enabled else None

  # ---- inputs ----------------------------------------------------------------
  def _check_tokens(self, tokens, lengths=None):
    """int [batch, seq]. Concrete ids (not under jit) must lie in [0, vocab_size), the embedding
    gather would otherwise clamp or fill them silently; with concrete `lengths` (prefill), only
    each row's first lengths[i] tokens are real and checked."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens: expected int [batch, seq], got {tokens.dtype}{list(tokens.shape)}.")
    if lengths is not None and lengths.shape != tokens.shape[:1]:
      raise ValueError(f"lengths: expected shape {tokens.shape[:1]}, got {lengths.shape}.")
    if isinstance(tokens, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
      return
    ids = np.asarray(tokens)
    if lengths is not None:
      ids = ids[np.arange(ids.shape[1])[None, :] < np.asarray(lengths).reshape(-1, 1)]
    bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
    if bad.size:
      raise ValueError(f"tokens: ids must lie in [0, vocab_size={self.cfg.vocab_size}); got {int(bad[0])}.")

  def _check_placeholders(self, tokens, n_patches: int, given: str) -> np.ndarray | None:
    """Each row's image placeholder count; ValueError where a row of concrete tokens has more than
    n_patches (the merge would repeat the last patch). None for traced tokens (under jit): unchecked."""
    if isinstance(tokens, jax.core.Tracer):
      return None
    counts = np.sum(np.asarray(tokens) == self.cfg.image_token_id, axis=1)
    n_ph = int(np.max(counts, initial=0))
    if n_ph > n_patches:
      raise ValueError(f"a row has {n_ph} image placeholder tokens but only {n_patches} image "
                       f"patches were given ({given}).")
    return counts

  def encode_images(self, images: jax.Array) -> jax.Array:
    """Vision encoder + projector: images [n, H, W, C] in [0, 1] -> [n, num_patches, d_model].

    Generation encodes a request's images once and hands the patches to
    chunked `prefill` calls through `image_embeds`.
    """
    if self.vision is None:
      raise ValueError("images were given but config.model.vision.enabled is False.")
    if images.ndim != 4:
      raise ValueError(f"encode_images: expected images [n, H, W, C], got {list(images.shape)}.")
    return self.vision(images)

  def embed_inputs(self, tokens: jax.Array, images: jax.Array | None = None,
                   image_embeds: jax.Array | None = None) -> jax.Array:
    """Token embeddings with image placeholders replaced by image patches.

    images: [b, m, H, W, C] — up to m images per row (pad with any image; the
    row's placeholders decide how many patches are used, in order).
    image_embeds: [b, n, d_model] — already encoded patches (`encode_images`);
    the j-th placeholder of a row takes row's patch j. Chunked prefill passes
    each chunk the patches of the placeholders inside that chunk.
    """
    x = jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.jnp_dtype)
    if image_embeds is not None:
      if images is not None:
        raise ValueError("pass images or image_embeds, not both.")
      if (image_embeds.ndim != 3 or image_embeds.shape[0] != tokens.shape[0]
          or image_embeds.shape[2] != self.cfg.d_model):
        raise ValueError(f"image_embeds: expected [batch={tokens.shape[0]}, patches, "
                         f"d_model={self.cfg.d_model}], got {list(image_embeds.shape)}.")
      self._check_placeholders(tokens, image_embeds.shape[1], "image_embeds")
      return merge_image_embeddings(x, tokens, image_embeds, self.cfg.image_token_id)
    if images is None:
      return x
    if self.vision is None:
      raise ValueError("images were given but config.model.vision.enabled is False.")
    if images.ndim != 5 or images.shape[0] != tokens.shape[0]:
      raise ValueError(f"images: expected [batch={tokens.shape[0]}, images_per_row, H, W, C], "
                       f"got {list(images.shape)}.")
    b, m = images.shape[:2]
    n_patches = m * self.cfg.vision.num_patches
    per_image = self.cfg.vision.num_patches
    counts = self._check_placeholders(tokens, n_patches, f"{m} images x {per_image} patches")
    if counts is not None and np.any(counts % per_image):  # concrete tokens only
      raise ValueError(f"rows have {counts.tolist()} image placeholder tokens; each image takes "
                       f"exactly {per_image} (a part of an image would take "
                       "the first patches of the next image's slot).")
    emb = self.vision(images.reshape((b * m,) + images.shape[2:]))
    emb = emb.reshape(b, n_patches, emb.shape[2])
    return merge_image_embeddings(x, tokens, emb, self.cfg.image_token_id)

  def logits(self, x: jax.Array) -> jax.Array:
    return einsum("btd,dv->btv", self.final_norm(x), self.head[...], self.cfg.jnp_dtype).astype(
        jnp.float32)

  # ---- training forward -----------------------------------------------------
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, images: jax.Array | None = None,
               routing: jax.Array | None = None, routing_mask: jax.Array | None = None
               ) -> tuple[jax.Array, dict[str, Any]]:
    """tokens [b, t] -> (logits f32 [b, t, vocab], aux).

    positions: per-token positions (restart at 0 in each packed segment);
    default arange. segment_ids: packed-document ids; tokens attend and carry
    state only within their segment; default all one segment.
    aux: indexer_loss (mean over DSA layers), z_loss and seq_aux_loss (mean
    over MoE layers); padding, segment id 0, adds nothing to any of them, load
    [num_moe_layers, num_experts] token counts of the real tokens,
    dropped [num_moe_layers] assignments dropped by a capacity-limited
    expert-parallel exchange (0 on one device), routed int32 [num_moe_layers,
    b, t, k] the experts each token went to.

    routing [b, t, num_moe_layers, k] / routing_mask bool [b, t]: routing
    replay (R3, for RL): where the mask is set, each MoE layer sends the token
    to the recorded experts (e.g. the ones the inference engine chose) instead
    of its own top-k; the combine weights stay the router's (differentiable).
    Under an active mesh (`sharding.mesh.activate`) activations are
    constrained by logical names and MoE layers run expert-parallel.
    """
    self._check_tokens(tokens)
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    for name, a in (("positions", positions), ("segment_ids", segment_ids)):
      if a.shape != (b, t) or not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"{name}: expected int {(b, t)} like tokens, got {a.dtype}{list(a.shape)}.")
    n_moe = sum(kind == "moe" for kind in self.cfg.ffn_kinds)
    if routing is None and routing_mask is not None:
      raise ValueError("routing_mask was given without routing: pass the recorded expert ids as "
                       "routing too (replay), or neither.")
    if routing is not None:
      want = (b, t, n_moe, self.cfg.experts_per_token)
      if (routing.shape != want or not jnp.issubdtype(routing.dtype, jnp.integer) or routing_mask is None
          or routing_mask.shape != (b, t)):
        raise ValueError(f"routing: expected int ids {want} (batch, tokens, MoE layers, experts_per_token) "
                         f"and routing_mask [{b}, {t}]; got {routing.dtype}{list(routing.shape)} and "
                         f"{None if routing_mask is None else routing_mask.shape}.")
    x = constrain(self.embed_inputs(tokens, images), _ACT)
    fwd = maybe_remat(_block_forward, self.cfg.remat)
    replays, j = [], 0
    for block in self.blocks:
      replay = None
      if routing is not None and block.ffn_kind == "moe":
        replay, j = (routing[:, :, j], routing_mask.astype(bool)), j + 1
      replays.append(replay)
    x, auxes = run_blocks(self.blocks, self.cfg, x, positions, segment_ids, replays, fwd,
                          lambda y: constrain(y, _ACT))
    return constrain(self.logits(x), ("batch", "length", "vocab")), _collect_aux(auxes)

  # ---- generation -----------------------------------------------------------
  def init_cache(self, batch: int, max_len: int | None = None) -> list[Any]:
    """An empty decode state for `batch` rows and up to `max_len` tokens."""
    max_len = self.cfg.max_seq_len if max_len is None else max_len  # 0 is an error, not the default
    if max_len > self.cfg.max_seq_len:
      raise ValueError(f"max_len={max_len} exceeds config.model.max_seq_len={self.cfg.max_seq_len}.")
    return [blk.attn.init_cache(batch, max_len, self.cfg.jnp_dtype) for blk in self.blocks]

  def prefill(self, tokens: jax.Array, lengths: jax.Array, cache: list[Any],
              images: jax.Array | None = None, image_embeds: jax.Array | None = None,
              return_routing: bool = False) -> tuple[jax.Array, list[Any]]:
    """Appends right-padded prompts to the cache.

    tokens [b, t]; lengths [b]: how many of each row's tokens are real (the
    rest is padding and leaves the state untouched). Returns logits
    [b, t, vocab] (rows' padding positions are meaningless) and the new cache.
    Calling it again continues from the cache (chunked prefill); with images,
    pass each chunk `image_embeds` holding the patches of its own
    placeholders (see `embed_inputs`), since placeholders are numbered per call.
    With return_routing, also returns the routed expert ids int32 [b, t,
    num_moe_layers, k] (None for a model without MoE layers), as RL's routing
    replay records them.
    """
    self._check_tokens(tokens, lengths)
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    x = self.embed_inputs(tokens, images, image_embeds)
    new_cache, routed = [], []
    for block, c in zip(self.blocks, cache, strict=True):
      x, c, r = block.extend(x, valid, c)
      new_cache.append(c)
      if r is not None:
        routed.append(r)
    if return_routing:
      return self.logits(x), new_cache, (jnp.stack(routed, axis=2) if routed else None)
    return self.logits(x), new_cache

  def decode_step(self, tokens: jax.Array, cache: list[Any]) -> tuple[jax.Array, list[Any]]:
    """One token per row: tokens [b] -> (logits [b, vocab], cache)."""
    if tokens.ndim != 1:
      raise ValueError(f"decode_step: tokens must be [batch], got shape {tokens.shape}.")
    logits, cache = self.prefill(tokens[:, None], jnp.ones(tokens.shape, jnp.int32), cache)
    return logits[:, 0], cache


def reset_cache_rows(cache: list[Any], rows: jax.Array) -> list[Any]:
  """The cache with the rows where `rows` ([b] bool) is True emptied (as init_cache).

  Every decode state (DSA latents/keys/lengths, Delta state/conv) starts at
  zero, so a freed generation slot is reused by zeroing its row.
  """
  def reset(a):
    mask = rows.reshape((-1,) + (1,) * (a.ndim - 1))
    return jnp.where(mask, jnp.zeros((), a.dtype), a)
  return jax.tree.map(reset, cache)


def _collect_aux(auxes: list[dict[str, Any]]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  idx = [a["indexer_loss"] for a in auxes if "indexer_loss" in a]
  moe = [a for a in auxes if "load" in a]
  out["indexer_loss"] = jnp.mean(jnp.stack(idx)) if idx else jnp.zeros((), jnp.float32)
  if moe:
    out["load"] = jnp.stack([a["load"] for a in moe])
    out["dropped"] = jnp.stack([a["dropped"] for a in moe])
    out["z_loss"] = jnp.mean(jnp.stack([a["z_loss"] for a in moe]))
    out["seq_aux_loss"] = jnp.mean(jnp.stack([a["seq_aux_loss"] for a in moe]))
    out["routed"] = jnp.stack([a["routed"] for a in moe])
  else:
    out["z_loss"] = out["seq_aux_loss"] = jnp.zeros((), jnp.float32)
  return out


def build_model(cfg: ModelConfig, seed: int = 0) -> Horizon:
  """A randomly initialised model; with cfg.quantization the selected weights are MXFP4."""
  model = Horizon(cfg, rngs=nnx.Rngs(seed))
  if cfg.quantization != "none":
    from model.quant import quantize_model  # noqa: PLC0415 - pulls in pallas_kernels
    quantize_model(model, cfg.quantization)
  return model


def abstract_model(cfg: ModelConfig) -> Horizon:
  """The model with ShapeDtypeStruct parameters (nothing allocated), MXFP4 where configured."""
  model = nnx.eval_shape(lambda: Horizon(cfg, rngs=nnx.Rngs(0)))
  if cfg.quantization != "none":
    from model.quant import quantize_model  # noqa: PLC0415
    quantize_model(model, cfg.quantization)
  return model
