"""Abstract parameter counts per component (nothing is allocated).

The model is built with `nnx.eval_shape`, so even the 2.8T-parameter `full`
config is counted in about a second. "Active" parameters are those a single
token uses: everything except the routed experts it does not select
(embeddings, LM head and the vision encoder included; the vision encoder is
reported separately because the design targets are language-model counts).
"""

from __future__ import annotations

import math

from flax import nnx

from model.attention.dsa import GatedDSA
from model.config import ModelConfig
from model.decoder import abstract_model

COMPONENTS = ("embeddings", "lm_head", "dsa_attention", "indexer", "delta_attention", "dense_ffn",
              "routed_experts", "shared_experts", "router", "norms", "vision_encoder")


def _component(path: tuple, axes: tuple, kinds: tuple, ffn_kinds: tuple) -> str:
  keys = [str(p) for p in path]
  if keys[0] == "embed":
    return "embeddings"
  if keys[0] == "head":
    return "lm_head"
  if keys[0] == "vision":
    return "vision_encoder"
  if keys[0] == "final_norm" or keys[2] in ("attn_norm", "ffn_norm"):
    return "norms"
  layer = int(keys[1])
  if keys[2] == "attn":
    if kinds[layer] == "delta":
      return "delta_attention"
    return "indexer" if keys[3] in GatedDSA.INDEXER_PARAMS else "dsa_attention"
  if ffn_kinds[layer] == "dense":
    return "dense_ffn"
  if len(axes) == 3 and axes[0] == "expert":
    return "routed_experts"
  if any("shared" in k for k in keys[3:]):
    return "shared_experts"
  return "router"


def count_parameters(cfg: ModelConfig) -> dict:
  """Returns {'components': {name: n}, 'total', 'active', 'vision', ...}."""
  model = abstract_model(cfg)
  counts = dict.fromkeys(COMPONENTS, 0)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    axes = tuple(var.get_metadata().get("axes", ()))
    n = math.prod(var.get_value().shape)
    counts[_component(tuple(path), axes, cfg.layer_kinds, cfg.ffn_kinds)] += n
  lm_total = sum(v for k, v in counts.items() if k != "vision_encoder")
  unused_experts = counts["routed_experts"] * (cfg.num_experts - cfg.experts_per_token) // cfg.num_experts
  return {
      "components": counts,
      "total": lm_total,
      "active": lm_total - unused_experts,
      "vision": counts["vision_encoder"],
      "total_with_vision": lm_total + counts["vision_encoder"],
      "layers": {"dsa": cfg.layer_kinds.count("dsa"), "delta": cfg.layer_kinds.count("delta")},
      "ffn": {"dense": cfg.ffn_kinds.count("dense"), "moe": cfg.ffn_kinds.count("moe")},
  }
