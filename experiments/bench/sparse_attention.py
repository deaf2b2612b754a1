"""DSA Pallas kernels vs the XLA path: sparse MQA (fwd, fwd+bwd) and the indexer top-k.

Both paths compute the same function (pallas_kernels/sparse_attention and
pallas_kernels/indexer_topk are tested against model/attention/sparse.py);
this measures time (median of --reps runs, compile excluded) and the bytes
XLA plans for each compiled program (memory_analysis: temp + arguments +
outputs). Inputs: one causal sequence per row, random activations, the
selection from the indexer itself, so the sparse attention sees real top-k
patterns (early queries have fewer than topk keys).

On CPU the kernels run in Pallas interpret mode (a grid loop of XLA ops):
their times and bytes say nothing about TPU/GPU and the table says
"interpret"; the numbers that matter come from a TPU or GPU run (compiled,
Mosaic / Triton).

Run (heavy; never overlap with other heavy jobs):

    flock /tmp/horizon_heavy.lock python -m experiments.bench.sparse_attention --quick
    flock /tmp/horizon_heavy.lock python -m experiments.bench.sparse_attention
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from experiments.bench.common import compiled_peak_bytes, median_seconds, positive_int, skip_message
from model.attention import sparse
from pallas_kernels.indexer_topk import ops as topk_ops
from pallas_kernels.sparse_attention import ops as attn_ops

MIB = 2 ** 20


def make_inputs(args, n: int):
  """Random DSA-layer activations for one length n, and the indexer's own selection."""
  dt = jnp.dtype(args.dtype)
  ks = jax.random.split(jax.random.key(n), 7)
  b, h, c, p, hi, di = args.batch, args.heads, args.latent, args.rope, args.index_heads, args.index_dim
  nrm = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dt)
  attn = [nrm(ks[0], (b, n, h, c)), nrm(ks[1], (b, n, h, p)), nrm(ks[2], (b, n, c)), nrm(ks[3], (b, n, p))]
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  seg = jnp.zeros((b, n), jnp.int32)
  index = (nrm(ks[4], (b, n, hi, di)), nrm(ks[5], (b, n, hi)), nrm(ks[6], (b, n, di)), pos, seg, pos, seg)
  topk = min(args.topk, n)
  idx, valid = jax.jit(lambda *a: sparse.blockwise_topk(*a, topk, args.query_block, args.key_block))(*index)
  return attn + [idx, valid], list(index), topk


def attention_fns(args, scale: float):
  """{path: (fwd, fwd+bwd)} for the sparse MQA."""
  def grads(fwd):
    def fb(ql, qr, lat, kr, idx, valid):
      loss = lambda *x: jnp.sum(jnp.square(fwd(*x, idx, valid)[0].astype(jnp.float32)))
      return jax.grad(loss, argnums=(0, 1, 2, 3))(ql, qr, lat, kr)
    return fb

  xla = lambda *a: sparse.sparse_mqa_attention(*a, scale, args.query_block)
  pallas = lambda *a: attn_ops.sparse_mqa_attention(*a, scale, args.query_block)
  return {"xla": (xla, grads(xla)), "pallas": (pallas, grads(pallas))}


def topk_fns(args, topk: int):
  return {"xla": lambda *a: sparse.blockwise_topk(*a, topk, args.query_block, args.key_block),
          "pallas": lambda *a: topk_ops.blockwise_topk(*a, topk, args.query_block, args.key_block)}


def measure(fn, inputs, reps: int, limit_bytes: int) -> dict:
  """AOT compile (not timed), planned bytes, median time; skipped past the memory limit."""
  compiled = jax.jit(fn).lower(*inputs).compile()
  peak = compiled_peak_bytes(compiled)
  skipped = skip_message(peak, limit_bytes)
  if skipped:
    return {"peak": peak, "skipped": skipped}
  return {"peak": peak, "time": median_seconds(compiled, inputs, reps)}


def _row(n, op, path, mode, r, ratio=""):
  t = f"{r['time']:.4f}" if "time" in r else r["skipped"]
  print(f"{n:>6} | {op:<13} | {path:<6} | {mode:<9} | {t:>22} | {r['peak'] / MIB:>10.2f} | {ratio:>7}",
        flush=True)


def bench_length(args, n: int, limit: int, kernel_mode: str) -> dict:
  attn_in, index_in, topk = make_inputs(args, n)
  scale = (args.latent + args.rope) ** -0.5  # any positive scale; the same for both paths
  attn = attention_fns(args, scale)
  ops = {"attn fwd": ({p: f[0] for p, f in attn.items()}, attn_in),
         "attn fwd+bwd": ({p: f[1] for p, f in attn.items()}, attn_in),
         "indexer topk": (topk_fns(args, topk), index_in)}
  out = {}
  for op, (fns, inputs) in ops.items():
    res = {path: measure(fns[path], inputs, args.reps, limit) for path in ("xla", "pallas")}
    both = "time" in res["xla"] and "time" in res["pallas"]
    ratio = res["xla"]["time"] / res["pallas"]["time"] if both else None
    _row(n, op, "xla", "compiled", res["xla"])
    _row(n, op, "pallas", kernel_mode, res["pallas"], f"{ratio:.3f}" if ratio else "-")
    out[f"{op}@{n}"] = {"xla_s": res["xla"].get("time"), "pallas_s": res["pallas"].get("time"),
                        "pallas_speedup": ratio, "xla_peak_bytes": res["xla"]["peak"],
                        "pallas_peak_bytes": res["pallas"]["peak"]}
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="one short length (a smoke run)")
  ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--latent", type=int, default=128)
  ap.add_argument("--rope", type=int, default=32)
  ap.add_argument("--index_heads", type=int, default=8)
  ap.add_argument("--index_dim", type=int, default=64)
  ap.add_argument("--topk", type=int, default=256)
  ap.add_argument("--query_block", type=int, default=128)
  ap.add_argument("--key_block", type=int, default=256)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--reps", type=positive_int, default=3)
  ap.add_argument("--mem_limit_gib", type=float, default=16.0)
  args = ap.parse_args()
  if args.quick:
    args.lengths, args.topk, args.key_block, args.query_block, args.reps = [256], 64, 64, 64, 2
  backend = jax.default_backend()
  kernel_mode = "interpret" if backend == "cpu" else "compiled"
  print(f"backend={backend} devices={jax.device_count()} dtype={args.dtype} b={args.batch} "
        f"heads={args.heads} latent={args.latent} rope={args.rope} index_heads={args.index_heads} "
        f"index_dim={args.index_dim} topk={args.topk} query_block={args.query_block} "
        f"key_block={args.key_block} reps={args.reps}; compile excluded (ahead-of-time)")
  if kernel_mode == "interpret":
    print("NOTE: CPU -> the Pallas kernels run in INTERPRET mode (a Python-built grid loop of XLA ops); "
          "their times and bytes are not kernel performance. Run on a TPU/GPU for real numbers.")
  print(f"{'N':>6} | {'op':<13} | {'path':<6} | {'mode':<9} | {'time_s':>22} | {'peak_MiB':>10} | "
        f"{'xla/pal':>7}")
  t0 = time.perf_counter()
  result = {"backend": backend, "kernel_mode": kernel_mode,
            "config": {k: getattr(args, k) for k in ("batch", "heads", "latent", "rope", "index_heads",
                                                     "index_dim", "topk", "query_block", "key_block",
                                                     "dtype")}}
  limit = int(args.mem_limit_gib * 2 ** 30)
  result["results"] = {}
  for n in args.lengths:
    result["results"].update(bench_length(args, n, limit, kernel_mode))
  result["wall_s"] = round(time.perf_counter() - t0, 1)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
