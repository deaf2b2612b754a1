"""One MoE train step on 8 devices: experts sharded (EP=8) vs replicated (EP=1).

Run (heavy; never overlap with other heavy jobs):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.expert_parallel
    flock /tmp/horizon_heavy.lock python -m experiments.bench.expert_parallel --quick
    python -m experiments.bench.expert_parallel --config=configs/horizon.py:tiny_sharded \
        --config.model.num_experts=16 --quick

The block is a pre-norm residual MoE layer, x + MoE(RMSNorm(x)), of the `small`
config by default (d_model 384, 32 routed experts of width 256, top-4, one
shared expert). One train step is: forward, loss = MSE against a fixed random
target + --aux_weight * (router z-loss + sequence balance loss), gradients
with nnx.value_and_grad, an optax.adamw update through nnx.Optimizer, all in
one nnx.jit.

Two layouts of the same model values on the same global batch, whose batch
dim is split 8 ways in both (sharding.rules: `batch` -> data, fsdp, expert):

  ep8 -- mesh data=1, fsdp=1, expert=8, tensor=1: routed-expert weights split
         over `expert`, tokens exchanged with all-to-all
         (sharding.expert_parallel, the fixed-capacity exchange on CPU).
  ep1 -- mesh data=8, fsdp=1, expert=1, tensor=1: plain data parallelism,
         every device holds every expert.

Why the checks: a speed or memory ratio between two programs only means
something if they compute the same function. capacity_factor defaults to 8
(= the expert axis), so the capacity exchange cannot drop a token, and the
benchmark fails (exit 1) if any assignment was dropped or the two layouts'
losses (before and after one update) differ beyond the compute dtype's
tolerance (training.tolerance, the tests' helper).

Measured per layout: median step time (compile and warm-up excluded,
jax.block_until_ready, median of --reps), per-device parameter and optimizer
state bytes (the device-0 shard of every array, on the real arrays), and
XLA's memory_analysis of the compiled step. The last line is a JSON object.
"""

from __future__ import annotations

import os

# 8 fake CPU devices, before JAX is imported (as tests/conftest.py does).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from configs import horizon  # noqa: E402
from experiments.bench.common import compiled_peak_bytes, median_seconds, quick_flag  # noqa: E402
from experiments.config_util import define_config_flag  # noqa: E402
from model.config import ModelConfig, model_config  # noqa: E402
from model.layers import RMSNorm  # noqa: E402
from model.moe import MoE  # noqa: E402
from sharding import expert_parallel  # noqa: E402
from sharding import mesh as mesh_lib  # noqa: E402
from sharding import rules as rules_lib  # noqa: E402
from sharding.state import create_sharded_model  # noqa: E402
from training.tolerance import assert_close  # noqa: E402

NUM_DEVICES = 8
LAYOUTS = {  # name -> mesh; both split the batch 8 ways
    "ep8": mesh_lib.MeshConfig(data=1, fsdp=1, expert=8, tensor=1),
    "ep1": mesh_lib.MeshConfig(data=8, fsdp=1, expert=1, tensor=1),
}
MIB = 2 ** 20
GIB = 2 ** 30

FOOTNOTE = """\
What to expect: the 8 devices are fake XLA:CPU devices sharing this host's CPU cores (and
other jobs), so an all-to-all is a memcpy, the devices' compute is serialised, and times
are noisy. The time ratio weighs two costs against each other, not ICI/NVLink behaviour:
  + EP=8 adds the capacity exchange's padding: each device sends ep buckets of C rows
    and runs its experts on ep*C rows (with capacity_factor = ep, ep times its own
    assignments, most rows empty), plus the exchange copies;
  - EP=1 pays parameter-proportional work on every device: the full adamw update, the
    all-reduce of every expert gradient, and the blocked grouped matmul's per-block
    expert-weight gathers and gradient scatters.
Few tokens per device favour EP=8, many favour EP=1 here; the ratio is no prediction for
real accelerators, where the exchange overlaps compute and each device's FLOPs are its
own. The parameter-bytes ratio is the real point: routed expert weights (and their Adam
moments) shrink to 1/8 per device; the shared expert and the norm stay replicated, so the
whole-block ratio is a little above 1/8."""

FLAGS = flags.FLAGS
_CONFIG = define_config_flag(required=False)
quick_flag("small batch and fewer reps for a smoke run (< 1 min)")
flags.DEFINE_integer("batch_per_device", 1, "sequences per device (global batch = 8x this)")
flags.DEFINE_integer("seq", 512, "tokens per sequence")
flags.DEFINE_integer("reps", 5, "timed steps per layout (median reported)", lower_bound=1)
flags.DEFINE_float("capacity_factor", 8.0, "capacity factor of the EP exchange (>= 8: no drops)")
flags.DEFINE_float("aux_weight", 1e-3, "weight of the router z-loss and sequence balance loss")
flags.DEFINE_float("lr", 1e-3, "adamw learning rate")
# 8 GiB, not 16, as in moe_dropless_vs_dense: XLA:CPU's resident memory runs above
# memory_analysis() and this machine is shared.
flags.DEFINE_float("max_gib", 8.0, "do not run a layout whose 8-device compiled footprint exceeds this")


class MoEBlock(nnx.Module):
  """Pre-norm residual MoE layer: x + MoE(RMSNorm(x)), as in the decoder."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, param_dtype=cfg.jnp_param_dtype)
    self.moe = MoE(cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
    """x: [b, t, d] -> ([b, t, d], MoE aux)."""
    y, aux = self.moe(self.norm(x))
    return x + y.astype(x.dtype), aux


def bench_config(config, capacity_factor: float) -> ModelConfig:
  """The model config (`small` unless --config is given) with the bench's capacity factor."""
  if config is None:
    config = horizon.get_config("small")
  return model_config(config).replace(capacity_factor=capacity_factor)


def make_train_step(aux_weight: float):
  """A fresh nnx.jit train step (one per layout, so no trace is shared across meshes)."""

  def loss_fn(model, x, target):
    y, aux = model(x)
    mse = jnp.mean(jnp.square(y.astype(jnp.float32) - target))
    return mse + aux_weight * (aux["z_loss"] + aux["seq_aux_loss"]), aux["dropped"]

  @nnx.jit
  def train_step(model, optimizer, x, target):
    (loss, dropped), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, target)
    optimizer.update(model, grads)
    return loss, dropped

  return train_step


def device0_bytes(tree) -> int:
  """Bytes device 0 holds of every array in `tree` (its addressable shard, real arrays)."""
  dev = jax.devices()[0]
  total = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == dev)
  return total


def _put_batch(a: np.ndarray, mesh) -> jax.Array:
  spec = rules_lib.activation_spec(("batch", "length", "embed"), a.shape, dict(mesh.shape))
  return jax.device_put(a, NamedSharding(mesh, spec))


def run_layout(cfg: ModelConfig, mesh_cfg: mesh_lib.MeshConfig, x_np, target_np, reps: int,
               max_bytes: float) -> dict:
  """Builds the sharded block + optimizer on `mesh_cfg`, compiles and measures one train step.

  The step is not run (step_s and the losses are None) when the 8 devices' compiled
  footprint, 8 x memory_analysis (which is per device), exceeds max_bytes.
  """
  mesh = mesh_lib.make_mesh(mesh_cfg)
  with mesh_lib.activate(mesh):
    model = create_sharded_model(lambda: MoEBlock(cfg, rngs=nnx.Rngs(0)), mesh)
    optimizer = nnx.Optimizer(model, optax.adamw(FLAGS.lr), wrt=nnx.Param)
    x, target = _put_batch(x_np, mesh), _put_batch(target_np, mesh)
    step = make_train_step(FLAGS.aux_weight)
    t0 = time.perf_counter()
    compiled = step.lower(model, optimizer, x, target).compile()
    res = dict(compile_s=time.perf_counter() - t0,
               param_bytes=device0_bytes(nnx.state(model, nnx.Param)),
               expert_param_bytes=device0_bytes([model.moe.w_gate, model.moe.w_up, model.moe.w_down]),
               opt_state_bytes=device0_bytes(nnx.state(optimizer)),
               temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
               peak_bytes=compiled_peak_bytes(compiled),
               step_s=None, loss0=None, loss1=None, dropped=None)
    if NUM_DEVICES * res["peak_bytes"] > max_bytes:
      return res
    # Run the AOT-compiled step itself: calling `step` would compile it again.
    loss0, dropped = jax.device_get(compiled(model, optimizer, x, target))  # also the warm-up
    loss1, _ = jax.device_get(compiled(model, optimizer, x, target))  # after one update
    res.update(step_s=median_seconds(compiled, (model, optimizer, x, target), reps, warmup=False),
               loss0=float(loss0), loss1=float(loss1), dropped=float(dropped))
  return res


def _skipped(r: dict) -> str:
  return f"skipped: needs {NUM_DEVICES * r['peak_bytes'] / GIB:.1f} GiB"


def _check(res: dict, dtype: str) -> list[str]:
  """Problems that make the comparison meaningless (drops, different losses)."""
  problems = [f"{n}: {r['dropped']:.0f} token-assignments dropped; raise --capacity_factor"
              for n, r in res.items() if r["dropped"]]
  if any(r["step_s"] is None for r in res.values()):
    return problems
  for key in ("loss0", "loss1"):
    try:
      assert_close(res["ep8"][key], res["ep1"][key], dtype=dtype, what=f"{key} ep8 vs ep1")
    except AssertionError as e:
      problems.append(str(e))
  return problems


def _print_table(res: dict) -> None:
  print(f"{'layout':<7} {'step ms':>9} {'compile s':>10} {'params MiB':>11} {'experts MiB':>12} "
        f"{'opt MiB':>9} {'temp MiB':>9} {'peak MiB':>9} {'loss0':>11} {'loss1':>11} {'dropped':>8}")
  for name, r in res.items():
    sizes = (f"{r['compile_s']:>10.1f} {r['param_bytes'] / MIB:>11.3f} "
             f"{r['expert_param_bytes'] / MIB:>12.3f} {r['opt_state_bytes'] / MIB:>9.3f} "
             f"{r['temp_bytes'] / MIB:>9.1f} {r['peak_bytes'] / MIB:>9.1f}")
    if r["step_s"] is None:
      print(f"{name:<7} {'-':>9} {sizes}  {_skipped(r)}")
    else:
      print(f"{name:<7} {r['step_s'] * 1e3:>9.1f} {sizes} {r['loss0']:>11.6f} {r['loss1']:>11.6f} "
            f"{r['dropped']:>8.0f}")


def _ratio(a, b, digits: int = 4):
  return None if a is None or b is None else round(a / max(b, 1e-30), digits)


def _summary(res: dict, problems: list[str]) -> dict:
  ep8, ep1 = res["ep8"], res["ep1"]
  ran = all(r["step_s"] is not None for r in res.values())
  out = {"layouts_agree": (not problems) if ran else None}
  for name, r in res.items():
    out.update({f"{name}_{k}": v for k, v in r.items()})
    if r["step_s"] is None:
      out[f"{name}_step_s"] = _skipped(r)
  out.update(
      time_ratio=_ratio(ep8["step_s"], ep1["step_s"]) if ran else "skipped",
      param_bytes_ratio=_ratio(ep8["param_bytes"], ep1["param_bytes"]),
      expert_param_bytes_ratio=_ratio(ep8["expert_param_bytes"], ep1["expert_param_bytes"]),
      opt_state_bytes_ratio=_ratio(ep8["opt_state_bytes"], ep1["opt_state_bytes"]),
      temp_bytes_ratio=_ratio(ep8["temp_bytes"], ep1["temp_bytes"]))
  if ran:
    out.update(loss0_rel_diff=abs(ep8["loss0"] - ep1["loss0"]) / abs(ep1["loss0"]),
               loss1_rel_diff=abs(ep8["loss1"] - ep1["loss1"]) / abs(ep1["loss1"]))
  return out


def main(argv) -> None:
  del argv
  if jax.device_count() != NUM_DEVICES:
    raise SystemExit(f"expert_parallel bench needs exactly {NUM_DEVICES} devices (it builds 8-device "
                     f"meshes), found {jax.device_count()} ({jax.default_backend()}); run on CPU with "
                     "JAX_PLATFORMS=cpu and XLA_FLAGS=--xla_force_host_platform_device_count=8 (this "
                     "module sets it unless XLA_FLAGS already names a device count).")
  if FLAGS.quick:  # explicit --seq / --reps win
    FLAGS.seq = FLAGS.seq if FLAGS["seq"].present else 64
    FLAGS.reps = FLAGS.reps if FLAGS["reps"].present else 2
  cfg = bench_config(_CONFIG.value, FLAGS.capacity_factor)
  shape = (NUM_DEVICES * FLAGS.batch_per_device, FLAGS.seq, cfg.d_model)
  rng = np.random.default_rng(0)
  x_np = rng.standard_normal(shape, np.float32)
  target_np = rng.standard_normal(shape, np.float32)
  print(f"MoE block train step: x {shape} d_model={cfg.d_model} experts={cfg.num_experts} "
        f"width={cfg.expert_dim} top-{cfg.experts_per_token} shared={cfg.num_shared_experts} "
        f"dtype={cfg.dtype} params={cfg.param_dtype} "
        f"exchange={expert_parallel.resolve_exchange(cfg.expert_exchange)} "
        f"capacity_factor={cfg.capacity_factor} reps={FLAGS.reps} backend={jax.default_backend()}")
  local = shape[0] * shape[1] // NUM_DEVICES * cfg.experts_per_token
  if expert_parallel.resolve_exchange(cfg.expert_exchange) == "capacity":
    cap = expert_parallel.capacity(local, NUM_DEVICES, cfg.capacity_factor)
    print(f"per device: {local} token-assignments; ep8 buckets of C={cap} rows, experts run on "
          f"{NUM_DEVICES * cap} rows", flush=True)
  res = {name: run_layout(cfg, m, x_np, target_np, FLAGS.reps, FLAGS.max_gib * GIB)
         for name, m in LAYOUTS.items()}
  _print_table(res)
  problems = _check(res, cfg.dtype)
  for p in problems:
    print(f"CHECK FAILED: {p}", file=sys.stderr, flush=True)
  print(FOOTNOTE)
  print(json.dumps(_summary(res, problems)), flush=True)
  if problems:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
