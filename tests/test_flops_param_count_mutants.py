"""model.flops and model.param_count on the tiny config, every component counted by hand (mutation audit).

tiny: d 56, vocab 331, 4 layers (DSA, Delta, DSA, Delta; layer 0 dense FFN 92, layers 1-3 MoE of
8 experts of width 26, top-2, 1 shared); DSA h 3, q_lora 38, kv_lora 22, nope 10, rope 6, v 14,
indexer 3 heads x 12; Delta 2 qk heads x 10, 4 v heads x 6, conv 4, chunk 8; vision 2 blocks of
width 20 (2 heads), mlp 34, 16 px images of 4 px patches.
"""

import os
import subprocess
import sys

import pytest

from model import flops
from model.param_count import count_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per layer, from the weight shapes:
DSA = (56 * 28 + 56 * 38 + 56 * 3 * 14 + 3 * 14 * 56  # w_dkv, w_dq, w_g, w_o
       + 22 * 3 * 10 + 38 * 3 * 16 + 22 * 3 * 14  # w_uk, w_uq, w_uv
       + 22 + 38)  # kv / q RMSNorm scales = 11868
INDEXER = 56 * 12 + 38 * 3 * 12 + 56 * 3 + 2 * 12  # w_ki, w_qi, w_w, LayerNorm scale+bias = 2232
DELTA = (4 + 4 + 6  # A_log, dt_bias, the per-head norm scale
         + 4 * (2 * 2 * 10 + 4 * 6)  # depthwise conv over q|k|v channels
         + 2 * 56 * 4 + 2 * 56 * 2 * 10 + 3 * 56 * 4 * 6)  # w_a, w_beta; w_q, w_k; w_v, w_z, w_o = 6990
EXPERT = 3 * 56 * 26  # SwiGLU gate, up, down = 4368
VISION = (20 + 20 + 16 * 20 + 48 * 20 + 20 * 56 + 56 * 56  # b_patch, norm, pos, w_patch, projector
          + 2 * (34 + 20 + 20 + 20 + 20 * 34 + 2 * 10 * 20 + 34 * 20 + 20 * 3 * 2 * 10))  # = 11684


def test_param_count_by_hand(tiny_cfg):
  res = count_parameters(tiny_cfg)
  want = {"embeddings": 331 * 56, "lm_head": 56 * 331, "dsa_attention": 2 * DSA, "indexer": 2 * INDEXER,
          "delta_attention": 2 * DELTA, "dense_ffn": 3 * 56 * 92, "routed_experts": 3 * 8 * EXPERT,
          "shared_experts": 3 * EXPERT, "router": 3 * 56 * 8, "norms": 4 * 2 * 56 + 56,
          "vision_encoder": VISION}
  assert res["components"] == want
  assert (DSA, INDEXER, DELTA, VISION) == (11868, 2232, 6990, 11684)
  total = sum(v for k, v in want.items() if k != "vision_encoder")
  assert res["total"] == total == 214492
  assert res["active"] == total - 3 * 6 * EXPERT  # 6 of 8 routed experts idle in each MoE layer
  assert res["vision"] == VISION and res["total_with_vision"] == total + VISION
  assert res["layers"] == {"dsa": 2, "delta": 2} and res["ffn"] == {"dense": 1, "moe": 3}


def test_param_count_follows_the_layer_pattern(tiny_cfg):
  """5 layers, DSA at 0, 3 (period 3), 2 dense FFNs, no shared expert, top-3 of 8."""
  cfg = tiny_cfg.replace(num_layers=5, dsa_period=3, num_dense_layers=2, num_shared_experts=0,
                         experts_per_token=3, router_groups=1, router_topk_groups=1)
  res = count_parameters(cfg)
  c = res["components"]
  assert (c["dsa_attention"], c["indexer"], c["delta_attention"]) == (2 * DSA, 2 * INDEXER, 3 * DELTA)
  assert (c["dense_ffn"], c["routed_experts"], c["shared_experts"]) == (2 * 3 * 56 * 92, 3 * 8 * EXPERT, 0)
  assert c["norms"] == 5 * 2 * 56 + 56
  assert res["total"] - res["active"] == 3 * 5 * EXPERT
  assert res["layers"] == {"dsa": 2, "delta": 3} and res["ffn"] == {"dense": 2, "moe": 3}


def _weight_flops():
  """Forward FLOPs per token of each weight component: 2 x the multiply-adds."""
  return {"dsa_projections": 2 * 2 * (DSA - 60),  # every DSA matrix (the absorbed W_uk, W_uv included)
          "indexer_projections": 2 * 2 * (INDEXER - 24), "delta_projections": 2 * 2 * (DELTA - 14),
          "dense_ffn": 2 * 3 * 56 * 92, "router": 2 * 3 * 56 * 8, "routed_experts": 2 * 3 * 2 * EXPERT,
          "shared_experts": 2 * 3 * EXPERT, "lm_head": 2 * 56 * 331, "embedding": 0.0}


def test_weight_flops_by_hand(tiny_cfg):
  f = flops.flops_per_token(tiny_cfg, 20)
  want = _weight_flops()
  assert {name: f[name] for name in want} == want
  assert f["weights"] == sum(want.values()) == 233264
  # Sequence terms at T = 20 (derived in tests/test_flops.py::test_sequence_terms_by_hand).
  seq = 6000 + 1638 + 1560 + (6240 * 4 + 64) * 3 / 20 * 2 * 2
  assert f["sequence"] == pytest.approx(seq, rel=1e-12)
  assert f["forward"] == pytest.approx(233264 + seq, rel=1e-12)
  assert f["train_model"] == pytest.approx(3 * (233264 + seq), rel=1e-12)
  assert f["recompute"] == 0.0 and f["train"] == f["train_model"]


def test_save_dots_recompute_by_hand(tiny_cfg):
  """'save_dots' recomputes the absorbed MLA dots, every sequence term and the routed experts."""
  f = flops.flops_per_token(tiny_cfg.replace(remat="save_dots"), 20)
  absorbed = 2 * 2 * (3 * 10 * 22 + 22 * 3 * 14)  # W_uk and W_uv, 2 layers
  seq = 6000 + 1638 + 1560 + (6240 * 4 + 64) * 3 / 20 * 2 * 2
  assert f["recompute"] == pytest.approx(absorbed + seq + 2 * 3 * 2 * EXPERT, rel=1e-12)
  assert f["train"] == pytest.approx(3 * (233264 + seq) + absorbed + seq + 2 * 3 * 2 * EXPERT, rel=1e-12)
  full = flops.flops_per_token(tiny_cfg.replace(remat="full"), 20)
  # 'full' remats the blocks: the LM head (outside them) was counted as recomputed, HFU too high.
  assert full["recompute"] == pytest.approx(233264 + seq - _weight_flops()["lm_head"], rel=1e-12)


def test_flops_follow_the_config(tiny_cfg):
  """2 shared experts, top-3, no dense layer, a whole number of chunks (T = 16: 2 chunks of 8)."""
  cfg = tiny_cfg.replace(num_shared_experts=2, experts_per_token=3, num_dense_layers=0)
  f = flops.flops_per_token(cfg, 16)
  assert (f["dense_ffn"], f["router"]) == (0, 2 * 4 * 56 * 8)
  assert (f["routed_experts"], f["shared_experts"]) == (2 * 4 * 3 * EXPERT, 2 * 4 * 2 * EXPERT)
  assert f["delta_chunk"] == pytest.approx((6240 * 4 + 64) * 2 / 16 * 2 * 2, rel=1e-12)
  # T = 1: one (padded) chunk, one key everywhere.
  one = flops.flops_per_token(tiny_cfg, 1)
  assert one["dsa_attention"] == 2 * 2 * (3 * (22 + 6) + 3 * 22)
  assert one["indexer_scores"] == one["indexer_selected"] == 2 * 2 * (3 * 12 + 3)


def test_mean_causal_keys_and_inverse_by_hand():
  assert flops.mean_causal_keys(4, 4) == flops.mean_causal_keys(4) == 2.5  # (1 + 2 + 3 + 4) / 4
  assert flops.mean_causal_keys(6, 2) == (1 + 2 + 2 + 2 + 2 + 2) / 6
  # Padded to a power of two p <= 8: 2 (log2 p - 1) p^3 multiply-adds; 1 and 2 need no matmul.
  assert [flops.unit_lower_inverse_macs(m) for m in (1, 2, 3, 4, 5, 8)] == [0, 0, 128, 128, 2048, 2048]


@pytest.mark.parametrize("seq_len", [0, -3, 20.0, "20"])
def test_flops_refuse_a_bad_seq_len(tiny_cfg, seq_len):
  with pytest.raises(ValueError, match="seq_len"):
    flops.flops_per_token(tiny_cfg, seq_len)


def test_param_count_cli_human_units():
  code = ("from experiments.param_count import _fmt; "
          "print(_fmt(999), _fmt(1000), _fmt(18536), _fmt(10**6), _fmt(104 * 10**9), _fmt(2_800 * 10**9), "
          "_fmt(999_499), _fmt(999_500), _fmt(999_999_999))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                       timeout=120).stdout
  assert out.split() == ["999", "1.000K", "18.536K", "1.000M", "104.000B", "2.800T", "999.499K", "1.000M",
                         "1.000B"]  # the largest unit that rounds to >= 1 (999,999,999 was 1000.000M)
