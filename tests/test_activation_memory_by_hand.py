"""training/activation_memory.py, second mutation audit: every buffer of the Delta, sparse-DSA, MoE and
LM-head layers of the tiny config, worked out by hand from the shapes the module docstrings give.

tiny (f32 compute and params, dt = 4 B): d 56, vocab 331; DSA h 3, q_lora 38, kv_lora 22, nope 10,
rope 6, v 14, indexer 3 heads x 12, top-16, query blocks of 8, key blocks of 16; Delta 2 qk heads x 10,
4 v heads x 6, conv 4, chunks of 8; 8 experts of width 26, top-2, 1 shared, capacity factor 1.25.
"""

import pytest

from configs import horizon
from model.config import ModelConfig
from training import activation_memory as am


def _cfg(**changes) -> ModelConfig:
  return ModelConfig.from_config(horizon.get_config("tiny").model).replace(**changes)


def test_delta_layer_buffers_by_hand():
  """2 sequences of 5 tokens: T = 10, padded to one chunk of 8 each (16 chunked tokens); the conv
  channels q|k|v are 2 x 2 x 10 + 4 x 6 = 64 and each sequence adds conv - 1 = 3 history rows."""
  mem = am.delta_attention(_cfg(), am.Local(seqs=2, seq_len=5))
  want = {
      "q|k|v pre-conv (+history) [T,C]": (10 + 2 * 3) * 64 * 4,
      "z [T,Hv,vd]": 10 * 4 * 6 * 4,
      "beta, a [T,Hv]": 2 * 10 * 4 * 4,
      "conv features [T,C]": 10 * 64 * 4,
      "chunked q, k, v f32": 16 * 4 * (10 + 10 + 6) * 4,
      "q.k, k.k chunk scores f32 [T,H,2c]": 16 * 4 * 2 * 8 * 4,
      "decayed scores + (I+A)^-1 f32 [T,H,c]": 2 * 16 * 4 * 8 * 4,
      "rhs + solution [k*beta*gamma | v*beta] f32": 2 * 16 * 4 * (10 + 6) * 4,
      "q decayed, k to end f32": 2 * 16 * 4 * 10 * 4,
      "chunk-start states f32 [T/c,H,kd,vd]": 2 * 4 * 10 * 6 * 4,  # one chunk per sequence
      "u, o f32 [T,H,vd]": 2 * 16 * 4 * 6 * 4,
      "gated output [T,Hv,vd]": 10 * 4 * 6 * 4,
      "triangular solve (fwd/bwd)": 3 * 16 * 4 * 8 * 4,
  }
  assert mem.breakdown() == want  # one device, f32 weights read in f32: no weight copies
  assert mem.saved == sum(want.values()) - want["triangular solve (fwd/bwd)"] == 42048
  assert mem.dots_f32 == 4096 + 960 + 320  # pre-conv, z, beta/a: already f32
  # The largest single residual: pre-conv, the q.k scores and one of rhs/solution (4096 B each).
  assert mem.peak_extra == 2 * 4096


def test_delta_weights_gathered_over_fsdp():
  """fsdp=2, f32: each weight's all-gathered copy and its gradient, n x 4 B each."""
  mem = am.delta_attention(_cfg(), am.Local(seqs=1, seq_len=8, fsdp=2)).breakdown()
  for name, n in (("w_q, w_k", 56 * 2 * 2 * 10), ("w_v, w_z", 56 * 2 * 4 * 6), ("w_o", 4 * 6 * 56),
                  ("w_beta, w_a", 56 * 2 * 4)):
    assert mem[f"{name} (fsdp all-gather)"] == mem[f"{name} grad (before reduce-scatter)"] == n * 4, name


def test_blocks_follow_the_layer_pattern_with_their_residuals():
  """tiny: DSA + dense FFN, then Delta / DSA / Delta with MoE; each block adds its 3 [T, d] tensors."""
  loc = am.Local(1, 4)
  blocks = am.block_layers(_cfg(), loc)
  assert [b.name for b in blocks] == ["dsa+dense", "delta+moe", "dsa+moe", "delta+moe"]
  first = blocks[0].breakdown()
  assert first["attn_norm out [T,d]"] == first["x + attn [T,d]"] == first["ffn_norm out [T,d]"] == 4 * 56 * 4
  assert first["silu(g)*u [T,f]"] == 4 * 92 * 4  # the dense FFN's product
  assert blocks[1].breakdown()["gated output [T,Hv,vd]"] == 4 * 4 * 6 * 4


def test_sparse_dsa_layer_buffers_by_hand():
  """2 x 20 tokens (T = 40) run the sparse stage (top-16 < 20 keys; dsa_dense_len 0): per query block
  of 8 (b = 2 sequences), key blocks of 16, k = 16 selected keys."""
  mem = am.dsa_attention(_cfg(), am.Local(seqs=2, seq_len=20))
  want = {
      "c_q pre-norm [T,ql]": 40 * 38 * 4, "c_q [T,ql]": 40 * 38 * 4,
      "q [T,H,nope+rope]": 40 * 3 * 16 * 4, "q_rope [T,H,rope]": 40 * 3 * 6 * 4,
      "q_lat [T,H,c]": 40 * 3 * 22 * 4, "kv [T,c+rope]": 40 * 28 * 4,
      "latent, k_rope [T,c+rope]": 40 * 28 * 4, "indexer q_i [T,Hi,di]": 40 * 3 * 12 * 4,
      "indexer k_i pre-norm, w_i": 40 * (12 + 3) * 4, "indexer k_i [T,di]": 40 * 12 * 4,
      "out_lat [T,H,c]": 40 * 3 * 22 * 4, "o, gate pre-act [T,H,v]": 2 * 40 * 3 * 14 * 4,
      "gated o [T,H,v]": 40 * 3 * 14 * 4,
      "top-k idx int32 + valid [T,k]": 40 * 16 * 5,
      "p_sel + indexer logits f32 [T,k]": 2 * 40 * 16 * 4,
      "top-k score tile": 2 * 8 * (3 * 16 + 16 + 2 * (16 + 16)) * 4,
      "sparse-attention block (fwd+bwd)": 2 * 8 * 16 * 28 * (4 + 4) + 3 * 2 * 8 * 3 * 16 * 4 + 40 * 28 * 4,
      "indexer-KL block (fwd+bwd)": 2 * 8 * 16 * 12 * (4 + 4) + 2 * 2 * 8 * 3 * 16 * 4,
  }
  assert mem.breakdown() == want
  dots = 6080 + 7680 + 10560 + 4480 + 5760 + 2400 + 13440
  assert mem.dots_f32 == dots
  assert mem.saved == dots + 6080 + 2880 + 4480 + 1920 + 10560 + 6720 + 3200 + 5120
  assert mem.peak_extra == 71040  # the sparse-attention block's tile beats 2 x 10560


def test_dsa_heads_split_over_tensor_and_weights_gathered_over_fsdp():
  """tensor=3 splits the 3 heads and the 3 indexer heads to 1 each; fsdp=2 gathers every weight in
  f32 (the all-gathered copy and the gradient before the reduce-scatter, each n x 4 B)."""
  mem = am.dsa_attention(_cfg(), am.Local(seqs=1, seq_len=16, tensor=3, fsdp=2)).breakdown()
  assert mem["q [T,H,nope+rope]"] == 16 * 1 * 16 * 4 and mem["indexer q_i [T,Hi,di]"] == 16 * 1 * 12 * 4
  # Dense MQA (top-16 covers all 16 keys): [T, H, S] probabilities in f32 plus a compute-dtype copy.
  assert mem["probs f32 + compute-dtype copy [T,H,S]"] == 16 * 1 * 16 * (4 + 4)
  assert mem["indexer dots f32 [T,Hi,S]"] == 16 * 1 * 16 * 4
  assert mem["logits, their gradient f32 [T,H,S]"] == 2 * 16 * 1 * 16 * 4
  assert mem["p + indexer scores f32 [T,S]"] == 2 * 16 * 16 * 4
  for name, n in (("w_dq", 56 * 38), ("w_uq", 38 * 1 * 16), ("w_dkv", 56 * 28), ("w_uk", 22 * 1 * 10),
                  ("w_uv", 22 * 1 * 14), ("w_g", 56 * 1 * 14), ("w_o", 1 * 14 * 56), ("w_qi", 38 * 1 * 12),
                  ("w_ki, w_w", 56 * (12 + 1))):
    assert mem[f"{name} (fsdp all-gather)"] == n * 4, name
    assert mem[f"{name} grad (before reduce-scatter)"] == n * 4, name
  assert not any("compute-dtype copy)" in k for k in mem)  # f32 params read by f32 matmuls


def test_moe_capacity_exchange_on_cpu_by_hand():
  """1 x 5 tokens, top-2: A = 10 assignments; expert=2 sends buckets of ceil(1.25 x 10 / 2) = 7 rows
  to each of 2 devices (R = 14) for 4 local experts; tensor=2 halves the width 26 to 13. The CPU's
  grouped matmul accumulates dW in f32 and recomputes the SwiGLU product."""
  mem = am.moe_ffn(_cfg(), am.Local(1, 5, tensor=2, expert=2, backend="cpu", exchange="capacity"))
  want = {
      "router input f32 [T,d]": 5 * 56 * 4, "router logits f32 [T,e]": 5 * 8 * 4,
      "expert ids + combine weights [T,k]": 2 * 10 * 4,
      "capacity send + receive [ep*C,d]": 2 * 14 * 56 * 4,
      "returned rows [A,d] + combine input f32": 10 * 56 * (4 + 4),
      "tensor-axis psum of expert outputs [R,d]": 14 * 56 * 4,
      "expert rows in [R,d]": 14 * 56 * 4, "expert gate, up [R,f]": 2 * 14 * 13 * 4,
      "expert rows out [R,d]": 14 * 56 * 4,
      "grouped backward: dW f32 [e,d,f] x3 + row grads f32 [R,d]": 3 * 4 * 56 * 13 * 4 + 14 * 56 * 4,
      "shared gate, up [T,f]": 2 * 5 * 13 * 4, "shared silu(g)*u": 5 * 13 * 4,
  }
  assert mem.breakdown() == want
  assert mem.dots_f32 == 160 + 520
  assert mem.peak_extra == 38080  # the grouped backward's f32 buffers


def test_moe_ragged_exchange_on_tpu_by_hand():
  """expert=2, tensor=1 (no psum): the ragged receive buffer is the worst case 2 x A = 20 rows, and
  ragged_dot keeps the SwiGLU product [R, f] for the down-projection's backward."""
  mem = am.moe_ffn(_cfg(), am.Local(1, 5, expert=2))
  want = {
      "router input f32 [T,d]": 5 * 56 * 4, "router logits f32 [T,e]": 5 * 8 * 4,
      "expert ids + combine weights [T,k]": 2 * 10 * 4,
      "ragged send [A,d] + receive [ep*A,d]": (10 + 20) * 56 * 4,
      "returned rows [A,d] + combine input f32": 10 * 56 * (4 + 4),
      "expert rows in [R,d]": 20 * 56 * 4, "expert gate, up [R,f]": 2 * 20 * 26 * 4,
      "expert rows out [R,d]": 20 * 56 * 4, "expert silu(g)*u [R,f]": 20 * 26 * 4,
      "shared gate, up [T,f]": 2 * 5 * 26 * 4, "shared silu(g)*u": 5 * 26 * 4,
  }
  assert mem.breakdown() == want
  assert mem.saved == sum(want.values()) - want["ragged send [A,d] + receive [ep*A,d]"]
  # Largest single residual: one expert row buffer, 20 x 56 x 4 = 4480 B (gate/up count per part).
  assert mem.peak_extra == max(6720, 2 * 4480)
  none = am.moe_ffn(_cfg(num_shared_experts=0), am.Local(1, 5)).breakdown()
  assert "shared gate, up [T,f]" not in none and none["expert rows in [R,d]"] == 10 * 56 * 4
  two = am.moe_ffn(_cfg(num_shared_experts=2), am.Local(1, 5)).breakdown()
  assert two["shared gate, up [T,f]"] == 2 * 5 * (2 * 26) * 4  # 2 shared experts: one 52-wide SwiGLU


def test_moe_weight_copies_bf16_on_cpu():
  """bf16 compute with f32 params on CPU: stored activations are f32-sized (dt 4), the router's weight
  gets a compute-dtype copy (56 x 8 x 4 B), the routed experts do not (their tiles are cast), and
  fsdp=2 gathers the local experts' and router's columns (expert=2: 4 of 8 experts)."""
  cfg = _cfg(dtype="bfloat16")
  mem = am.moe_ffn(cfg, am.Local(1, 4, backend="cpu", exchange="capacity")).breakdown()
  assert mem["w_router (compute-dtype copy)"] == 56 * 8 * 4
  assert mem["shared expert (compute-dtype copy)"] == 3 * 56 * 26 * 4
  assert "routed experts (compute-dtype copy)" not in mem
  tpu = am.moe_ffn(cfg, am.Local(1, 4)).breakdown()
  assert tpu["routed experts (compute-dtype copy)"] == 3 * 8 * 56 * 26 * 2
  assert tpu["expert rows in [R,d]"] == 8 * 56 * 2
  assert tpu["router input f32 [T,d]"] == 4 * 56 * 4  # the router runs in f32 whatever the dtype
  ep2 = am.moe_ffn(cfg, am.Local(1, 4, expert=2)).breakdown()
  assert ep2["returned rows [A,d] + combine input f32"] == 8 * 56 * (2 + 4)
  ep = am.moe_ffn(_cfg(), am.Local(1, 4, expert=2, fsdp=2)).breakdown()
  assert ep["w_router (fsdp all-gather)"] == ep["w_router grad (before reduce-scatter)"] == 56 * 4 * 4


def test_lm_head_splits_the_vocab_over_tensor():
  """vocab 332 on tensor=2: 166 columns per device; 331 (prime) stays whole on tensor=2."""
  mem = am.lm_head(_cfg(vocab_size=332), am.Local(1, 4, tensor=2))
  assert mem.breakdown() == {"final_norm out [T,d]": 4 * 56 * 4, "logits [T,V]": 4 * 166 * 4,
                             "logits gradient f32 + bf16 [T,V]": 4 * 166 * (4 + 4)}
  whole = am.lm_head(_cfg(), am.Local(1, 4, tensor=2)).breakdown()
  assert whole["logits [T,V]"] == 4 * 331 * 4
  bf = am.lm_head(_cfg(dtype="bfloat16", param_dtype="bfloat16"), am.Local(1, 4)).breakdown()
  assert bf["logits gradient f32 + bf16 [T,V]"] == 4 * 331 * (4 + 2)


def test_block_residuals_and_cpu_block_input():
  """Each block keeps 3 [T, d] tensors of its own; on CPU a bf16 model's block input is f32-sized."""
  res = am.block_residuals(_cfg(), am.Local(1, 4))
  assert [b.nbytes for b in res] == [4 * 56 * 4] * 3
  cfg = _cfg(dtype="bfloat16")
  assert am.model_activation_bytes(cfg, am.Local(1, 4, backend="cpu"), "full")["block_input"] == 4 * 56 * 4
  assert am.model_activation_bytes(cfg, am.Local(1, 4), "full")["block_input"] == 4 * 56 * 2


def test_sparse_dsa_blocks_capped_at_the_sequence():
  """Query and key blocks larger than the 20-token sequence shrink to it: the top-k score tile is
  b x qb x (Hi kb + kb + 2 (k + kb)) f32 with qb = kb = 20."""
  cfg = _cfg(dsa_query_block=32, dsa_key_block=32)
  mem = am.dsa_attention(cfg, am.Local(seqs=1, seq_len=20)).breakdown()
  assert mem["top-k score tile"] == 1 * 20 * (3 * 20 + 20 + 2 * (16 + 20)) * 4


def test_peak_block_top_lists_the_largest_buffers_first(monkeypatch):
  bufs = tuple(am.Buf(f"b{n}", n, "saved") for n in (3, 7, 1, 5, 2, 6, 4))
  monkeypatch.setattr(am, "block_layers", lambda cfg, loc: [am.LayerMemory("only", bufs, 4)])
  monkeypatch.setattr(am, "lm_head", lambda cfg, loc: am.LayerMemory("head", (), 4))
  res = am.model_activation_bytes(_cfg(), am.Local(1, 2), "full")
  assert res["peak_block_name"] == "only"
  assert res["peak_block_top"] == [("b7", 7), ("b6", 6), ("b5", 5), ("b4", 4), ("b3", 3), ("b2", 2)]


def test_peak_counts_dot_residuals_as_cotangents():
  """The two-cotangent rule looks at 'dot' residuals too, not only 'saved' ones."""
  mem = am.LayerMemory("x", (am.Buf("d", 100, "dot"), am.Buf("s", 30, "saved"), am.Buf("w", 150, "work")), 4)
  assert mem.peak_extra == 2 * 100


def test_resolve_exchange_refuses_unknown_names():
  assert am.resolve_exchange("ragged", "cpu") == "ragged"
  with pytest.raises(ValueError, match="exchange='alltoall'"):
    am.resolve_exchange("alltoall", "tpu")


@pytest.mark.parametrize("axes", [{"tensor": 0}, {"expert": 0}, {"fsdp": 0}, {"fsdp": -2}])
def test_local_refuses_mesh_axes_below_one(axes):
  """tensor=0 and expert=0 failed later with ZeroDivisionError; fsdp=0 or -2 were used silently."""
  with pytest.raises(ValueError, match=r"must be >= 1"):
    am.Local(1, 8, **axes)


def test_local_refuses_an_empty_sequence():
  with pytest.raises(ValueError, match="seq_len=0 must be >= 1"):
    am.Local(2, 0)
