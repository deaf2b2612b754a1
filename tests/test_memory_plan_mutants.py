"""Mutation audit of training/memory_plan.py and training/activation_memory.py: byte counts of a
hand-built state on a sharded mesh, one layer's buffers and the remat policies' combination rule,
each against numbers worked out by hand in the test."""

import math
import re

import jax.numpy as jnp
import pytest
from flax import nnx

from configs import horizon
from model.config import ConfigError, ModelConfig
from model.moe import RouterBias
from training import activation_memory as am
from training import memory_plan as mp

MESH = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}


def _cfg(**changes) -> ModelConfig:
  return ModelConfig.from_config(horizon.get_config("tiny").model).replace(**changes)


class _Ffn(nnx.Module):
  def __init__(self):
    self.w_gate = nnx.Param(jnp.zeros((4, 8, 6), jnp.bfloat16), axes=("expert", "embed", "mlp"))
    self.router_bias = RouterBias(jnp.zeros((4,), jnp.float32), axes=("expert",))


class _Block(nnx.Module):
  def __init__(self):
    self.ffn = _Ffn()


class _Model(nnx.Module):
  """tiny's ffn_kinds: block 0 dense, block 1 MoE, so only blocks[1].ffn.w_gate is a routed expert."""

  def __init__(self):
    self.blocks = nnx.List([_Block(), _Block()])
    self.embed = nnx.Param(jnp.zeros((10, 8), jnp.float32), axes=("vocab", "embed"))
    self.scale = nnx.Param(jnp.zeros((8,), jnp.float32), axes=("norm",))


def test_state_bytes_per_device_by_hand():
  """Per device on fsdp=2, expert=2, tensor=2: embed [10/2, 8/2] f32 = 80 B, scale [8] f32 = 32 B,
  each w_gate [4/2, 8/2, 6/2] bf16 = 48 B, each router bias [4/2] f32 = 8 B."""
  cfg = _cfg()
  assert cfg.ffn_kinds[:2] == ("dense", "moe")
  state = nnx.split(_Model())[1]
  sb = mp.state_bytes(cfg, MESH, state=state)
  assert sb["params"] == 80 + 32 + 48 + 48 + 16
  assert sb["router_bias"] == 16
  assert sb["param_count"] == 80 + 8 + 2 * 192  # global nnx.Param elements, router biases not counted
  assert sb["optimizer"] == 8 * (20 + 8 + 24 + 24)  # mu + nu f32 per local element
  assert sb["gradients"] == 80 + 32 + 48 + 48
  assert sb["routed_experts"] == 48 and sb["routed_expert_elems"] == 24
  assert sb["params_mxfp4"] == 224 - 48 + 24 * 4.25 / 8
  two = mp.state_bytes(cfg, MESH, micro_batches=2, state=state)
  assert two["gradients"] == 2 * 208 and two["optimizer"] == sb["optimizer"] and two["params"] == 224


def test_plan_totals_and_fit_by_hand():
  """global batch 16 / (2 micro-batches x data*fsdp*expert = 4) = 2 local sequences; total = params +
  optimizer + gradients (with accumulator) + activations; fits against 90% of the HBM given."""
  cfg, state = _cfg(), nnx.split(_Model())[1]
  res = mp.plan(cfg, MESH, global_batch=16, seq_len=8, micro_batches=2, state=state, hbm_gib=1.0)
  b = res["bytes"]
  act = am.model_activation_bytes(cfg, am.Local(2, 8, tensor=2, expert=2, fsdp=2, exchange="ragged"),
                                  "none")["total"]
  assert res["local_seqs"] == 2 and res["local_tokens"] == 16 and res["devices"] == 8
  assert b["activations"] == act
  assert b["total"] == 224 + 608 + 416 + act
  assert b["total_mxfp4"] == 224 - 48 + 12.75 + 608 + 416 + act
  assert res["usable_bytes"] == 0.9 * 2 ** 30 and res["fits"] is True
  tight = mp.plan(cfg, MESH, global_batch=16, seq_len=8, micro_batches=2, state=state,
                  hbm_gib=b["total"] / 0.9 / 2 ** 30)
  assert tight["fits"] is True  # total == usable fits
  below = mp.plan(cfg, MESH, global_batch=16, seq_len=8, micro_batches=2, state=state,
                  hbm_gib=(b["total"] - 1) / 0.9 / 2 ** 30)
  assert below["fits"] is False and below["fits_mxfp4"] is True  # MXFP4 saves 35.25 B
  for bad in (0, -1.0, math.nan, math.inf, True, "95"):  # a plan 'DOES NOT FIT' 0 GiB was printed
    with pytest.raises(ConfigError, match=re.escape(f"hbm_gib={bad!r}: the device memory must be")):
      mp.plan(cfg, MESH, global_batch=16, seq_len=8, micro_batches=2, state=state, hbm_gib=bad)
  full = mp.plan(cfg, MESH, global_batch=16, seq_len=8, micro_batches=2, state=state, remat="full")
  assert full["remat"] == "full" and full["bytes"]["activations"] < act  # tiny's own remat is 'none'
  # tiny's expert_exchange 'auto' is 'ragged' on TPU; asking for 'capacity' changes the exchange rows.
  assert res["exchange"] == "ragged" and res["config_exchange"] == "auto"
  cap = mp.plan(cfg, MESH, global_batch=16, seq_len=8, micro_batches=2, state=state, exchange="capacity")
  assert cap["exchange"] == "capacity" and cap["bytes"]["activations"] != act
  one = mp.plan(cfg, {**MESH, "expert": 1}, global_batch=16, seq_len=8, micro_batches=2, state=state)
  assert one["exchange"] == "none (expert axis 1)"


def test_local_batch_divides_by_the_batch_axes_only():
  assert mp.local_batch(48, 3, {"data": 2, "fsdp": 2, "expert": 2, "tensor": 8}) == 2
  with pytest.raises(ValueError, match="--global_batch=8 is not divisible by --micro_batches=1"):
    mp.local_batch(8, 1, {"data": 1, "fsdp": 1, "expert": 16, "tensor": 1})
  with pytest.raises(ValueError, match="--global_batch=8 is not divisible by --micro_batches=3 x"):
    mp.local_batch(8, 3, MESH)  # 8 splits over the 4 batch shards, not over 3 x 4
  for gb, micro in ((0, 1), (4, 0)):
    with pytest.raises(ValueError, match="must be positive integers"):
      mp.local_batch(gb, micro, MESH)


def test_dense_ffn_buffers_by_hand():
  """tiny (f32, d 56, ffn 92) on tensor=2, fsdp=2, 2 x 8 tokens: f = 46, T = 16."""
  mem = am.dense_ffn(_cfg(), am.Local(seqs=2, seq_len=8, tensor=2, fsdp=2))
  assert mem.saved == 2 * 16 * 46 * 4 + 16 * 46 * 4  # gate, up (dot) + silu(g)*u
  assert mem.dots_f32 == 2 * 16 * 46 * 4
  weights = 2 * 3 * 56 * 46 * 4  # all-gathered copy + its gradient before the reduce-scatter
  assert mem.peak_extra == weights + 2 * 16 * 46 * 4  # two cotangents of the largest single residual
  # bf16 compute with f32 params: a bf16 copy of the local weight shard is a residual; save_dots
  # keeps the gate/up outputs in f32; on one device there is no all-gather.
  bf = am.dense_ffn(_cfg(dtype="bfloat16"), am.Local(seqs=2, seq_len=8, tensor=3, fsdp=2))
  f = 92  # 3 does not divide 92: the dim stays whole
  assert bf.saved == 3 * 16 * f * 2 + 3 * 56 * f * 2 // 2
  assert bf.dots_f32 == 2 * 16 * f * 4
  # bf16 all-gathered weights, their f32 gradient before the reduce-scatter, and two cotangents of the
  # largest single residual: one of the three bf16 weight copies, 3 * 56 * 92 * 2 / 2 / 3 B.
  assert bf.peak_extra == 3 * 56 * f * 2 + 3 * 56 * f * 4 + 2 * (3 * 56 * f * 2 // 2 // 3)
  one = am.dense_ffn(_cfg(), am.Local(seqs=1, seq_len=4))
  assert one.peak_extra == 2 * 4 * 92 * 4 and one.saved == 3 * 4 * 92 * 4


def test_cpu_stores_f32_sized_activations():
  cfg = _cfg(dtype="bfloat16")
  tpu = am.lm_head(cfg, am.Local(1, 4, backend="tpu"))
  cpu = am.lm_head(cfg, am.Local(1, 4, backend="cpu"))
  assert tpu.saved == 4 * 56 * 2 + 4 * 331 * 2 + 56 * 331 * 2 * 2  # final norm, logits, head/embed copies
  assert cpu.saved == 4 * 56 * 4 + 4 * 331 * 4 + 56 * 331 * 4 * 2


def _layer(name, saved, dot, work, weights):
  bufs = (am.Buf("s", saved, "saved"), am.Buf("d", dot, "dot"), am.Buf("w", work, "work"),
          am.Buf("g", weights, "weights"))
  return am.LayerMemory(name, bufs, 2)


@pytest.mark.parametrize("remat,kept,peak", [
    # x_in = T * d * 4 = 2 * 56 * 4 = 448 per block (tiny is f32).
    # a: saved 220, peak_extra = weights 7 + 2 x its largest residual 200 = 407;
    # b: saved 50, peak_extra = max(work 500, 2 x 40) = 500.
    ("none", 448 + 220 + 448 + 50, 500),  # everything kept; b's transient is the larger
    ("full", 2 * 448, 220 + 407),  # block inputs kept; a rebuilt (627 > b's 550)
    ("save_dots", 2 * 448 + 2 * 20 + 2 * 40, 220 + 407),  # + the dots, kept in f32 (x 4 / 2)
])
def test_remat_policies_combine_blocks_by_hand(monkeypatch, remat, kept, peak):
  a = _layer("a", 200, 20, 0, 7)
  b = _layer("b", 10, 40, 500, 0)
  head = _layer("head", 30, 0, 60, 0)  # its peak: saved 30 + max(60, 2 * 30)
  monkeypatch.setattr(am, "block_layers", lambda cfg, loc: [a, b])
  monkeypatch.setattr(am, "lm_head", lambda cfg, loc: head)
  res = am.model_activation_bytes(_cfg(), am.Local(1, 2), remat)
  assert res["kept"] == kept and res["peak_block"] == peak and res["head"] == 90
  assert res["total"] == kept + max(peak, 90)
  big_head = _layer("head", 3000, 0, 0, 0)
  monkeypatch.setattr(am, "lm_head", lambda cfg, loc: big_head)
  assert am.model_activation_bytes(_cfg(), am.Local(1, 2), remat)["total"] == kept + 9000


def test_exchange_and_local_checks():
  assert am.resolve_exchange("auto", "tpu") == am.resolve_exchange("auto", "gpu") == "ragged"
  assert am.resolve_exchange("auto", "cpu") == "capacity"
  assert am.resolve_exchange("capacity", "tpu") == "capacity"
  with pytest.raises(ValueError, match="seqs=0"):
    am.Local(0, 4)
  with pytest.raises(ValueError, match="resolve 'auto'"):
    am.Local(1, 4, exchange="auto")
  with pytest.raises(ValueError, match="--remat='some'"):
    am.model_activation_bytes(_cfg(), am.Local(1, 4), "some")


def test_seq_len_may_be_max_seq_len():
  cfg, state = _cfg(), nnx.split(_Model())[1]
  assert mp.plan(cfg, MESH, global_batch=4, seq_len=256, state=state)["local_tokens"] == 256
  with pytest.raises(ValueError, match=r"^--seq_len=257 must be in \[1, config.model.max_seq_len=256\]"):
    mp.plan(cfg, MESH, global_batch=4, seq_len=257, state=state)


def test_validate_size_counts_params_three_times(monkeypatch):
  """Parameters, their gradients and one more copy (3 x 100 B) + activations (50 B) against the limit."""
  monkeypatch.setattr(mp, "state_bytes", lambda cfg, mesh: {"params": 100})
  monkeypatch.setattr(am, "model_activation_bytes", lambda cfg, loc, remat: {"total": 50})
  monkeypatch.setattr(mp, "VALIDATE_LIMIT", 350)
  mp.check_validate_size(_cfg(), 1, 32)
  monkeypatch.setattr(mp, "VALIDATE_LIMIT", 349)
  with pytest.raises(ValueError, match="--validate skipped: needs 0.0 GiB"):
    mp.check_validate_size(_cfg(), 1, 32)


def test_expert_parallel_rows_and_local_expert_weights_by_hand():
  """tiny (f32, d 56, 8 experts of width 26, top-2) on expert=2, fsdp=2: 1 x 5 tokens -> A = 10
  assignments; 'ragged' receives the worst case 2 x 10 rows; each device gathers its 4 experts."""
  cfg = _cfg()
  rows, bufs = am._ep_rows(cfg, am.Local(1, 5, expert=2), 10)
  assert rows == 20
  assert {b.name: b.nbytes for b in bufs}["ragged send [A,d] + receive [ep*A,d]"] == (10 + 20) * 56 * 4
  mem = am.moe_ffn(cfg, am.Local(1, 5, expert=2, fsdp=2)).breakdown()
  assert mem["routed experts (fsdp all-gather)"] == 3 * 4 * 56 * 26 * 4
  assert mem["expert rows in [R,d]"] == 20 * 56 * 4


def test_attention_stage_boundaries_and_delta_chunk_padding():
  """tiny: top-16 covers every key of a 16-token sequence (dense MQA), not of 17 (sparse stage);
  with dsa_dense_len 32 a 32-token sequence runs under the top-k mask. Delta (4 value heads, qk 10,
  v 6, chunks of 8) pads 5 tokens to one whole chunk."""
  dense, probs = "probs f32 + compute-dtype copy [T,H,S]", "top-k score tile"
  assert dense in am.dsa_attention(_cfg(), am.Local(1, 16)).breakdown()
  assert probs in am.dsa_attention(_cfg(), am.Local(1, 17)).breakdown()
  masked = am.dsa_attention(_cfg(dsa_dense_len=32), am.Local(1, 32)).breakdown()
  assert masked["top-k mask [T,S] + its int32 order keys"] == 32 * 32 * 5
  delta = am.delta_attention(_cfg(), am.Local(1, 5)).breakdown()
  assert delta["chunk-start states f32 [T/c,H,kd,vd]"] == 1 * 4 * 10 * 6 * 4
  assert delta["chunked q, k, v f32"] == 8 * 4 * (2 * 10 + 6) * 4
