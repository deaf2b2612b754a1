"""Analytic per-device activation memory of one training micro-batch.

An ESTIMATE, derived by reading the forward code (model/decoder.py,
model/attention/dsa.py + sparse.py, model/attention/delta.py + delta_rule.py,
model/moe.py, sharding/expert_parallel.py), not a measurement; `memory_plan
--validate` compares it with XLA's own buffer assignment on small configs.

The counting rule (why: it is what a fusing compiler must keep in memory):

* a tensor is *stored* if the backward pass needs it and it cannot be fused
  away: matmul operands (in the dtype the matmul reads them: the
  `model.layers.einsum` helper casts both operands to the compute dtype, so a
  float32 weight read by a bfloat16 matmul is a stored bfloat16 copy), matmul
  outputs consumed by a non-linearity (norms, SiLU, sigmoid, products), and
  the outputs of gathers, concatenations, scans and top-k;
* element-wise chains (f32 upcasts, RoPE, gates, masks) are assumed fused into
  their consumers and cost nothing on their own;
* tensors only the forward pass needs (the lightning indexer's score tiles,
  the expert-parallel send buffers, the triangular-solve input) are
  *transients* of the layer that computes them, like the gradients flowing
  back through it.

Each layer kind has one function returning a `LayerMemory`: its stored
residuals (`saved`, with `dot` marking outputs of matmuls without batch dims,
the only residuals the `save_dots` remat policy keeps, in f32 because the
einsum helper accumulates in f32), its per-stage transient tiles (`work`,
alternatives: the maximum counts) and its weight copies (`weights`: FSDP
all-gathered weights and their pre-reduce-scatter gradients, summed). How the
remat policy combines layers is `model_activation_bytes`.

Sizes are per device: `Local.tokens` = local sequences * sequence length;
dims the activation rules split over `tensor` (heads, FFN widths, vocab) are
divided by the tensor axis when it divides them (`sharding.rules`
leaves an undivisible activation dim whole).

Einsum-free module; legend of the shape names in comments: T local tokens,
A = T * experts_per_token routed assignments, R rows the local experts run
on, d model dim, H heads, c latent (kv_lora) dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import math

from model.config import ConfigError, ModelConfig
from sharding import expert_parallel

BACKENDS = ("tpu", "gpu", "cpu")
F32 = 4


@dataclasses.dataclass(frozen=True)
class Buf:
  """One activation-sized buffer.

  kind: 'saved' (a residual kept for the backward pass), 'dot' (a saved
  residual that is a no-batch-dim matmul output: what save_dots keeps, in f32),
  'work' (a transient of one stage of the layer), 'weights' (weight copies
  and their gradients while the layer runs).
  """
  name: str
  nbytes: int
  kind: str
  parts: int = 1  # how many equal tensors `nbytes` covers (e.g. gate and up: 2)


@dataclasses.dataclass(frozen=True)
class LayerMemory:
  """The buffers of one layer; `dt` is the compute dtype's itemsize."""
  name: str
  bufs: tuple[Buf, ...]
  dt: int

  def _sum(self, *kinds: str) -> int:
    return sum(b.nbytes for b in self.bufs if b.kind in kinds)

  @property
  def saved(self) -> int:
    """Residuals kept for the backward pass without remat."""
    return self._sum("saved", "dot")

  @property
  def dots_f32(self) -> int:
    """What the save_dots policy keeps: the no-batch-dim matmul outputs, in f32."""
    return self._sum("dot") * F32 // self.dt

  @property
  def peak_extra(self) -> int:
    """Transient bytes while this layer's backward runs, on top of its residuals.

    Its weight copies plus the larger of its largest per-stage tile and two
    cotangents as big as its largest residual (the gradient arriving at a
    tensor and the one leaving it).
    """
    work = max((b.nbytes for b in self.bufs if b.kind == "work"), default=0)
    biggest = max((b.nbytes // b.parts for b in self.bufs if b.kind in ("saved", "dot")), default=0)
    return self._sum("weights") + max(work, 2 * biggest)

  def breakdown(self) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in self.bufs:
      out[b.name] = out.get(b.name, 0) + b.nbytes
    return out


@dataclasses.dataclass(frozen=True)
class Local:
  """Per-device geometry of one micro-batch.

  seqs: local sequences (global batch / micro-batches / batch mesh axes);
  seq_len: tokens per sequence; tensor, expert, fsdp: mesh axis sizes;
  backend: 'tpu' | 'gpu' | 'cpu' (picks the MoE matmul and the exchange the
  model's 'auto' settings pick there); exchange: 'ragged' | 'capacity'
  (expert-parallel token exchange; unused when expert == 1).
  """
  seqs: int
  seq_len: int
  tensor: int = 1
  expert: int = 1
  fsdp: int = 1
  backend: str = "tpu"
  exchange: str = "ragged"

  def __post_init__(self):
    if self.seqs < 1 or self.seq_len < 1:
      raise ValueError(f"Local: seqs={self.seqs} and seq_len={self.seq_len} must be >= 1.")
    if min(self.tensor, self.expert, self.fsdp) < 1:
      raise ValueError(f"Local: tensor={self.tensor}, expert={self.expert} and fsdp={self.fsdp} "
                       "(mesh axis sizes) must be >= 1.")
    if self.backend not in BACKENDS:
      raise ConfigError(f"--backend={self.backend!r}: choose one of {BACKENDS}.")
    if self.exchange not in ("ragged", "capacity"):
      raise ValueError(f"exchange={self.exchange!r}: choose 'ragged' or 'capacity' "
                       "(resolve 'auto' with resolve_exchange first).")

  @property
  def tokens(self) -> int:
    return self.seqs * self.seq_len

  def split(self, n: int) -> int:
    """A dim the activation rules map to `tensor`: split when the axis divides it."""
    return n // self.tensor if n % self.tensor == 0 else n


def resolve_exchange(exchange: str, backend: str) -> str:
  """The config's expert_exchange as `sharding.expert_parallel` resolves it on `backend`."""
  if exchange not in expert_parallel.EXCHANGES:
    raise ValueError(f"exchange={exchange!r}; choose one of {expert_parallel.EXCHANGES}.")
  if exchange == "auto":
    return "ragged" if backend in ("tpu", "gpu") else "capacity"
  return exchange


def _dt(cfg: ModelConfig, loc: Local | None = None) -> int:
  """Bytes per stored activation element.

  The compute dtype's, except on XLA:CPU, which has no bf16 arithmetic: it
  converts bf16 matmul operands to f32 copies before every dot and runs
  element-wise ops in f32 (visible in the optimised HLO as `convert` ops
  around each `dot`), so what a CPU run stores is f32-sized.
  """
  dt = cfg.jnp_dtype.itemsize
  return max(dt, F32) if loc is not None and loc.backend == "cpu" else dt


def _weights(cfg: ModelConfig, loc: Local, name: str, shape: tuple[int, ...],
             cast: bool = True, parts: int = 1) -> list[Buf]:
  """Weight copies of one layer while it runs; `shape`: its per-device shape with fsdp undone.

  A weight stored in a wider dtype than the compute dtype is cast before the
  matmul (`model.layers.einsum`), and the cast shard is a residual
  (`cast=False`: the layer casts gathered pieces instead; `parts`: how many
  weights `shape` covers). Under FSDP the all-gathered copy and the weight's
  gradient before the reduce-scatter exist while the layer runs (and again
  when it is recomputed).
  """
  dt, pdt = _dt(cfg, loc), cfg.jnp_param_dtype.itemsize
  n = math.prod(shape)
  out = []
  if cast and pdt != cfg.jnp_dtype.itemsize:
    out.append(Buf(f"{name} (compute-dtype copy)", -(-n // loc.fsdp) * dt, "saved", parts))
  if loc.fsdp > 1:
    out.append(Buf(f"{name} (fsdp all-gather)", n * dt, "weights"))
    out.append(Buf(f"{name} grad (before reduce-scatter)", n * pdt, "weights"))
  return out


def block_residuals(cfg: ModelConfig, loc: Local) -> list[Buf]:
  """Per block: the attention norm output, the residual after attention and the FFN norm output.

  (The block input itself is accounted by the remat policy.)
  """
  td = loc.tokens * cfg.d_model * _dt(cfg, loc)
  return [Buf("attn_norm out [T,d]", td, "saved"), Buf("x + attn [T,d]", td, "saved"),
          Buf("ffn_norm out [T,d]", td, "saved")]


def _dsa_sparse_stage(cfg: ModelConfig, loc: Local, h: int, hi: int, dt: int) -> list[Buf]:
  """Top-k selection and sparse MQA: per query block under lax.map, checkpointed."""
  T, b, c, rope, di = loc.tokens, loc.seqs, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.index_head_dim
  k = min(cfg.index_topk, loc.seq_len)
  qb, kb = min(cfg.dsa_query_block, loc.seq_len), min(cfg.dsa_key_block, loc.seq_len)
  return [
      Buf("top-k idx int32 + valid [T,k]", T * k * 5, "saved"),
      Buf("p_sel + indexer logits f32 [T,k]", 2 * T * k * F32, "saved", 2),
      # Per query block (lax.map): the indexer score tile of blockwise_topk,
      # and the checkpointed sparse-attention body's gathers + f32 logits,
      # probabilities and their gradients during its backward.
      Buf("top-k score tile", b * qb * (hi * kb + kb + 2 * (k + kb)) * F32, "work"),
      Buf("sparse-attention block (fwd+bwd)",
          b * qb * k * (c + rope) * (dt + F32) + 3 * b * qb * h * k * F32 + T * (c + rope) * F32,
          "work"),
      Buf("indexer-KL block (fwd+bwd)", b * qb * k * di * (dt + F32) + 2 * b * qb * hi * k * F32, "work"),
  ]


def _dsa_dense_stage(loc: Local, h: int, hi: int, dt: int, masked: bool) -> list[Buf]:
  """Dense MQA over every allowed key (warm-up stage, or top-k covering every key) or under the
  top-k mask (`masked`: up to dsa_dense_len): full [T, H, S] f32 logits, probabilities kept for
  the backward, the indexer's [T, Hi, S] dots; the masked form adds the mask and its int32 keys."""
  T, S = loc.tokens, loc.seq_len
  mask = [Buf("top-k mask [T,S] + its int32 order keys", T * S * 5, "saved")] if masked else []
  return mask + [
      Buf("probs f32 + compute-dtype copy [T,H,S]", T * h * S * (F32 + dt), "saved", 2),
      Buf("indexer dots f32 [T,Hi,S]", T * hi * S * F32, "saved"),
      Buf("p + indexer scores f32 [T,S]", 2 * T * S * F32, "saved", 2),
      Buf("logits, their gradient f32 [T,H,S]", 2 * T * h * S * F32, "work", 2),
      Buf("indexer dots' gradient f32 [T,Hi,S]", T * hi * S * F32, "work"),
  ]


def dsa_attention(cfg: ModelConfig, loc: Local) -> LayerMemory:
  """Gated DSA (model/attention/dsa.py): the sparse stage, or dense MQA where the model runs it
  (the dense warm-up stage, top-k covering every key of the sequence, or under the top-k mask up
  to dsa_dense_len tokens)."""
  dt, T = _dt(cfg, loc), loc.tokens
  d, ql, c, rope, nope, v = (cfg.d_model, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_dim,
                             cfg.qk_nope_dim, cfg.v_head_dim)
  h, hi, di = loc.split(cfg.num_heads), loc.split(cfg.index_heads), cfg.index_head_dim
  dense = cfg.indexer_stage == "dense_warmup" or cfg.index_topk >= loc.seq_len
  masked = not dense and loc.seq_len <= cfg.dsa_dense_len
  bufs = [
      Buf("c_q pre-norm [T,ql]", T * ql * dt, "dot"),
      Buf("c_q [T,ql]", T * ql * dt, "saved"),
      Buf("q [T,H,nope+rope]", T * h * (nope + rope) * dt, "dot"),
      Buf("q_rope [T,H,rope]", T * h * rope * dt, "saved"),
      Buf("q_lat [T,H,c]", T * h * c * dt, "dot"),
      Buf("kv [T,c+rope]", T * (c + rope) * dt, "dot"),
      Buf("latent, k_rope [T,c+rope]", T * (c + rope) * dt, "saved", 2),
      Buf("indexer q_i [T,Hi,di]", T * hi * di * dt, "dot"),
      Buf("indexer k_i pre-norm, w_i", T * (di + hi) * dt, "dot", 2),
      Buf("indexer k_i [T,di]", T * di * dt, "saved"),
      Buf("out_lat [T,H,c]", T * h * c * dt, "saved"),
      Buf("o, gate pre-act [T,H,v]", 2 * T * h * v * dt, "dot", 2),
      Buf("gated o [T,H,v]", T * h * v * dt, "saved"),
  ]
  if dense or masked:
    bufs += _dsa_dense_stage(loc, h, hi, dt, masked)
  else:
    bufs += _dsa_sparse_stage(cfg, loc, h, hi, dt)
  bufs += _weights(cfg, loc, "w_dq", (d, ql)) + _weights(cfg, loc, "w_uq", (ql, h, nope + rope))
  bufs += _weights(cfg, loc, "w_dkv", (d, c + rope)) + _weights(cfg, loc, "w_uk", (c, h, nope))
  bufs += _weights(cfg, loc, "w_uv", (c, h, v)) + _weights(cfg, loc, "w_g", (d, h, v))
  bufs += _weights(cfg, loc, "w_o", (h, v, d)) + _weights(cfg, loc, "w_qi", (ql, hi, di))
  bufs += _weights(cfg, loc, "w_ki, w_w", (d, di + hi), parts=2)
  return LayerMemory("dsa", tuple(bufs), dt)


def delta_attention(cfg: ModelConfig, loc: Local) -> LayerMemory:
  """Gated DeltaNet (model/attention/delta.py + delta_rule.py, chunked WY/UT form).

  The chunked rule runs in f32 on [chunks, b, heads, chunk, dim] copies
  (padded to whole chunks); the scan keeps the state entering every chunk.
  """
  dt, T = _dt(cfg, loc), loc.tokens
  d, kd, vd, width = cfg.d_model, cfg.delta_qk_dim, cfg.delta_v_dim, cfg.delta_conv_size
  hq, hv, ch = loc.split(cfg.delta_qk_heads), loc.split(cfg.delta_v_heads), cfg.delta_chunk_size
  conv = 2 * hq * kd + hv * vd
  tc = loc.seqs * math.ceil(loc.seq_len / ch) * ch  # tokens padded to whole chunks
  bufs = [
      Buf("q|k|v pre-conv (+history) [T,C]", (T + loc.seqs * (width - 1)) * conv * dt, "dot"),
      Buf("z [T,Hv,vd]", T * hv * vd * dt, "dot"),
      Buf("beta, a [T,Hv]", 2 * T * hv * dt, "dot", 2),
      Buf("conv features [T,C]", T * conv * dt, "saved"),
      Buf("chunked q, k, v f32", tc * hv * (2 * kd + vd) * F32, "saved", 3),
      Buf("q.k, k.k chunk scores f32 [T,H,2c]", tc * hv * 2 * ch * F32, "saved"),
      Buf("decayed scores + (I+A)^-1 f32 [T,H,c]", 2 * tc * hv * ch * F32, "saved", 2),
      Buf("rhs + solution [k*beta*gamma | v*beta] f32", 2 * tc * hv * (kd + vd) * F32, "saved", 2),
      Buf("q decayed, k to end f32", 2 * tc * hv * kd * F32, "saved", 2),
      Buf("chunk-start states f32 [T/c,H,kd,vd]", tc // ch * hv * kd * vd * F32, "saved"),
      Buf("u, o f32 [T,H,vd]", 2 * tc * hv * vd * F32, "saved", 2),
      Buf("gated output [T,Hv,vd]", T * hv * vd * dt, "saved"),
      # The strictly-lower A and the blocked inverse's halves (forward), the
      # analytic VJP's two matmuls (backward).
      Buf("triangular solve (fwd/bwd)", 3 * tc * hv * ch * F32, "work"),
  ]
  bufs += _weights(cfg, loc, "w_q, w_k", (d, 2 * hq * kd), parts=2)
  bufs += _weights(cfg, loc, "w_v, w_z", (d, 2 * hv * vd), parts=2)
  bufs += _weights(cfg, loc, "w_o", (hv, vd, d)) + _weights(cfg, loc, "w_beta, w_a", (d, 2 * hv), parts=2)
  return LayerMemory("delta", tuple(bufs), dt)


def dense_ffn(cfg: ModelConfig, loc: Local) -> LayerMemory:
  """SwiGLU MLP (model/layers.py MLP): gate and up outputs, their product."""
  dt, T = _dt(cfg, loc), loc.tokens
  f = loc.split(cfg.dense_ffn_dim)
  bufs = [Buf("gate, up [T,f]", 2 * T * f * dt, "dot", 2), Buf("silu(g)*u [T,f]", T * f * dt, "saved")]
  bufs += _weights(cfg, loc, "w_gate, w_up, w_down", (3, cfg.d_model, f), parts=3)
  return LayerMemory("dense_ffn", tuple(bufs), dt)


def _expert_rows(cfg: ModelConfig, loc: Local, rows: int, experts: int, f: int) -> list[Buf]:
  """Grouped SwiGLU of model.moe_experts.dropless_experts over `rows` rows and `experts` local experts.

  Both 'ragged_dot' (TPU/GPU) and 'grouped' (CPU, model/moe_grouped.py) run
  on the expert-sorted rows and read each expert's weights in place. Stored:
  the sorted rows, gate and up [rows, f] and the un-permuted output;
  'ragged_dot' also keeps the SwiGLU product for its down-projection's
  backward, while 'grouped' recomputes it per tile. The grouped backward
  accumulates the three weight gradients in f32 [e, d, f] buffers and the row
  gradients in an f32 [rows, d] buffer.
  """
  dt, d = _dt(cfg, loc), cfg.d_model
  bufs = [
      Buf("expert rows in [R,d]", rows * d * dt, "saved"),
      Buf("expert gate, up [R,f]", 2 * rows * f * dt, "saved", 2),
      Buf("expert rows out [R,d]", rows * d * dt, "saved"),
  ]
  if loc.backend == "cpu":
    bufs.append(Buf("grouped backward: dW f32 [e,d,f] x3 + row grads f32 [R,d]",
                    3 * experts * d * f * F32 + rows * d * F32, "work"))
  else:
    bufs.append(Buf("expert silu(g)*u [R,f]", rows * f * dt, "saved"))
  return bufs


def _ep_rows(cfg: ModelConfig, loc: Local, assignments: int) -> tuple[int, list[Buf]]:
  """Rows the local experts run on under expert parallelism, and the exchange buffers.

  'ragged' (sharding/expert_parallel.py): the receive buffer is sized for the
  worst case, ep * A rows, whatever the routing. 'capacity': ep buckets of
  C = ceil(capacity_factor * A / ep) rows.
  """
  dt, d, ep = _dt(cfg, loc), cfg.d_model, loc.expert
  if loc.exchange == "ragged":
    rows = ep * assignments
    extra = [Buf("ragged send [A,d] + receive [ep*A,d]", (assignments + rows) * d * dt, "work"),
             Buf("returned rows [A,d] + combine input f32", assignments * d * (dt + F32), "saved", 2)]
  else:
    rows = ep * expert_parallel.capacity(assignments, ep, cfg.capacity_factor)
    extra = [Buf("capacity send + receive [ep*C,d]", 2 * rows * d * dt, "work"),
             Buf("returned rows [A,d] + combine input f32", assignments * d * (dt + F32), "saved", 2)]
  if loc.tensor > 1:  # partial FFN-width products summed over `tensor`
    extra.append(Buf("tensor-axis psum of expert outputs [R,d]", rows * d * dt, "work"))
  return rows, extra


def moe_ffn(cfg: ModelConfig, loc: Local) -> LayerMemory:
  """Router + routed experts (dropless or expert-parallel) + shared experts (model/moe.py)."""
  dt, T, d = _dt(cfg, loc), loc.tokens, cfg.d_model
  e, k = cfg.num_experts, cfg.experts_per_token
  f = loc.split(cfg.expert_dim)
  a = T * k
  bufs = [
      Buf("router input f32 [T,d]", T * d * F32, "saved"),
      Buf("router logits f32 [T,e]", T * e * F32, "dot"),
      Buf("expert ids + combine weights [T,k]", 2 * a * F32, "saved", 2),
  ]
  if loc.expert > 1:
    rows, extra = _ep_rows(cfg, loc, a)
    bufs += extra + _expert_rows(cfg, loc, rows, e // loc.expert, f)
  else:
    bufs += _expert_rows(cfg, loc, a, e, f)
  if cfg.num_shared_experts:
    s = loc.split(cfg.num_shared_experts * cfg.expert_dim)
    bufs += [Buf("shared gate, up [T,f]", 2 * T * s * dt, "dot", 2),
             Buf("shared silu(g)*u", T * s * dt, "saved")]
    bufs += _weights(cfg, loc, "shared expert", (3, d, s), parts=3)
  e_local = e // loc.expert
  # The grouped (CPU) path casts each tile's slice of an expert's weights, not the weights.
  bufs += _weights(cfg, loc, "routed experts", (3, e_local, d, f), cast=loc.backend != "cpu", parts=3)
  bufs += _weights(cfg, loc, "w_router", (d, e_local))
  return LayerMemory("moe", tuple(bufs), dt)


def lm_head(cfg: ModelConfig, loc: Local) -> LayerMemory:
  """Final norm, logits and the cross-entropy (and the embedding lookup's weights).

  The logits are a bf16 matmul output read in f32 by the loss; their
  gradient is an f32 [T, V] array cast to bf16 for the head's backward.
  """
  dt, T, d = _dt(cfg, loc), loc.tokens, cfg.d_model
  vocab = loc.split(cfg.vocab_size)
  bufs = [
      Buf("final_norm out [T,d]", T * d * dt, "saved"),
      Buf("logits [T,V]", T * vocab * dt, "saved"),
      Buf("logits gradient f32 + bf16 [T,V]", T * vocab * (F32 + dt), "work"),
  ]
  bufs += _weights(cfg, loc, "head", (d, vocab)) + _weights(cfg, loc, "embed", (vocab, d))
  return LayerMemory("lm_head", tuple(bufs), dt)


def block_layers(cfg: ModelConfig, loc: Local) -> list[LayerMemory]:
  """One LayerMemory per decoder block: attention + FFN + the block's own residuals."""
  out = []
  attn = {"dsa": dsa_attention(cfg, loc), "delta": delta_attention(cfg, loc)}
  ffn = {"dense": dense_ffn(cfg, loc), "moe": moe_ffn(cfg, loc)}
  common = tuple(block_residuals(cfg, loc))
  for kind, ffn_kind in zip(cfg.layer_kinds, cfg.ffn_kinds, strict=True):
    a, f = attn[kind], ffn[ffn_kind]
    out.append(_merge(f"{kind}+{ffn_kind}", common, a, f))
  return out


def _merge(name: str, common: tuple[Buf, ...], attn: LayerMemory, ffn: LayerMemory) -> LayerMemory:
  """A block = its residuals + attention + FFN; the stages' work tiles stay alternatives."""
  return LayerMemory(name, common + attn.bufs + ffn.bufs, attn.dt)


def model_activation_bytes(cfg: ModelConfig, loc: Local, remat: str) -> dict:
  """Per-device activation bytes of one micro-batch's forward + backward under `remat`.

  none:      every block's residuals live at the start of the backward pass,
             plus the largest transient of any one block (or of the head).
  full:      only each block's input [T, d] is kept; one block's residuals are
             rebuilt while its backward runs (the maximum over blocks).
  save_dots: block inputs + every block's no-batch-dim matmul outputs (f32);
             the rest of one block is rebuilt during its backward.
  The head (logits and their f32 gradient) is live once, at the start of the
  backward pass, whatever the policy.

  Returns {'total', 'kept' (bytes live across the whole step), 'peak_block'
  (the largest block's transient peak), 'head', 'block_input', 'peak_block_name',
  'peak_block_top' (its largest buffers: [(name, bytes)])}.
  """
  if remat not in ("none", "full", "save_dots"):
    raise ConfigError(f"--remat={remat!r}: choose 'none', 'full' or 'save_dots'.")
  blocks = block_layers(cfg, loc)
  head = lm_head(cfg, loc)
  x_in = loc.tokens * cfg.d_model * _dt(cfg, loc)
  if remat == "none":
    kept = sum(x_in + b.saved for b in blocks)
    peak = lambda b: b.peak_extra  # noqa: E731
  else:
    kept = len(blocks) * x_in + (0 if remat == "full" else sum(b.dots_f32 for b in blocks))
    peak = lambda b: b.saved + b.peak_extra  # noqa: E731
  worst = max(blocks, key=peak)
  head_peak = head.saved + head.peak_extra
  top = sorted(worst.breakdown().items(), key=lambda kv: -kv[1])[:6]
  return {"total": kept + max(peak(worst), head_peak), "kept": kept, "peak_block": peak(worst),
          "head": head_peak, "block_input": x_in, "peak_block_name": worst.name,
          "peak_block_top": top}
