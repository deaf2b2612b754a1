"""MXFP4 weights inside the model (model/quant.py): layout, per-tensor plan, forward equality.

The converter (training/quantize.py, experiments/quantize.py) is tested in test_quantize_cli.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import horizon
from model.config import ModelConfig
from model.decoder import abstract_model, build_model
from model.quant import INDEXER_WEIGHTS, MXFP4Weight, plan, quantize_model
from pallas_kernels.mxfp4 import format as mx
from tests.helpers import assert_close


def _cfg(**over) -> ModelConfig:
  """tiny with the dims MXFP4 needs (multiples of 32 along contraction axes)."""
  m = horizon.get_config("tiny").model
  m.d_model, m.expert_dim, m.dense_ffn_dim = 64, 32, 96
  m.q_lora_rank, m.kv_lora_rank = 32, 32
  for k, v in over.items():
    setattr(m, k, v)
  cfg = ModelConfig.from_config(m)
  cfg.validate()
  return cfg


@nnx.jit
def _forward(model, tokens):
  return model(tokens)[0]


def _tokens(cfg, shape, seed):
  return jax.random.randint(jax.random.key(seed), shape, 0, cfg.vocab_size - 1)


@pytest.fixture(scope="module")
def dense_and_quantized():
  cfg = _cfg()
  dense = build_model(cfg, seed=3)
  q = build_model(cfg, seed=3)
  paths = quantize_model(q, "experts")
  return cfg, dense, q, paths


def test_experts_are_stored_in_gpt_oss_layout(dense_and_quantized):
  cfg, dense, q, paths = dense_and_quantized
  moe_layers = sum(k == "moe" for k in cfg.ffn_kinds)
  assert len(paths) == 3 * moe_layers
  moe = next(b.ffn for b in q.blocks if b.ffn_kind == "moe")
  dmoe = next(b.ffn for b in dense.blocks if b.ffn_kind == "moe")
  e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
  assert isinstance(moe.w_gate, MXFP4Weight) and not isinstance(moe.w_gate, nnx.Param)
  assert moe.w_gate.blocks.shape == (e, f, d // 32, 16) and moe.w_gate.blocks.dtype == jnp.uint8
  assert moe.w_gate.scales.shape == (e, f, d // 32)
  assert moe.w_down.blocks.shape == (e, d, f // 32, 16)
  # Reading it dequantizes to the dense layout, equal to quantize->dequantize of the weight.
  want = jnp.moveaxis(mx.dequantize(*mx.quantize(dmoe.w_gate[...], axis=1)), -1, 1)
  np.testing.assert_array_equal(np.asarray(moe.w_gate[...]), np.asarray(want))
  # Shared experts and the router stay dense; MXFP4 weights are not trainable params.
  assert isinstance(moe.w_router, nnx.Param) and isinstance(moe.shared.w_gate, nnx.Param)
  params = jax.tree.leaves(nnx.state(q, nnx.Param))
  assert all(p.dtype != jnp.uint8 for p in params)


def test_quantized_model_equals_dense_model_with_dequantized_experts(dense_and_quantized):
  """The MXFP4 model computes exactly the dense model whose experts hold the dequantized values."""
  cfg, dense, q, _ = dense_and_quantized
  snapped = build_model(cfg, seed=3)
  for blk, qblk in zip(snapped.blocks, q.blocks, strict=True):
    if blk.ffn_kind == "moe":
      for name in ("w_gate", "w_up", "w_down"):
        getattr(blk.ffn, name)[...] = getattr(qblk.ffn, name)[...]
  tok = _tokens(cfg, (2, 13), 1)
  ld, lq, ls = _forward(dense, tok), _forward(q, tok), _forward(snapped, tok)
  assert_close(lq, ls, what="MXFP4 model vs dense model with dequantized experts")
  assert float(jnp.max(jnp.abs(lq - ld))) > 1e-3  # quantization did change the weights


def test_pallas_expert_path_equals_dequantized_path(dense_and_quantized):
  """kernels='pallas' reads the packed bytes in the fused kernel; 'xla' dequantizes first."""
  cfg, _, q, _ = dense_and_quantized
  tok = _tokens(cfg, (2, 9), 2)
  moe_x = next(b.ffn for b in q.blocks if b.ffn_kind == "moe")
  x = jax.random.normal(jax.random.key(4), (2, 9, cfg.d_model), jnp.float32)
  y_xla, _ = nnx.jit(lambda m, x: m(x))(moe_x, x)
  moe_x.cfg = _cfg(kernels="pallas", quantization="experts")
  try:
    y_pl, _ = nnx.jit(lambda m, x: m(x))(moe_x, x)
  finally:
    moe_x.cfg = cfg
  assert_close(y_pl, y_xla, what="MoE with MXFP4 experts: pallas vs xla")
  del tok


def test_all_linear_quantizes_every_lm_linear_but_keeps_embed_head_router_indexer():
  cfg = _cfg()
  m = abstract_model(cfg)
  decisions = {d.path: d for d in plan(m, "all-linear")}
  paths = quantize_model(m, "all-linear")
  assert paths == [p for p, d in decisions.items() if d.mxfp4]
  assert any("w_dq" in p for p in paths) and any("w_o" in p for p in paths)
  assert not any(p.endswith(("embed", "head", "w_router", "conv_w")) for p in paths)
  assert not any(p.startswith("vision") for p in paths)
  assert isinstance(m.head, nnx.Param) and isinstance(m.blocks[0].attn.w_dq, MXFP4Weight)
  # The lightning indexer stays dense, on purpose and said so.
  dsa = m.blocks[0].attn
  for name in INDEXER_WEIGHTS:
    assert isinstance(getattr(dsa, name), nnx.Param)
    assert decisions[f"blocks/0/attn/{name}"].reason.startswith("lightning indexer")
  # DSA w_o [h, v=14, d=64]: K=14 is not a multiple of 32, so its blocks run along d (noted).
  w_o = decisions["blocks/0/attn/w_o"]
  assert w_o.axis == 2 and "K=14" in w_o.reason and dsa.w_o.get_metadata()["axis"] == 2
  assert dsa.w_o.blocks.shape == (3, 14, 64 // 32, 16)


def test_all_linear_runs_with_bfloat16_compute():
  """`small` computes in bf16: every dequantized weight must feed its dot (XLA:CPU once rejected
  MLA's w_uk, a batched 'bthk,chk->bthc', read through the dequantize's moveaxis)."""
  cfg = _cfg(dtype="bfloat16")
  model = build_model(cfg, seed=3)
  quantize_model(model, "all-linear")
  assert isinstance(model.blocks[0].attn.w_uk, MXFP4Weight)
  logits = _forward(model, _tokens(cfg, (2, 13), 5))
  assert logits.shape == (2, 13, cfg.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))


def test_tiny_dims_are_skipped_with_a_reason_per_tensor():
  """Stock tiny (widths 56, 26, 38, ...): every tensor stays dense and says why; the model still builds."""
  cfg = ModelConfig.from_config(horizon.get_config("tiny").model)
  for what in ("experts", "all-linear"):
    decisions = plan(abstract_model(cfg), what)
    assert decisions and not any(d.mxfp4 for d in decisions) and all(d.reason for d in decisions)
    by_path = {d.path: d.reason for d in decisions}
    assert "w_down K=26" in by_path["blocks/1/ffn/w_down"] and "w_gate K=56" in by_path["blocks/1/ffn/w_gate"]
    want = "K=38 not a multiple of 32" if what == "all-linear" else "not selected by --what=experts"
    assert want in by_path["blocks/0/attn/w_uq"]
    assert by_path["embed"].startswith("token embedding") and by_path["head"].startswith("LM head")
    q = abstract_model(cfg.replace(quantization=what))  # what load_model builds for such a checkpoint
    assert not any(isinstance(v, MXFP4Weight) for _, v in nnx.iter_graph(q))
  with pytest.raises(ValueError, match="what="):
    plan(abstract_model(cfg), "everything")


def test_dense_experts_on_the_fused_kernel_path_are_a_clear_error():
  """MoE with kernels=pallas reads MXFP4 experts only: dense ones (tiny) must fail early, naming the fix."""
  cfg = ModelConfig.from_config(horizon.get_config("tiny").model)
  with pytest.raises(ValueError, match="kernels='xla'"):
    abstract_model(cfg.replace(quantization="experts", kernels="pallas"))


def test_mixed_dims_quantize_only_what_divides():
  """d_model 64 but expert_dim 26: the routed experts stay dense together, the 64-wide linears do not."""
  cfg = _cfg(expert_dim=26)
  decisions = {d.path: d for d in plan(abstract_model(cfg), "all-linear")}
  for name in ("w_gate", "w_up", "w_down"):
    d = decisions[f"blocks/1/ffn/{name}"]
    assert not d.mxfp4 and "w_down K=26" in d.reason and "w_gate K=" not in d.reason
  assert decisions["blocks/1/ffn/shared/w_gate"].mxfp4 and decisions["blocks/0/attn/w_dq"].mxfp4
  d = decisions["blocks/0/attn/w_dq"]
  assert (d.bits_per_weight, d.bytes_after * 32) == (4.25, d.elements * 17)


def test_mxfp4_experts_run_expert_parallel_with_the_kernel():
  """On an expert-parallel mesh the fused kernel runs on each device's expert shards."""
  from sharding import mesh as mesh_lib

  cfg = _cfg(kernels="pallas", quantization="experts", capacity_factor=8.0)
  model = build_model(cfg, seed=7)
  moe = next(b.ffn for b in model.blocks if b.ffn_kind == "moe")
  x = jax.random.normal(jax.random.key(8), (8, 5, cfg.d_model), jnp.float32)
  call = nnx.jit(lambda m, x: m(x))
  y_one, aux_one = call(moe, x)
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 1, "expert": 4, "tensor": 1})
  with mesh_lib.activate(mesh):
    y_ep, aux_ep = call(moe, x)
    jaxpr = str(jax.make_jaxpr(lambda x: moe(x))(x))
  assert float(aux_ep["dropped"]) == 0.0
  assert_close(y_ep, y_one, what="MXFP4 MoE: expert-parallel (2,1,4,1) vs one device")
  assert "shard_map" in jaxpr and "pallas_call" in jaxpr
  del aux_one
