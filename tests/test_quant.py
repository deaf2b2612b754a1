"""MXFP4 weights inside the model (model/quant.py) and experiments/quantize.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import horizon
from model.config import ModelConfig
from model.decoder import abstract_model, build_model
from model.quant import MXFP4Weight, quantize_model
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


def test_all_linear_quantizes_every_lm_linear_but_keeps_embed_head_router():
  cfg = _cfg()
  m = abstract_model(cfg)
  paths = quantize_model(m, "all-linear")
  assert any("w_dq" in p for p in paths) and any("w_o" in p for p in paths)
  assert not any(p.endswith(("embed", "head", "w_router", "conv_w")) for p in paths)
  assert not any(p.startswith("vision") for p in paths)
  assert isinstance(m.head, nnx.Param) and isinstance(m.blocks[0].attn.w_dq, MXFP4Weight)


def test_dims_not_divisible_by_32_are_a_clear_error():
  m = abstract_model(ModelConfig.from_config(horizon.get_config("tiny").model))
  with pytest.raises(ValueError, match="divisible by 32"):
    quantize_model(m, "experts")
  with pytest.raises(ValueError, match="what="):
    quantize_model(m, "everything")


def test_quantize_script_round_trip(tmp_path):
  """Dense checkpoint -> quantize -> load_model gives the quantized model; bad inputs write nothing."""
  from training import quantize
  from training.checkpoint import Checkpointer, CheckpointError, load_model, read_meta

  config = horizon.get_config("tiny")
  cfg = _cfg()
  for k in ("d_model", "expert_dim", "dense_ffn_dim", "q_lora_rank", "kv_lora_rank"):
    config.model[k] = getattr(cfg, k)
  dense = build_model(cfg, seed=5)
  src = tmp_path / "dense"
  with Checkpointer(src, every=1, keep=1, async_save=False) as ck:
    ck.save(7, model=dense, config=config, force=True)
  out = tmp_path / "mx"
  summary = quantize.convert(str(src), str(out))
  assert summary["quantized_weights"] == 3 * sum(k == "moe" for k in cfg.ffn_kinds)
  assert summary["bytes_after"] < summary["bytes_before"]
  meta = read_meta(out)
  assert meta["step"] == 7 and meta["config"]["model"]["quantization"] == "experts"
  qcfg = _cfg(quantization="experts")
  loaded = load_model(out, qcfg)
  ref = build_model(cfg, seed=5)
  quantize_model(ref, "experts")
  tok = _tokens(cfg, (1, 11), 6)
  np.testing.assert_array_equal(np.asarray(_forward(loaded, tok)), np.asarray(_forward(ref, tok)))
  # Bad inputs: missing checkpoint, existing output, already quantized, indivisible dims.
  with pytest.raises(CheckpointError, match="does not exist"):
    quantize.convert(str(tmp_path / "nope"), str(tmp_path / "o1"))
  with pytest.raises(CheckpointError, match="not empty"):
    quantize.convert(str(src), str(out))
  with pytest.raises(CheckpointError, match="already quantized"):
    quantize.convert(str(out), str(tmp_path / "o2"))
  tiny_src = tmp_path / "tiny"
  with Checkpointer(tiny_src, every=1, keep=1, async_save=False) as ck:
    ck.save(1, model=build_model(ModelConfig.from_config(horizon.get_config("tiny").model)),
            config=horizon.get_config("tiny"), force=True)
  with pytest.raises(ValueError, match="divisible by 32"):
    quantize.convert(str(tiny_src), str(tmp_path / "o3"))
  # A checkpoint that stores no config, converted with a config of other shapes.
  bare = tmp_path / "bare"
  with Checkpointer(bare, every=1, keep=1, async_save=False) as ck:
    ck.save(2, model=dense, force=True)
  with pytest.raises(CheckpointError, match="different config"):
    quantize.convert(str(bare), str(tmp_path / "o4"), fallback_config=horizon.get_config("tiny"))
  for name in ("o1", "o2", "o3", "o4"):
    assert not (tmp_path / name).exists()
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


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
