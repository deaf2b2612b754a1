"""Quality and size of 4-bit weight formats: MXFP4 (both scale modes) vs INT4 vs bf16.

Run (under the heavy-job lock on shared machines):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.mxfp4_quality
    python -m experiments.bench.mxfp4_quality --quick
    python -m experiments.bench.mxfp4_quality --checkpoint=/tmp/run/checkpoints

Formats, each quantizing along the contraction axis K of a weight W [N, K]:
  mxfp4_floor / mxfp4_ceil  OCP MX v1.0 (pallas_kernels/mxfp4/format.py): E2M1
                            + one E8M0 scale per 32, 4.25 bits/element;
  int4_g32                  symmetric INT4 (round(w / s) in [-7, 7]) with one
                            bf16 scale s = amax / 7 per 32 elements, 4.5 bits;
  int4_channel              symmetric INT4 with one bf16 scale per output
                            channel (row of W), 4 + 16 / K bits;
  bf16                      round to bfloat16, 16 bits.

Weights: (a) Gaussian, (b) Student-t with nu = 3 (heavy tails: a few large
outliers per block), (c) the routed-expert weights (w_gate, w_up, w_down of
every MoE layer) of a trained checkpoint given by --checkpoint, otherwise of a
randomly initialised model of --variant (the output says which). Errors are
relative Frobenius norms, ||W_q - W|| / ||W|| for the weights and
||x W_q^T - x W^T|| / ||x W^T|| for matmul outputs with Gaussian activations x
[tokens, K], accumulated over all weights of a source, computed in f32.

Bytes: the expert weights of the source in each format, and for the `full`
config the whole model with MXFP4 routed experts vs bf16 (parameter counts and
bytes from `experiments.memory_plan.state_bytes` on the abstract model: nothing
is allocated). The last line is a JSON object with every number.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import horizon
from pallas_kernels.mxfp4 import format as mx

FORMATS = ("mxfp4_floor", "mxfp4_ceil", "int4_g32", "int4_channel", "bf16")
INT4_MAX = 7  # symmetric INT4: codes in [-7, 7]


def bits_per_element(fmt: str, k: int) -> float:
  """Storage bits per weight element for a weight with contraction length k."""
  return {"mxfp4_floor": 4 + 8 / mx.BLOCK, "mxfp4_ceil": 4 + 8 / mx.BLOCK, "int4_g32": 4 + 16 / 32,
          "int4_channel": 4 + 16 / k, "bf16": 16.0}[fmt]


def _int4(w: jax.Array, group: int) -> jax.Array:
  """Symmetric INT4 round trip of w [..., K] with a bf16 scale per `group` elements of K."""
  g = w.reshape(*w.shape[:-1], w.shape[-1] // group, group)
  amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
  s = (amax / INT4_MAX).astype(jnp.bfloat16).astype(jnp.float32)
  q = jnp.clip(jnp.round(g / jnp.where(s > 0, s, 1.0)), -INT4_MAX, INT4_MAX)
  return (q * s).reshape(w.shape)


@functools.partial(jax.jit, static_argnames=("fmt",))
def round_trip(w: jax.Array, fmt: str) -> jax.Array:
  """w [..., N, K] (f32, K last) through `fmt` and back to f32."""
  if fmt.startswith("mxfp4_"):
    blocks, scales = mx.quantize(w, axis=-1, mode=fmt.split("_")[1])
    return mx.dequantize(blocks, scales, jnp.float32)
  if fmt == "int4_g32":
    return _int4(w, 32)
  if fmt == "int4_channel":
    return _int4(w, w.shape[-1])
  return w.astype(jnp.bfloat16).astype(jnp.float32)


@jax.jit
def _sq_errors(w: jax.Array, wq: jax.Array, x: jax.Array) -> jax.Array:
  """[4] f32: sum sq weight error, sum sq weight, sum sq output error, sum sq output."""
  hp = jax.lax.Precision.HIGHEST
  y = jnp.einsum("tk,...nk->...tn", x, w, precision=hp)
  yq = jnp.einsum("tk,...nk->...tn", x, wq, precision=hp)
  return jnp.stack([jnp.sum(jnp.square(wq - w)), jnp.sum(jnp.square(w)),
                    jnp.sum(jnp.square(yq - y)), jnp.sum(jnp.square(y))])


class Accumulator:
  """Squared-error sums per format over many weights of one source."""

  def __init__(self):
    self.sums = {f: np.zeros(4) for f in FORMATS}
    self.elements = 0
    self.bits = {f: 0.0 for f in FORMATS}

  def add(self, w: jax.Array, x: jax.Array) -> None:
    """w [..., N, K] with K the contraction axis; x [tokens, K] activations."""
    w = jnp.asarray(w, jnp.float32)
    n = int(np.prod(w.shape))
    self.elements += n
    for f in FORMATS:
      self.sums[f] += np.asarray(_sq_errors(w, round_trip(w, f), x), np.float64)
      self.bits[f] += n * bits_per_element(f, w.shape[-1])

  def result(self) -> dict[str, dict[str, float]]:
    out = {}
    for f, (ew, w, ey, y) in self.sums.items():
      out[f] = {"weights_rel_err": float(np.sqrt(ew / w)), "matmul_rel_err": float(np.sqrt(ey / y)),
                "bits_per_element": self.bits[f] / self.elements,
                "bytes": self.bits[f] / 8}
    return out


def synthetic(kind: str, n: int, k: int, tokens: int, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  if kind == "gaussian":
    w = rng.standard_normal((n, k))
  else:
    w = rng.standard_t(3, (n, k))
  x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)
  acc = Accumulator()
  acc.add(jnp.asarray(w / np.sqrt(k), jnp.float32), x)
  return acc.result()


def _expert_models(checkpoint: str | None, variant: str, seed: int):
  """(model, note): a trained checkpoint's model, or a random one of `variant`."""
  fallback = horizon.get_config(variant).model
  if checkpoint is None:
    from model.config import ModelConfig  # noqa: PLC0415
    from model.decoder import Horizon  # noqa: PLC0415
    cfg = ModelConfig.from_config(fallback)
    note = (f"no --checkpoint: expert weights of a RANDOMLY INITIALISED '{variant}' model "
            "(Gaussian, std 1/sqrt(fan_in)); pass --checkpoint for trained weights")
    return Horizon(cfg, rngs=nnx.Rngs(seed)), note
  from training.checkpoint import load_model, stored_model_config  # noqa: PLC0415
  cfg = stored_model_config(checkpoint, fallback)
  if cfg.quantization != "none":
    raise SystemExit(f"--checkpoint={checkpoint} stores quantized weights "
                     f"(quantization={cfg.quantization!r}); pass the dense checkpoint.")
  return load_model(checkpoint, cfg), f"expert weights loaded from the checkpoint {checkpoint}"


def experts(checkpoint: str | None, variant: str, tokens: int, max_layers: int | None,
            seed: int) -> tuple[dict, str, int]:
  """Errors over the routed experts' weights, with K (contraction) moved last."""
  from model.moe import find_moe_modules  # noqa: PLC0415
  model, note = _expert_models(checkpoint, variant, seed)
  d, f = model.cfg.d_model, model.cfg.expert_dim
  if d % mx.BLOCK or f % mx.BLOCK:
    raise SystemExit(f"experts: d_model={d} and expert_dim={f} must be multiples of {mx.BLOCK} for "
                     "MXFP4 (each contracts in blocks of 32); use a checkpoint of such a config "
                     "(e.g. 'small').")
  layers = list(find_moe_modules(model).values())[:max_layers]
  rng = np.random.default_rng(seed + 1)
  acc = Accumulator()
  for moe in layers:
    for name in ("w_gate", "w_up", "w_down"):
      w = jnp.swapaxes(getattr(moe, name)[...], 1, 2)  # [e, d, f] -> [e, f, d]; down: [e, d, f]
      x = jnp.asarray(rng.standard_normal((tokens, w.shape[-1])), jnp.float32)
      acc.add(w, x)
  note += f"; {len(layers)} MoE layer(s), {acc.elements:,} expert weight elements"
  return acc.result(), note, acc.elements


def full_model_bytes() -> dict:
  """The `full` design's bytes with bf16 vs MXFP4 routed experts (abstract, nothing allocated)."""
  from experiments.memory_plan import state_bytes  # noqa: PLC0415
  from model.config import ModelConfig  # noqa: PLC0415
  from sharding.mesh import MESH_AXES  # noqa: PLC0415
  cfg = ModelConfig.from_config(horizon.get_config("full").model)
  sb = state_bytes(cfg, dict.fromkeys(MESH_AXES, 1))  # one device: per-device = global
  elems = int(sb["routed_expert_elems"])
  by_format = {f: elems * bits_per_element(f, cfg.d_model) / 8 for f in FORMATS}
  # Per-channel scales: w_gate / w_up have e*f channels of K = d, w_down e*d of K = f.
  channels = elems / 3 * (2 / cfg.d_model + 1 / cfg.expert_dim)
  by_format["int4_channel"] = elems / 2 + channels * 2
  return {"param_count": int(sb["param_count"]), "routed_expert_elements": elems,
          "params_bytes_bf16": sb["params"], "params_bytes_mxfp4_experts": sb["params_mxfp4"],
          "ratio_mxfp4_vs_bf16": sb["params_mxfp4"] / sb["params"],
          "routed_expert_bytes": by_format}


def _print_errors(rows: dict[str, dict]) -> None:
  print(f"{'weights':<12} {'format':<13} {'bits/el':>8} {'weight rel err':>15} {'matmul rel err':>15}")
  for source, res in rows.items():
    for f in FORMATS:
      r = res[f]
      print(f"{source:<12} {f:<13} {r['bits_per_element']:>8.3f} {r['weights_rel_err']:>15.5f} "
            f"{r['matmul_rel_err']:>15.5f}")


def _print_bytes(expert_res: dict, full: dict, variant_label: str) -> None:
  gib = 2 ** 30
  print(f"\nexpert weight bytes ({variant_label}):")
  for f in FORMATS:
    print(f"  {f:<13} {expert_res[f]['bytes'] / 2 ** 20:>12.2f} MiB")
  print(f"\nfull config ({full['param_count']:,} parameters, "
        f"{full['routed_expert_elements']:,} in routed experts):")
  for f in FORMATS:
    print(f"  routed experts {f:<13} {full['routed_expert_bytes'][f] / gib:>10.1f} GiB")
  print(f"  whole model, bf16             {full['params_bytes_bf16'] / gib:>10.1f} GiB")
  print(f"  whole model, MXFP4 experts    {full['params_bytes_mxfp4_experts'] / gib:>10.1f} GiB "
        f"({full['ratio_mxfp4_vs_bf16']:.3f} x bf16)")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
  p.add_argument("--checkpoint", default=None, help="orbax checkpoint dir with dense expert weights")
  p.add_argument("--variant", default="small", choices=horizon.VARIANTS,
                 help="config variant for the random model / the checkpoint's fallback config")
  p.add_argument("--n", type=int, default=2048, help="output features of the synthetic weights")
  p.add_argument("--k", type=int, default=2048, help="contraction length of the synthetic weights")
  p.add_argument("--tokens", type=int, default=256, help="activation rows for the matmul error")
  p.add_argument("--max_layers", type=int, default=None, help="MoE layers to read (default all)")
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args()
  if a.quick:
    a.n, a.k, a.tokens, a.max_layers = 256, 512, 64, 1
  if a.k % mx.BLOCK:
    raise SystemExit(f"--k={a.k} must be a multiple of {mx.BLOCK} (MXFP4 blocks).")
  rows = {"gaussian": synthetic("gaussian", a.n, a.k, a.tokens, a.seed),
          "student_t3": synthetic("student_t3", a.n, a.k, a.tokens, a.seed)}
  expert_res, note, _ = experts(a.checkpoint, a.variant, a.tokens, a.max_layers, a.seed)
  rows["experts"] = expert_res
  print(f"synthetic weights [{a.n}, {a.k}], activations [{a.tokens}, K]; experts: {note}")
  _print_errors(rows)
  full = full_model_bytes()
  _print_bytes(expert_res, full, "checkpoint" if a.checkpoint else f"random '{a.variant}'")
  summary = {
      "experts_source": note,
      "weights_rel_err": {s: {f: r[f]["weights_rel_err"] for f in FORMATS} for s, r in rows.items()},
      "matmul_rel_err": {s: {f: r[f]["matmul_rel_err"] for f in FORMATS} for s, r in rows.items()},
      "bits_per_element": {f: expert_res[f]["bits_per_element"] for f in FORMATS},
      "expert_bytes": {f: expert_res[f]["bytes"] for f in FORMATS},
      "err_ratio_floor_vs_ceil": {s: r["mxfp4_floor"]["weights_rel_err"] /
                                  r["mxfp4_ceil"]["weights_rel_err"] for s, r in rows.items()},
      "full": full,
  }
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
