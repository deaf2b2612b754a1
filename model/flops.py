"""The model's FLOPs per token, counted from the config (the numerator of MFU).

Model FLOPs utilisation (MFU, `training.metrics`) is the FLOP/s the model's own
maths needs at the measured tokens/s, divided by the hardware's peak (PaLM,
Chowdhery et al. 2022, appendix B). The FLOPs are counted per token from the
config by reading the model code (matmuls as 2*m*n*k; norms, activations,
softmax and other elementwise work are not counted):

* weight matmuls: one multiply-add per weight a token uses -- MLA in the
  absorbed form `model/attention/dsa.py` runs (W_uk folded into the query,
  W_uv applied to the attended latent), the lightning indexer's projections,
  the sigmoid output gate and W_o; the Delta projections and the depthwise
  conv; the router, the `experts_per_token` active routed experts and the
  shared experts; dense FFNs; the LM head. The embedding lookup is free.
  This part is 2 x (active non-embedding, non-vector parameters), which the
  tests check against `model.param_count`.
* sequence terms, at the actual sequence length T: Gated DSA's main attention
  (MQA over the latent, DeepSeek-V3.2-Exp) reads min(index_topk, i + 1)
  selected keys at position i, averaged over positions; the lightning indexer
  is dense over the sequence -- it scores all i + 1 causal keys, (T + 1) / 2 on
  average -- and the sparse-stage indexer loss rescores the selected keys; the
  Delta layers' chunkwise WY/UT work (Yang et al. 2024/2025) per chunk of C
  tokens: the C x C q.k and k.k terms, the unit-lower-triangular inverse as
  `delta_rule._blocked_inverse` computes it, the pseudo-value solve and the
  d_k x d_v state read/updates, over ceil(T / C) chunks.
  Packed documents shorten the real attention spans; the count assumes one
  document per row (an upper bound). Vision-encoder FLOPs are not counted.

Training costs 3 x the forward (backward = 2 x forward, the convention of
Kaplan et al. 2020 and PaLM), which slightly over-counts the detached indexer
(no input gradient, no backward through the top-k scoring). Rematerialisation
adds recomputed forward work: `remat='full'` recomputes every block (~4 x; the
LM head and embedding sit outside the blocks and are not recomputed);
`'save_dots'` keeps dots without batch dimensions and recomputes the rest (the
attention, indexer-score and Delta-chunk dots, the head-batched absorbed MLA
dots and the routed experts' batched/ragged matmuls). 'train' includes that
recompute, so with remat it is a hardware-FLOPs figure (PaLM's HFU);
'train_model' = 3 x forward is PaLM's strict MFU numerator.

Einsum legend (for the counted matmuls): b batch, t query, s key, d model,
h heads, k head dim, v value dim, e expert, f ffn width, r lora rank,
c latent (kv_lora) dim.
"""

from __future__ import annotations

import math

from model.attention.delta_rule import _PRODUCT_BLOCK  # the inverse's recursion cut-off
from model.config import ModelConfig, is_int

# Forward components counted from weights (one multiply-add per weight per token).
WEIGHT_COMPONENTS = ("dsa_projections", "indexer_projections", "delta_projections", "dense_ffn",
                     "router", "routed_experts", "shared_experts", "lm_head", "embedding")
# Forward components that depend on the sequence length.
SEQUENCE_COMPONENTS = ("dsa_attention", "indexer_scores", "indexer_selected", "delta_chunk")
# Components whose dots carry batch dimensions (or are ragged_dot), recomputed under 'save_dots'
# (with the head-batched absorbed MLA dots, counted inside dsa_projections).
_SAVE_DOTS_RECOMPUTE = SEQUENCE_COMPONENTS + ("routed_experts",)


def mean_causal_keys(seq_len: int, cap: int | None = None) -> float:
  """Mean over positions i < seq_len of min(cap, i + 1); all causal keys ((T+1)/2) when cap is None."""
  if cap is None or cap >= seq_len:
    return (seq_len + 1) / 2
  return (cap * (cap + 1) / 2 + (seq_len - cap) * cap) / seq_len


def unit_lower_inverse_macs(m: int) -> int:
  """Multiply-adds of `delta_rule.unit_lower_inverse` on one m x m block (same recursion).

  m is padded to a power of two p; blocks up to _PRODUCT_BLOCK take the product form's
  2 (ceil(log2 p) - 1) p x p x p matmuls; larger blocks split in halves (inverted as one
  batch) and merge with two (p/2)^3 matmuls.
  """
  p = 1 << max(0, (m - 1).bit_length())
  if p <= _PRODUCT_BLOCK:
    return 2 * max(0, p.bit_length() - 2) * p ** 3
  h = p // 2
  return 2 * unit_lower_inverse_macs(h) + 2 * h ** 3


def _dsa_macs(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
  """Per token, per Gated DSA layer (multiply-adds)."""
  d, h, ql, c = cfg.d_model, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
  nope, rope, v = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
  hi, di = cfg.index_heads, cfg.index_head_dim
  absorbed = h * nope * c + c * h * v  # q_nope W_uk ('bthk,chk->bthc') and W_uv ('bthc,chv->bthv')
  proj = (d * ql + ql * h * (nope + rope) + d * (c + rope)  # W_dq, W_uq, W_dkv
          + d * h * v + h * v * d)  # output gate W_g and W_o
  # Per (query, key): logits over latent + RoPE key ('bthc,btjc', 'bthp,btjp'), p . latent ('bthj,btjc').
  per_key = h * (c + rope) + h * c
  per_index_key = hi * di + hi  # 'bthk,bsk->bths' then the head-weighted sum 'bths,bth->bts'
  if cfg.indexer_stage == "sparse":
    selected = mean_causal_keys(seq_len, cfg.index_topk)
    rescored = per_index_key * selected  # selected_indexer_scores for the KL
  else:  # dense warm-up: dense MLA over all causal keys, no top-k
    selected, rescored = mean_causal_keys(seq_len), 0.0
  return {"dsa_projections": proj + absorbed, "dsa_absorbed": absorbed,
          "indexer_projections": ql * hi * di + d * di + d * hi,  # W_qi, W_ki, W_w
          "dsa_attention": per_key * selected,
          "indexer_scores": per_index_key * mean_causal_keys(seq_len),
          "indexer_selected": rescored}


def _delta_macs(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
  """Per token, per Delta layer (multiply-adds)."""
  d, hqk, hv = cfg.d_model, cfg.delta_qk_heads, cfg.delta_v_heads
  kd, vd, c = cfg.delta_qk_dim, cfg.delta_v_dim, cfg.delta_chunk_size
  conv = cfg.delta_conv_size * (2 * hqk * kd + hv * vd)  # depthwise taps over q|k|v channels
  proj = 2 * d * hqk * kd + 2 * d * hv * vd + 2 * d * hv + hv * vd * d  # W_q,k; W_v,z; W_beta,a; W_o
  # One chunk of one (value) head, from delta_rule._chunk_terms and the chunk scan:
  per_chunk = (c * c  # in-chunk log-decay sums as a matmul with a lower-triangular ones matrix
               + 2 * c * c * kd  # [q; k] . k^T
               + unit_lower_inverse_macs(c)  # (I + A)^-1
               + c * c * (kd + vd)  # (I + A)^-1 [beta gamma k | beta v]
               + 3 * c * kd * vd  # u0 - w S, S update k^T u, q_decayed . S
               + c * c * vd)  # intra-chunk scores . u
  chunks = max(1, math.ceil(seq_len / c))
  resets = c * c  # per chunk and row, shared by the heads: the running reset count (same matmul)
  return {"delta_projections": proj + conv,
          "delta_chunk": chunks * (hv * per_chunk + resets) / seq_len}


def _ffn_macs(cfg: ModelConfig) -> dict[str, float]:
  """Per token, per layer kind: dense SwiGLU vs MoE (router + active routed + shared)."""
  d, f = cfg.d_model, cfg.expert_dim
  return {"dense_ffn": 3 * d * cfg.dense_ffn_dim, "router": d * cfg.num_experts,
          "routed_experts": cfg.experts_per_token * 3 * d * f,
          "shared_experts": cfg.num_shared_experts * 3 * d * f}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
  """Forward and training FLOPs per token at sequence length `seq_len` (see module docstring).

  Args:
    cfg: the model config.
    seq_len: tokens per row (the attention span the sequence terms assume).

  Returns:
    {component: forward FLOPs per token, summed over layers} for every name in
    WEIGHT_COMPONENTS and SEQUENCE_COMPONENTS, plus 'weights' (the weight part),
    'sequence' (the sequence part), 'forward' (their sum), 'train_model'
    (3 x forward), 'recompute' (the remat policy's recomputed forward work) and
    'train' (train_model + recompute: 4 x forward less the LM head for remat='full').
  """
  if not is_int(seq_len, numpy=True) or seq_len < 1:
    raise ValueError(f"flops_per_token: seq_len={seq_len!r} must be a positive int (tokens per row).")
  seq_len = int(seq_len)  # a numpy integer (an array's shape entry, a config read back) counts as one
  n_dsa, n_delta = cfg.layer_kinds.count("dsa"), cfg.layer_kinds.count("delta")
  n_dense, n_moe = cfg.ffn_kinds.count("dense"), cfg.ffn_kinds.count("moe")
  dsa, delta, ffn = _dsa_macs(cfg, seq_len), _delta_macs(cfg, seq_len), _ffn_macs(cfg)
  macs = {name: n_dsa * value for name, value in dsa.items()}
  macs.update({name: n_delta * value for name, value in delta.items()})
  macs["dense_ffn"] = n_dense * ffn["dense_ffn"]
  macs.update({name: n_moe * ffn[name] for name in ("router", "routed_experts", "shared_experts")})
  macs["lm_head"] = cfg.d_model * cfg.vocab_size
  macs["embedding"] = 0.0  # a gather
  out = {name: 2.0 * value for name, value in macs.items()}
  absorbed = out.pop("dsa_absorbed")  # part of dsa_projections, kept for the recompute below
  out["weights"] = sum(out[n] for n in WEIGHT_COMPONENTS)
  out["sequence"] = sum(out[n] for n in SEQUENCE_COMPONENTS)
  out["forward"] = out["weights"] + out["sequence"]
  out["train_model"] = 3.0 * out["forward"]
  if cfg.remat == "full":  # every block again; the LM head (and embedding) run outside them once
    out["recompute"] = out["forward"] - out["lm_head"] - out["embedding"]
  elif cfg.remat == "save_dots":
    out["recompute"] = absorbed + sum(out[n] for n in _SAVE_DOTS_RECOMPUTE)
  else:
    out["recompute"] = 0.0
  out["train"] = out["train_model"] + out["recompute"]
  return out
