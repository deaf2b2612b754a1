"""The converter (training/quantize.py, experiments/quantize.py): checkpoint -> MXFP4 -> load -> serve.

Two `tiny` checkpoints: stock tiny (no width a multiple of 32: every tensor is
kept dense, each with its reason) and a mixed one (d_model 64, expert_dim 32,
the rest tiny's), in which some weights are quantized along K, some along
another axis and some stay dense.
"""

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import horizon, pretrain, serve
from model.config import ModelConfig
from model.decoder import build_model
from model.quant import MXFP4Weight, quantized_bytes
from tests.helpers import assert_close, rel_err
from training import quantize
from training.checkpoint import Checkpointer, CheckpointError, load_model, read_meta

ROW = re.compile(r"^(.*?)\s{2,}(\d+)\s{2}(.*)$")  # table row: name, count, the rest
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 300, 23)]


def _save(path, config, seed=5, step=7):
  cfg = ModelConfig.from_config(config.model)
  with Checkpointer(path, every=1, keep=1, async_save=False) as ck:
    ck.save(step, model=build_model(cfg, seed=seed), config=config, force=True)
  return cfg


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  """{'tiny': (dir, cfg), 'mixed': (dir, cfg)}: dense checkpoints of pretrain configs."""
  root = tmp_path_factory.mktemp("quantize")
  tiny = pretrain.get_config("tiny")
  mixed = pretrain.get_config("tiny")
  mixed.model.d_model, mixed.model.expert_dim = 64, 32
  return {"tiny": (root / "tiny", _save(root / "tiny", tiny)),
          "mixed": (root / "mixed", _save(root / "mixed", mixed))}


@pytest.fixture(scope="module", params=["experts", "all-linear"])
def converted(request, ckpts, tmp_path_factory):
  src, cfg = ckpts["mixed"]
  out = tmp_path_factory.mktemp("mx") / request.param
  return request.param, out, cfg, quantize.convert(str(src), str(out), request.param)


@nnx.jit
def _logits(model, tokens):
  return model(tokens)[0]


def _mxfp4_paths(model):
  return sorted("/".join(map(str, p)) for p, v in nnx.iter_graph(model) if isinstance(v, MXFP4Weight))


def test_output_loads_with_exactly_the_planned_mxfp4_tensors(converted):
  what, out, cfg, done = converted
  planned = sorted(d.path for d in done.decisions if d.mxfp4)
  meta = read_meta(out)
  assert meta["step"] == 7 and meta["config"]["model"]["quantization"] == what
  assert sorted(meta["config"]["quantize"]["mxfp4"]) == planned
  loaded = load_model(out, cfg.replace(quantization=what))
  assert _mxfp4_paths(loaded) == planned
  # The routed experts are MXFP4 for both --what values (d_model 64, expert_dim 32), really packed.
  n_moe = sum(k == "moe" for k in cfg.ffn_kinds)
  assert sum(p.endswith(("ffn/w_gate", "ffn/w_up", "ffn/w_down")) and "shared" not in p
             for p in planned) >= 3 * n_moe
  moe = loaded.blocks[1].ffn
  assert isinstance(moe.w_gate, MXFP4Weight) and moe.w_gate.blocks.dtype == jnp.uint8
  assert moe.w_gate.blocks.shape == (8, 32, 64 // 32, 16) and moe.w_down.scales.shape == (8, 64, 1)
  if what == "experts":
    assert len(planned) == 3 * n_moe and isinstance(loaded.blocks[0].attn.w_dq, nnx.Param)
  else:
    assert isinstance(loaded.blocks[0].attn.w_dq, MXFP4Weight) and len(planned) > 3 * n_moe
  # The totals are the bytes the model really holds.
  sizes = quantized_bytes(loaded)
  assert done.summary["mxfp4_bytes"] == sizes["mxfp4"]
  assert done.summary["bytes_after"] == sizes["mxfp4"] + sizes["other"] < done.summary["bytes_before"]


def test_quantized_checkpoint_serves_close_to_the_dense_one(converted, ckpts):
  """The engine serves the MXFP4 checkpoint and its logits are the dense model's with the dequantized
  weights put in (f32 tolerance: loading and serving add nothing).

  How far from the dense model's may they be? MXFP4 moves each weight by eps_w = ||W_q - W|| / ||W||
  (~0.1 for Gaussian weights, floor scales), but a 4-layer random model with routing and top-k
  amplifies a weight error several-fold (all-linear: logits ~4 eps_w off), so eps_w itself is no
  bound. The right yardstick is noise of the same size: the same dense model with each quantized
  weight perturbed by Gaussian noise of the same Frobenius norm as its MXFP4 error. Rounding to
  MXFP4 is such noise (zero-mean, in independent blocks) and lands within [0.5, 1.5] x its effect
  (measured 0.9-1.2 over seeds); a wrong layout, scale or axis would be an error of ~||W||, far above."""
  from serving.build import build_engine
  from serving.engine import Engine, Request
  from serving.types import SamplingParams
  what, out, cfg, done = converted
  dense = load_model(ckpts["mixed"][0], cfg)
  config = serve.get_config("tiny")
  config.serving.update(slots=1, max_context=48, prefill_chunk=16)
  engine = build_engine(config, str(out))
  twin = Engine(engine.model, engine.tokenizer, slots=1, max_context=48, prefill_chunk=16)
  assert all(twin._fns[k] is engine._fns[k] for k in engine._fns)  # shared, as dense engines' are
  got = engine.next_token_logits(PROMPT)
  ids, reason, _ = engine.generate(Request(PROMPT, SamplingParams(max_tokens=5, temperature=0.0)))
  assert 1 <= len(ids) <= 5 and reason in ("length", "stop"), (ids, reason)
  snapped, noisy = nnx.clone(dense), [nnx.clone(dense) for _ in range(3)]
  key, num, den = jax.random.key(100), 0.0, 0.0
  for path in (d.path for d in done.decisions if d.mxfp4):
    *mods, name = path.split("/")
    w_q, w = getattr(_module(engine.model, mods), name)[...], getattr(_module(dense, mods), name)[...]
    getattr(_module(snapped, mods), name)[...] = w_q
    sigma = float(jnp.linalg.norm(w_q - w)) / w.size ** 0.5
    for model in noisy:
      key, k = jax.random.split(key)
      getattr(_module(model, mods), name)[...] = w + sigma * jax.random.normal(k, w.shape, w.dtype)
    num, den = num + float(jnp.sum((w_q - w) ** 2)), den + float(jnp.sum(w ** 2))
  assert 0.02 < (num / den) ** 0.5 < 0.3  # eps_w: the weights really are 4-bit (bf16 would be ~0.003)
  tok = jnp.asarray([PROMPT])
  quantized, want = _logits(snapped, tok), _logits(dense, tok)
  assert_close(got, quantized[0, -1], what=f"{what}: engine vs dense model with the dequantized weights")
  err = rel_err(quantized, want)
  noise = float(np.mean([rel_err(_logits(m, tok), want) for m in noisy]))
  assert 0.5 * noise <= err <= 1.5 * noise, (err, noise)


def _module(model, parts):
  for p in parts:
    model = model[int(p)] if p.isdigit() else getattr(model, p)
  return model


def test_stock_tiny_keeps_every_tensor_dense_with_its_reason(ckpts, tmp_path):
  src, cfg = ckpts["tiny"]
  done = quantize.convert(str(src), str(tmp_path / "mx"), "all-linear")
  assert not any(d.mxfp4 for d in done.decisions) and done.summary["quantized_weights"] == 0
  lines = quantize.table(done.decisions).splitlines()
  rows = [ROW.match(ln).groups() for ln in lines[1:-1]]
  # One row per weight over its layers (layers merged), each with the reason; counts add up.
  assert sum(int(n) for _, n, _ in rows) == len(done.decisions)
  for d in done.decisions:
    if not d.path.startswith("vision/") and len(d.shape) > 1:
      weight = d.path.split("/", 2)[-1] if d.path.startswith("blocks/") else d.path
      assert [r for r in rows if r[0].endswith(weight) and d.reason in r[2]], (d.path, d.reason)
  text = "\n".join(lines)
  assert "K=38 not a multiple of 32, nor any other axis" in text and "lightning indexer" in text
  assert ("blocks/{0,2}/attn/w_uq", "2") == rows[[r[0] for r in rows].index("blocks/{0,2}/attn/w_uq")][:2]
  assert lines[-1].startswith(f"total: {len(done.decisions)} tensors, 0 MXFP4")
  # It loads; MoE runs the XLA experts (the fused MXFP4 MoE kernel reads MXFP4 experts only).
  meta = read_meta(tmp_path / "mx")
  assert meta["config"]["model"]["kernels"] == "xla" and meta["config"]["quantize"]["mxfp4"] == []
  assert not _mxfp4_paths(load_model(tmp_path / "mx", cfg.replace(quantization="all-linear", kernels="xla")))


def test_heldout_loss_before_and_after(ckpts, tmp_path):
  """eval_tokens: mean next-token CE on windows of the held-out text, before and after quantizing."""
  src, cfg = ckpts["mixed"]
  done = quantize.convert(str(src), str(tmp_path / "mx"), "experts", eval_tokens=300)
  h = done.summary["heldout"]
  seq = pretrain.get_config("tiny").train.seq_len
  assert h["tokens"] == 2 * seq  # whole windows of the run's seq_len: 300 // 128 = 2
  windows = quantize.heldout_windows(read_meta(src)["config"], cfg, 300)
  logits = _logits(load_model(src, cfg), jnp.asarray(windows[:, :-1]))
  lg = np.asarray(logits, np.float64)
  logz = lg.max(-1) + np.log(np.sum(np.exp(lg - lg.max(-1, keepdims=True)), axis=-1))
  want = np.mean(logz - np.take_along_axis(lg, windows[:, 1:, None], axis=-1)[..., 0])
  np.testing.assert_allclose(h["loss_before"], want, rtol=1e-5)
  assert h["loss_after"] != h["loss_before"] and abs(h["delta"]) < 0.5
  assert h["delta"] == h["loss_after"] - h["loss_before"]


def test_bad_inputs_name_the_field_and_leave_nothing(ckpts, tmp_path):
  src, cfg = ckpts["mixed"]
  quantize.convert(str(ckpts["tiny"][0]), str(tmp_path / "done"))  # quick: nothing to quantize
  with pytest.raises(CheckpointError, match="does not exist"):
    quantize.convert(str(tmp_path / "nope"), str(tmp_path / "o1"))
  (tmp_path / "o2").mkdir()
  (tmp_path / "o2" / "keep").write_text("x")
  with pytest.raises(CheckpointError, match="not empty"):
    quantize.convert(str(src), str(tmp_path / "o2"))
  for inside in (src / "70", src / "x" / "y"):  # a numeric name became a step of src, blocking its readers
    with pytest.raises(CheckpointError, match=r"is inside \(or holds\) --checkpoint=.*directory of its own"):
      quantize.convert(str(src), str(inside))
  assert not (src / "70").exists() and not (src / "x").exists()
  with pytest.raises(CheckpointError, match="already quantized"):
    quantize.convert(str(tmp_path / "done"), str(tmp_path / "o3"))
  with pytest.raises(CheckpointError, match="--eval_tokens=-1"):
    quantize.convert(str(src), str(tmp_path / "o4"), eval_tokens=-1)
  with pytest.raises(CheckpointError, match="--eval_tokens=5 .*seq_len"):
    quantize.convert(str(src), str(tmp_path / "o5"), eval_tokens=5)
  # A checkpoint that stores no config, converted with a config of other shapes.
  bare = tmp_path / "bare"
  with Checkpointer(bare, every=1, keep=1, async_save=False) as ck:
    ck.save(2, model=build_model(cfg, seed=1), force=True)
  with pytest.raises(CheckpointError, match="different config"):
    quantize.convert(str(bare), str(tmp_path / "o6"), fallback_config=horizon.get_config("tiny"))
  assert [p.name for p in (tmp_path / "o2").iterdir()] == ["keep"]
  for name in ("o1", "o3", "o4", "o5", "o6"):
    assert not (tmp_path / name).exists()
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_out_that_is_a_file_is_refused(tmp_path):
  """--out naming an existing file is a CheckpointError naming --out (not a NotADirectoryError)."""
  out = tmp_path / "out.txt"
  out.write_text("x")
  with pytest.raises(CheckpointError, match=r"--out=.*out\.txt is a file; choose a new directory"):
    quantize.convert(str(tmp_path), str(out))  # the output is checked before the input is read
  assert out.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_launcher_prints_the_table_and_a_json_line(ckpts, tmp_path):
  src, _ = ckpts["mixed"]
  out = tmp_path / "mx"
  r = subprocess.run([sys.executable, "-m", "experiments.quantize", f"--checkpoint={src}", f"--out={out}",
                      "--what=all-linear"], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  lines = r.stdout.strip().splitlines()
  summary = json.loads(lines[-1])
  assert summary["out"] == str(out) and summary["what"] == "all-linear" and summary["mxfp4_tensors"] > 0
  assert lines[0].split()[:3] == ["tensor", "n", "shape"] and lines[-2].startswith("total: ")
  assert any("mxfp4" in ln and "blocks along axis" in ln for ln in lines)  # e.g. DSA w_o, K=14
  assert any(ln.startswith("blocks/{0,2}/attn/w_uq") and "K=38" in ln for ln in lines)
  assert "wrote" not in r.stdout  # chatter goes to the log, not stdout
