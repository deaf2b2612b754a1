"""Meshes, the rules table, sharded init and expert parallelism on 8 fake CPU devices."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import horizon
from model.config import ModelConfig
from model.decoder import Horizon
from model.moe import MoE, dropless_experts
from sharding import expert_parallel as ep_lib
from sharding import mesh as mesh_lib
from sharding import rules as rules_lib
from sharding.state import create_sharded_model
from tests.helpers import assert_close
from training.train_step import TrainConfig, make_train_state

MESHES = [(8, 1, 1, 1), (1, 8, 1, 1), (2, 1, 4, 1), (1, 1, 8, 1), (1, 2, 2, 2), (2, 2, 2, 1)]


@pytest.fixture(scope="module")
def cfg():
  return ModelConfig.from_config(horizon.get_config("tiny_sharded").model)


def _mesh(shape):
  return mesh_lib.make_mesh(dict(zip(mesh_lib.MESH_AXES, shape, strict=True)))


def _loss(model, tokens):
  logits, aux = model(tokens[:, :-1])
  logz = jax.nn.logsumexp(logits, axis=-1)
  gold = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
  loss = jnp.mean(logz - gold) + 1e-2 * aux["z_loss"] + 1e-2 * aux["seq_aux_loss"] + aux["indexer_loss"]
  return loss, aux["dropped"]


def _grads(graphdef, state, tokens):
  model = nnx.merge(graphdef, state)
  (loss, dropped), grads = nnx.value_and_grad(_loss, has_aux=True)(model, tokens)
  return loss, dropped, grads


_step = jax.jit(_grads, static_argnums=0)


def _tokens(cfg):
  return jnp.asarray(np.random.default_rng(0).integers(0, cfg.image_token_id, (8, 21)), jnp.int32)


@pytest.fixture(scope="module")
def reference(cfg):
  graphdef, state = nnx.split(Horizon(cfg, rngs=nnx.Rngs(3)))
  compiled = _step.lower(graphdef, state, _tokens(cfg)).compile()
  loss, dropped, grads = compiled(state, _tokens(cfg))
  return {"loss": loss, "grads": grads, "hlo": compiled.as_text()}


# ---- mesh and rules ----------------------------------------------------------


def test_mesh_fill_and_errors():
  assert dict(mesh_lib.make_mesh({"data": 2, "fsdp": -1, "expert": 2, "tensor": 1}).shape) == {
      "data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
  one = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "expert": 1, "tensor": 1}, devices=jax.devices()[:1])
  assert one.size == 1
  assert mesh_lib.MeshConfig.parse("expert=4,data=2").resolve(8) == (2, 1, 4, 1)
  assert mesh_lib.MeshConfig.parse("1,2,2,2").resolve(8) == (1, 2, 2, 2)
  with pytest.raises(mesh_lib.MeshError, match="16 devices but 8"):
    mesh_lib.make_mesh({"data": 2, "fsdp": 8, "expert": 1, "tensor": 1})
  with pytest.raises(mesh_lib.MeshError, match="at most one axis"):
    mesh_lib.MeshConfig.from_config({"data": -1, "fsdp": -1, "expert": 1, "tensor": 1})
  with pytest.raises(mesh_lib.MeshError, match="does not divide 8"):
    mesh_lib.make_mesh({"data": 3, "fsdp": -1, "expert": 1, "tensor": 1})
  with pytest.raises(mesh_lib.MeshError, match="unknown axes \\['pipeline'\\]"):
    mesh_lib.MeshConfig.from_config({"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, "pipeline": 1})
  with pytest.raises(mesh_lib.MeshError, match="axis 'fsdp' is given twice"):  # the last one won silently
    mesh_lib.MeshConfig.parse("fsdp=4,fsdp=2")
  with pytest.raises(mesh_lib.MeshError, match="'x' is not an axis size"):  # a bare int() error before
    mesh_lib.MeshConfig.parse("fsdp=x")
  with pytest.raises(mesh_lib.MeshError, match="'two' is not an axis size"):
    mesh_lib.MeshConfig.parse("1,two,1,1")


def test_mesh_refuses_fewer_than_one_device_and_names_the_flag():
  """0 devices filled a -1 axis with 0 and passed the product check (0 == 0); a bad --mesh size was
  reported as the config.mesh field."""
  fill = mesh_lib.MeshConfig.parse("fsdp=-1")
  for n in (0, -4):
    with pytest.raises(mesh_lib.MeshError, match=f"at least 1 device, got num_devices={n}"):
      fill.resolve(n)
  with pytest.raises(mesh_lib.MeshError, match="^config.mesh: a mesh needs at least 1 device"):
    mesh_lib.make_mesh({"data": 1, "fsdp": -1, "expert": 1, "tensor": 1}, devices=[])
  with pytest.raises(mesh_lib.MeshError, match=r"^--mesh \{.*does not divide 6"):
    mesh_lib.MeshConfig(data=4, fsdp=-1, expert=1, tensor=1).resolve(6, where="--mesh")
  with pytest.raises(mesh_lib.MeshError, match=r"^--mesh='data=0,fsdp=-1': axis size data=0 must be"):
    mesh_lib.MeshConfig.parse("data=0,fsdp=-1")
  with pytest.raises(mesh_lib.MeshError, match=r"^--mesh='-1,-1,1,1': at most one axis may be -1"):
    mesh_lib.MeshConfig.parse("-1,-1,1,1")


def test_logical_to_spec():
  table = rules_lib.PARAM_RULES
  assert rules_lib.logical_to_spec(("expert", "embed", "mlp"), table) == P("expert", "fsdp", "tensor")
  assert rules_lib.logical_to_spec(("q_lora", "heads", "head_dim"), table) == P(None, "tensor", None)
  # A mesh axis is used once per array: the second 'heads' stays whole.
  assert rules_lib.logical_to_spec(("heads", "heads"), table) == P("tensor", None)
  with pytest.raises(rules_lib.ShardingError, match="'nonsense' has no rule"):
    rules_lib.logical_to_spec(("embed", "nonsense"), table, "param w")
  act = rules_lib.activation_spec(("batch", "length", "embed"), (8, 5, 56),
                                  {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1})
  assert act == P(("data", "fsdp", "expert"), None, None)
  # An activation dim its axes do not divide (a decode batch of 1) stays whole.
  assert rules_lib.activation_spec(("batch", "length"), (1, 5), {"data": 8}) == P(None, None)


def test_indivisible_weight_names_weight_dim_and_axes(cfg):
  odd = cfg.replace(vocab_size=263, image_token_id=262)  # only the vocabulary is odd
  mesh = _mesh((1, 1, 4, 2))
  with pytest.raises(rules_lib.ShardingError) as e:
    create_sharded_model(lambda: Horizon(odd, rngs=nnx.Rngs(0)), mesh)
  msg = str(e.value)
  assert "['embed']" in msg and "size 263" in msg and "('tensor',)" in msg and "'vocab'" in msg


def test_sharded_init_layout_and_optimizer_state(cfg):
  import optax
  mesh = _mesh((1, 2, 2, 2))
  model = create_sharded_model(lambda: Horizon(cfg, rngs=nnx.Rngs(3)), mesh)
  moe = model.blocks[1].ffn
  w = moe.w_gate[...]
  assert w.sharding.spec == P("expert", "fsdp", "tensor")
  assert {s.data.shape for s in w.addressable_shards} == {(4, 28, 13)}
  assert model.embed[...].sharding.spec == P("tensor", "fsdp")
  assert model.blocks[0].attn.w_uk[...].sharding.spec == P(None, "tensor", None)
  assert model.blocks[0].attn_norm.scale[...].sharding.spec == P(None)  # replicated by rule
  # Same values as an unsharded init with the same seed.
  plain = Horizon(cfg, rngs=nnx.Rngs(3))
  assert_close(jax.device_get(w), plain.blocks[1].ffn.w_gate[...], what="sharded init")
  # AdamW moments inherit the parameter layout.
  opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  mus = [x for x in jax.tree.leaves(opt.opt_state) if getattr(x, "shape", None) == w.shape]
  assert mus and all(m.sharding.spec == w.sharding.spec for m in mus)
  # So do the train step's (training/leaf_groups.py: stacked per role for the update, kept per leaf).
  opt = make_train_state(model, TrainConfig.from_config(horizon.get_config("tiny").train))
  params = {jax.tree_util.keystr(p): x
            for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}
  moments = {}
  for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(opt)):
    key = jax.tree_util.keystr(p)
    for name in ("['mu']", "['nu']"):
      if name in key:
        want = params[key.split(name, 1)[1]]
        moments[key] = (x.sharding.is_equivalent_to(want.sharding, want.ndim), x.sharding.spec,
                        want.sharding.spec)
  assert len(moments) == 2 * len(params)
  assert all(same for same, _, _ in moments.values()), {k: v for k, v in moments.items() if not v[0]}


# ---- the model on every mesh ------------------------------------------------------------


def _step_on_mesh(cfg, shape, with_jaxpr: bool = False):
  """One compiled loss+grad step of `cfg` sharded on a mesh of `shape`.

  Returns (model, compiled, (loss, dropped, grads), the step's jaxpr text or None).
  """
  mesh = _mesh(shape)
  tokens = _tokens(cfg)
  with mesh_lib.activate(mesh):
    model = create_sharded_model(lambda: Horizon(cfg, rngs=nnx.Rngs(3)), mesh)
    graphdef, state = nnx.split(model)
    tok = jax.device_put(tokens, NamedSharding(mesh, rules_lib.activation_spec(
        ("batch", "length"), tokens.shape, dict(mesh.shape))))
    compiled = _step.lower(graphdef, state, tok).compile()
    out = compiled(state, tok)
    jaxpr = (str(jax.make_jaxpr(lambda s, t: _grads(graphdef, s, t))(state, tok))
             if with_jaxpr else None)
  return model, compiled, out, jaxpr


def _assert_matches_reference(loss, grads, reference, what: str) -> None:
  assert_close(loss, reference["loss"], what=f"loss {what}")
  ref = jax.tree_util.tree_leaves_with_path(reference["grads"])
  got = jax.tree.leaves(grads)
  assert len(ref) == len(got)
  for (path, r), g in zip(ref, got, strict=True):
    assert_close(jax.device_get(g), r, what=f"grad {jax.tree_util.keystr(path)} {what}")


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_loss_and_grads_match_single_device(cfg, reference, shape):
  model, compiled, (loss, dropped, grads), _ = _step_on_mesh(cfg, shape)
  assert float(jnp.sum(dropped)) == 0.0
  _assert_matches_reference(loss, grads, reference, str(shape))
  # Experts are really distributed: E/ep per device, and no device ever holds
  # the whole [E, d, f] tensor during the step (the per-device HLO has no
  # array of that shape, while the single-device program does).
  ep = shape[2]
  e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
  full_shapes = (f"f32[{e},{d},{f}]", f"f32[{e},{f},{d}]")
  assert any(s in reference["hlo"] for s in full_shapes)
  w = model.blocks[1].ffn.w_gate[...]
  for shard in w.addressable_shards:
    assert shard.data.shape[0] == e // ep
  if ep > 1:
    hlo = compiled.as_text()
    assert not any(s in hlo for s in full_shapes), f"a full expert tensor exists on a device ({shape})"


def test_pallas_kernels_run_per_shard_and_match_single_device(cfg, reference):
  """kernels='pallas' under a mesh: each device runs the kernels on its rows/heads (per_shard)."""
  import dataclasses

  pcfg = dataclasses.replace(cfg, kernels="pallas")
  _, _, (loss, _, grads), jaxpr = _step_on_mesh(pcfg, (2, 1, 2, 2), with_jaxpr=True)
  _assert_matches_reference(loss, grads, reference, "(pallas, mesh (2,1,2,2))")
  # The kernels ran inside shard_map, on per-device shards.
  assert "shard_map" in jaxpr and "pallas_call" in jaxpr


# ---- expert-parallel MoE layer ------------------------------------------------------------


def _moe_setup(cfg, shape, **changes):
  cfg = cfg.replace(**changes)
  mesh = _mesh(shape)
  layer = create_sharded_model(lambda: MoE(cfg, rngs=nnx.Rngs(5)), mesh)
  # Skew the routing so one shard is popular: capacity buckets overflow.
  layer.router_bias[...] = jnp.asarray(np.linspace(0.3, 0.0, cfg.num_experts), jnp.float32)
  x = jax.random.normal(jax.random.key(7), (8, 12, cfg.d_model), jnp.float32)
  return cfg, mesh, layer, x


@nnx.jit
def _moe_fwd(layer, x):
  return layer(x)


def _expected_drops(idx_btk, shards, ep, e_local, cap):
  """Reference count: tokens split into `shards` contiguous chunks, buckets of `cap` per dest."""
  t_all, k = idx_btk.shape[0] * idx_btk.shape[1], idx_btk.shape[2]
  flat = np.asarray(idx_btk).reshape(t_all, k)
  keep = np.zeros(flat.shape, bool)
  dropped = 0
  for chunk in np.split(np.arange(t_all), shards):
    seen = np.zeros(ep, int)
    for tok in chunk:
      for j in range(k):
        dest = flat[tok, j] // e_local
        keep[tok, j] = seen[dest] < cap
        dropped += seen[dest] >= cap
        seen[dest] += 1
  return dropped, keep


@pytest.mark.parametrize("shape", [(1, 1, 8, 1), (2, 1, 2, 2)], ids=["ep8", "dp2_ep2_tp2"])
def test_capacity_drops_counted_exactly(cfg, shape):
  cfg, mesh, layer, x = _moe_setup(cfg, shape, capacity_factor=0.5, expert_exchange="capacity")
  _, _, idx, weights = layer.route(x)  # routing on one device (no mesh active)
  ep = shape[2]
  shards = shape[0] * shape[1] * ep
  a_local = x.shape[0] * x.shape[1] // shards * cfg.experts_per_token
  cap = ep_lib.capacity(a_local, ep, cfg.capacity_factor)
  want, keep = _expected_drops(idx, shards, ep, cfg.num_experts // ep, cap)
  assert want > 0
  with mesh_lib.activate(mesh):
    y, aux = _moe_fwd(layer, x)
  assert float(aux["dropped"]) == want
  # Dropped assignments contribute nothing; everything else is exact.
  t = x.shape[0] * x.shape[1]
  w_kept = jnp.where(keep, weights.reshape(t, -1), 0.0)
  routed = dropless_experts(x.reshape(t, -1), idx.reshape(t, -1), w_kept, layer.w_gate[...],
                            layer.w_up[...], layer.w_down[...], jnp.float32)
  expect = routed.reshape(x.shape) + layer.shared(x)
  assert_close(jax.device_get(y), expect, what="capacity-limited MoE output")


@pytest.mark.parametrize("shape", [(1, 1, 8, 1), (1, 2, 2, 2)], ids=["ep8", "fsdp2_ep2_tp2"])
def test_ragged_exchange_is_dropless(cfg, shape):
  cfg, mesh, layer, x = _moe_setup(cfg, shape, expert_exchange="ragged")

  def loss(layer, x):
    y, aux = layer(x)
    return jnp.sum(jnp.sin(y)), aux["dropped"]

  grad_fn = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  (l0, d0), (g0, gx0) = grad_fn(layer, x)  # no mesh: single-device dropless path
  with mesh_lib.activate(mesh):
    (l1, d1), (g1, gx1) = grad_fn(layer, x)
  assert float(d0) == float(d1) == 0.0
  assert_close(l1, l0, what="ragged loss")
  assert_close(jax.device_get(gx1), gx0, what="ragged dx")
  for name in ("w_gate", "w_up", "w_down", "w_router"):
    assert_close(jax.device_get(getattr(g1, name)[...]), getattr(g0, name)[...], what=f"ragged d{name}")



def test_capacity_is_the_documented_bucket_size():
  """C = ceil(capacity_factor * A_local / ep), at least 1 and at most A_local (module docstring),
  worked out by hand: the drop test above takes C from ep_lib.capacity itself."""
  for a_local, ep, factor, want in ((10, 8, 1.25, 2), (10, 4, 0.5, 2), (40, 8, 1.25, 7), (96, 8, 1.0, 12),
                                    (7, 2, 8.0, 7), (3, 8, 0.1, 1)):
    assert ep_lib.capacity(a_local, ep, factor) == want, (a_local, ep, factor)


@pytest.mark.parametrize("factor", [8.0, 0.5])
def test_capacity_exchange_does_not_count_padding_as_drops(factor):
  """5 tokens over 8 batch shards (3 padded rows): one real token per shard, its k experts distinct,
  so even buckets of 1 row (factor 0.5) place every real assignment, and factor = ep places all.
  0 dropped (padded rows are neither exchanged nor counted) and the single-device dropless output."""
  mesh = _mesh((1, 1, 8, 1))
  rng = np.random.default_rng(2)
  t, e, k, d, f = 5, 8, 2, 6, 4
  r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  x, wg, wu, wd = r(t, d), r(e, d, f), r(e, d, f), r(e, f, d)
  idx = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
  w = jax.nn.softmax(r(t, k), axis=-1)

  def local(x, ids, w, w_gate, w_up, w_down):
    return dropless_experts(x, ids, w, w_gate, w_up, w_down, jnp.float32)

  run = jax.jit(lambda *a: ep_lib.expert_parallel_experts(*a, local_experts=local, exchange="capacity",
                                                          capacity_factor=factor))
  with mesh_lib.activate(mesh):
    y, dropped = run(x, idx, w, wg, wu, wd)
  assert float(dropped) == 0.0
  assert_close(jax.device_get(y), dropless_experts(x, idx, w, wg, wu, wd, jnp.float32), what="padded EP")


def test_rules_table_is_the_documented_layout():
  """sharding/rules.py's docstring: heads, FFN widths, ViT heads/MLP and the vocabulary split over
  `tensor`, experts over `expert`, a weight's embed over `fsdp`; the small dims replicated; an
  activation's batch over every batch-like axis, its heads/mlp/vocab over `tensor`."""
  params, acts = rules_lib.PARAM_RULES, rules_lib.ACTIVATION_RULES
  for name in ("heads", "mlp", "vit_heads", "vit_mlp", "vocab"):
    assert params[name] == "tensor", name
  assert params["expert"] == "expert" and params["embed"] == "fsdp"
  for name in ("q_lora", "kv_lora", "head_dim", "norm", "conv", "embed_out", "vit_embed"):
    assert params[name] is None, name
  assert tuple(acts["batch"]) == ("data", "fsdp", "expert")
  for name in ("heads", "mlp", "vocab"):
    assert acts[name] == "tensor", name
  for name in ("length", "embed", "expert"):
    assert acts[name] is None, name

def test_emulated_ragged_all_to_all_matches_semantics():
  mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(1)
  n, out_rows = 6, 10
  sizes = rng.integers(0, 3, (4, 4))  # sizes[src, dst]
  ops = rng.normal(size=(4, n, 3)).astype(np.float32)
  in_off = np.cumsum(sizes, 1) - sizes
  out_off = np.cumsum(sizes, 0) - sizes  # dst's buffer is ordered by source
  expect = np.full((4, out_rows, 3), -1.0, np.float32)
  for s in range(4):
    for d in range(4):
      expect[d, out_off[s, d]:out_off[s, d] + sizes[s, d]] = ops[s, in_off[s, d]:in_off[s, d] + sizes[s, d]]

  def body(op, io, ss, oo, rs):
    return ep_lib.emulated_ragged_all_to_all(op[0], jnp.full((out_rows, 3), -1.0), io[0], ss[0], oo[0],
                                             rs[0], axis_name="x")[None]

  got = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"))(
      ops, in_off.astype(np.int32), sizes.astype(np.int32),
      out_off.astype(np.int32), np.ascontiguousarray(sizes.T).astype(np.int32))
  # Sender s passes out_off[s]: where its slice lands on each destination.
  np.testing.assert_array_equal(np.asarray(got), expect)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_native_ragged_path_lowers(cfg, platform, monkeypatch):
  """With the real lax.ragged_all_to_all the expert-parallel MoE step lowers for TPU and GPU."""
  monkeypatch.setattr(ep_lib, "ragged_collective", lambda: jax.lax.ragged_all_to_all)
  cfg, mesh, layer, x = _moe_setup(cfg, (1, 2, 2, 2), expert_exchange="ragged")
  graphdef, state = nnx.split(layer)

  def loss(state, x):
    y, _ = nnx.merge(graphdef, state)(x)
    return jnp.sum(y * y)

  with mesh_lib.activate(mesh):
    exported = jax.export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state),
            jax.ShapeDtypeStruct(x.shape, x.dtype))
  text = exported.mlir_module()
  assert "ragged_all_to_all" in text and exported.nr_devices == math.prod((1, 2, 2, 2))
