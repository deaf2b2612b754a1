"""Scan over layers (model/scan.py): the plan, the same maths as the unrolled stack (forward,
gradients, routing replay, the train step, an expert-parallel mesh), and a trace whose size does
not grow with depth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from configs import horizon
from model.config import ModelConfig
from model.decoder import Horizon, abstract_model, build_model
from model.scan import LayerPlan, layer_plan
from sharding import mesh as mesh_lib
from sharding import rules as rules_lib
from sharding.state import create_sharded_model
from tests.helpers import RTOL, assert_close, model_like, rel_err, text_tokens


def _tiny(**changes) -> ModelConfig:
  return ModelConfig.from_config(horizon.get_config("tiny").model).replace(**changes)


# 8 layers: dense-FFN DSA, three scanned units (Delta+MoE, DSA+MoE), one unrolled Delta+MoE.
CFG8 = dict(num_layers=8, dsa_period=2, num_dense_layers=1)




def test_layer_plan():
  full = ModelConfig.from_config(horizon.get_config("full").model)
  assert full.scan_layers and layer_plan(full) == LayerPlan(3, 4, 22)  # layers 3..90; 91, 92 unrolled
  assert layer_plan(full.replace(scan_layers=False)).repeats == 0
  assert layer_plan(_tiny(scan_layers=True)).repeats == 0  # one unit after the dense layer: nothing to scan
  assert layer_plan(_tiny(scan_layers=True, **CFG8)) == LayerPlan(1, 2, 3)
  plan = layer_plan(_tiny(scan_layers=True, num_layers=12, dsa_period=3, num_dense_layers=2))
  assert (plan.start, plan.period, plan.repeats, plan.stop) == (2, 3, 3, 11)


@pytest.fixture(scope="module")
def unrolled():
  return build_model(_tiny(**CFG8), seed=5)


@nnx.jit
def _loss_and_grads(m, tok, pos, seg, routing, mask):
  def loss(m):
    logits, aux = m(tok, pos, seg, routing=routing, routing_mask=mask)
    lse = jax.nn.logsumexp(logits[:, :-1], -1)
    ce = jnp.mean(lse - jnp.take_along_axis(logits[:, :-1], tok[:, 1:, None], -1)[..., 0])
    return ce + aux["indexer_loss"] + 1e-2 * aux["z_loss"] + 1e-2 * aux["seq_aux_loss"], (logits, aux)
  return nnx.value_and_grad(loss, has_aux=True)(m)


def _packed(cfg):
  """Two rows, the second packing two documents (positions restart, segment ids change)."""
  tok = text_tokens(cfg, (2, 23), 1)
  pos = jnp.asarray(np.stack([np.arange(23), np.r_[np.arange(10), np.arange(13)]]), jnp.int32)
  seg = jnp.asarray(np.stack([np.ones(23), np.r_[np.ones(10), 2 * np.ones(13)]]), jnp.int32)
  return tok, pos, seg


def _run(model, cfg, routing=None, mask=None):
  tok, pos, seg = _packed(cfg)
  (loss, (logits, aux)), grads = _loss_and_grads(model_like(model, cfg), tok, pos, seg, routing, mask)
  return loss, logits, aux, jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))


@pytest.fixture(scope="module")
def grad_noise(unrolled):
  """Per-leaf f32 rounding noise of the gradients: the unrolled stack under remat='full' (the same
  maths, fused differently) against remat='none'. The delta layers' A_log / dt_bias gradients (sums
  over every position of products of decays) move by ~4e-5 relative under such rewrites."""
  *_, g0 = _run(unrolled, unrolled.cfg)
  *_, g1 = _run(unrolled, unrolled.cfg.replace(remat="full"))
  return [rel_err(b, a) for (_, a), (_, b) in zip(g0, g1, strict=True)]


def _compare(unrolled_model, remat, noise, routing=None, mask=None):
  """The scanned stack against the unrolled one: loss, logits, aux and the whole gradient at f32
  tolerance; each gradient leaf within f32 tolerance or 3x that leaf's rounding noise."""
  cfg = unrolled_model.cfg
  l0, lg0, a0, g0 = _run(unrolled_model, cfg, routing, mask)
  l1, lg1, a1, g1 = _run(unrolled_model, cfg.replace(remat=remat, scan_layers=True), routing, mask)
  assert_close(l1, l0, what="loss")
  assert_close(lg1, lg0, what="logits")
  for k in ("indexer_loss", "z_loss", "seq_aux_loss", "load"):
    assert_close(a1[k], a0[k], what=k)
  np.testing.assert_array_equal(a1["routed"], a0["routed"])
  assert len(g0) == len(g1) == len(noise) > 0
  flat = lambda g: np.concatenate([np.ravel(x) for _, x in g])  # noqa: E731
  assert_close(flat(g1), flat(g0), what="all gradients")
  for (path, r), (_, g), n in zip(g0, g1, noise, strict=True):
    assert rel_err(g, r) <= max(RTOL["float32"], 3 * n), (
        f"grad {jax.tree_util.keystr(path)}: {rel_err(g, r):.3g} vs rounding noise {n:.3g}")
  return a0


@pytest.mark.parametrize("remat", ["none", "save_dots"])
def test_scan_matches_unrolled(unrolled, grad_noise, remat):
  _compare(unrolled, remat, grad_noise)


@pytest.mark.slow  # compiles several programs; .ci/run runs the slow suite
def test_routing_replay_through_the_scan(unrolled, grad_noise):
  """Replayed experts reach the right layer inside the scan: replaying other experts (a shift of
  the model's own choice) gives the unrolled stack's loss, gradients and ids under the same replay."""
  cfg = unrolled.cfg
  _, _, aux, _ = _run(unrolled, cfg)
  own = jnp.transpose(aux["routed"], (1, 2, 0, 3))  # [b, t, moe layers, k]
  other = (own + 1 + jnp.arange(own.shape[2])[None, None, :, None]) % cfg.num_experts
  mask = jnp.asarray(np.random.default_rng(2).random(own.shape[:2]) < 0.6)
  replayed = _compare(unrolled, "none", grad_noise, other, mask)
  got = np.asarray(jnp.transpose(replayed["routed"], (1, 2, 0, 3)))
  np.testing.assert_array_equal(got[np.asarray(mask)], np.asarray(other)[np.asarray(mask)])


@pytest.mark.slow  # compiles several programs; .ci/run runs the slow suite
def test_train_step_matches_unrolled(unrolled):
  from training import byte_corpus
  from training.train_step import TrainConfig, jit_train_step, make_optimizer
  tc = TrainConfig.from_config(horizon.get_config("tiny").train)
  rows = byte_corpus.lm_rows(byte_corpus.load_stdlib_bytes(), 0, 0, np.arange(2), 24)
  out = []
  for scan in (False, True):
    model = abstract_model(unrolled.cfg.replace(scan_layers=scan))
    nnx.update(model, jax.tree.map(jnp.copy, nnx.state(unrolled)))  # the step donates its inputs
    opt = nnx.Optimizer(model, make_optimizer(tc), wrt=nnx.Param)
    losses = [float(jit_train_step(model, opt, rows, tc)["loss"]) for _ in range(2)]
    out.append((losses, jax.tree.leaves(nnx.state(model, nnx.Param))))
  (l0, p0), (l1, p1) = out
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for a, b in zip(p1, p0, strict=True):
    assert_close(a, b, what="params after two steps")


def test_structure_mismatch_is_a_clear_error(unrolled):
  model = model_like(unrolled, unrolled.cfg.replace(scan_layers=True))
  model.blocks[3].extra = nnx.Param(jnp.ones((2,)))
  with pytest.raises(ValueError, match="layer 3 differs in structure.*scan_layers=False"):
    model(text_tokens(model.cfg, (1, 5)))


def _traced_dots(cfg) -> int:
  """dot_general equations in the forward's jaxpr (nested ones included): the layer bodies traced."""
  model = abstract_model(cfg)
  tok = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  return str(jax.make_jaxpr(lambda m, t: m(t))(model, tok)).count("dot_general")


def test_traced_layers_do_not_grow_with_depth():
  """The full pattern (period 4 after 3 dense layers) at tiny width: 23 and 91 layers (5 and 22
  scanned units, nothing unrolled after them) trace the same layer bodies (the same matmuls); the
  depth shows only in the scan length and the stacking of parameters. Unrolled, 23 layers trace
  every layer: their 20 pattern layers where the scan traces one unit of 4 (measured 711 dots against
  199; unrolled at 91 layers, 2,887: tracing it took 14 of this test's 21 s)."""
  pattern = dict(dsa_period=4, dsa_offset=0, num_dense_layers=3)
  small, deep = (_tiny(scan_layers=True, num_layers=n, **pattern) for n in (23, 91))
  a, b = _traced_dots(small), _traced_dots(deep)
  assert a == b > 0, (a, b)
  unrolled = _traced_dots(small.replace(scan_layers=False))
  assert unrolled > 3 * a, (unrolled, a)


@pytest.mark.slow  # compiles several programs; .ci/run runs the slow suite
def test_expert_parallel_mesh_matches_single_device():
  """tiny_sharded at 5 layers (two scanned units) on a (data 2, expert 4) mesh: loss and gradients
  equal the unrolled single-device step, and no device holds a whole expert tensor, stacked or not."""
  cfg = ModelConfig.from_config(horizon.get_config("tiny_sharded").model).replace(num_layers=5)
  tok = text_tokens(cfg, (8, 21))

  def grads(graphdef, state, tokens):
    def loss(m):
      logits, aux = m(tokens)
      return jnp.mean(jax.nn.logsumexp(logits, -1)) + 1e-2 * aux["z_loss"] + aux["indexer_loss"]
    return nnx.value_and_grad(loss)(nnx.merge(graphdef, state))

  step = jax.jit(grads, static_argnums=0)
  graphdef, state = nnx.split(Horizon(cfg, rngs=nnx.Rngs(3)))
  ref_loss, ref_grads = step(graphdef, state, tok)
  shape = (2, 1, 4, 1)
  mesh = mesh_lib.make_mesh(dict(zip(mesh_lib.MESH_AXES, shape, strict=True)))
  scfg = cfg.replace(scan_layers=True)
  with mesh_lib.activate(mesh):
    model = create_sharded_model(lambda: Horizon(scfg, rngs=nnx.Rngs(3)), mesh)
    graphdef, state = nnx.split(model)
    t = jax.device_put(tok, NamedSharding(mesh, rules_lib.activation_spec(
        ("batch", "length"), tok.shape, dict(mesh.shape))))
    compiled = step.lower(graphdef, state, t).compile()
    loss, g = compiled(state, t)
  assert_close(loss, ref_loss, what="loss")
  ref = jax.tree_util.tree_leaves_with_path(nnx.state(ref_grads, nnx.Param))
  got = jax.tree.leaves(nnx.state(g, nnx.Param))
  for (path, r), x in zip(ref, got, strict=True):
    assert_close(jax.device_get(x), r, what=f"grad {jax.tree_util.keystr(path)}")
  e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
  hlo = compiled.as_text()
  for s in (f"[{e},{d},{f}]", f"[{e},{f},{d}]", f"[2,{e},{d},{f}]", f"[2,{e},{f},{d}]"):
    assert f"f32{s}" not in hlo, f"a whole expert tensor f32{s} exists on a device"
