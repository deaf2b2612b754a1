"""The formulas behind the benchmarks' tables and last JSON lines (experiments/bench/common.py,
train_step.py, train_step_parts.py, compile_time.py), with the measurements replaced by fixed
numbers so that every reported figure can be worked out by hand: MFU = 3 x forward FLOPs per token x
tokens/s / peak, HFU adds the recompute, each part's share of the step, the time ratios."""

import argparse
import json
import types

import pytest

from experiments.bench import common, compile_time
from experiments.bench import train_step as ts
from experiments.bench import train_step_parts as parts


def test_compiled_peak_bytes_sums_temporaries_arguments_and_outputs():
  analysis = types.SimpleNamespace(temp_size_in_bytes=1, argument_size_in_bytes=10, output_size_in_bytes=100)
  assert common.compiled_peak_bytes(types.SimpleNamespace(memory_analysis=lambda: analysis)) == 111


def test_median_seconds_times_each_rep_after_a_warmup(monkeypatch):
  clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0, 30.0, 40.0])  # timed calls of 3, 1, 2 and 10 s
  monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  calls = []

  def compiled(x):
    calls.append(x)
    return x
  assert common.median_seconds(compiled, (5,), reps=3) == 2.0  # median of 3, 1, 2 (mean 2, min 1)
  assert len(calls) == 4  # the warm-up and 3 timed calls
  clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0, 30.0, 40.0])
  assert common.median_seconds(compiled, (5,), reps=4, warmup=False) == 2.5  # median of 3, 1, 2, 10
  assert len(calls) == 8


def test_skip_message_only_above_the_limit():
  assert common.skip_message(2 ** 30, 2 ** 30) is None
  assert common.skip_message(3 * 2 ** 29, 2 ** 30) == "skipped: needs 1.5 GiB"


def test_best_peak_flops_is_the_highest_over_sizes_in_the_given_dtype(monkeypatch):
  rates = {(64, "bfloat16"): 5.0, (96, "bfloat16"): 7.0, (128, "bfloat16"): 6.0, (64, "float32"): 4.0,
           (96, "float32"): 2.0, (128, "float32"): 3.0}
  seen = []

  def measure(n, reps, dtype="bfloat16"):
    seen.append(reps)
    return rates[n, dtype]
  monkeypatch.setattr(common.metrics, "measure_peak_flops", measure)
  assert common.best_peak_flops([64, 96, 128], reps=3) == (7.0, 96)
  assert common.best_peak_flops([64, 96, 128], reps=3, dtype="float32") == (4.0, 64)
  assert seen == [3] * 6


def test_report_cpu_off_the_cpu_backend_and_the_first_processor_only(monkeypatch, capsys):
  monkeypatch.setattr(common.jax, "default_backend", lambda: "gpu")
  assert common.report_cpu() == {} and capsys.readouterr().out == ""
  # A field the first processor's block lacks is not taken from the second.
  got = common.parse_cpuinfo("processor\t: 0\nflags\t: avx2\n\n"
                             "processor\t: 1\nmodel name\t: B\nflags\t: fma\n")
  assert got["model_name"] == "" and got["peak_flags"] == ["avx2"]


def _raw():
  return {"loss": 2.0, "ce": 1.5, "tokens": 250.0, "grad_norm": 1.0}


def test_train_step_mfu_hfu_and_time_ratios(monkeypatch, capsys):
  seconds = {("none", False): 0.5, ("none", True): 0.8, ("full", False): 0.64, ("full", True): 1.0}
  seen = []

  def time_policy(cfg, tc, batch, reps, max_bytes, plain=False):
    seen.append((cfg.remat, plain, tc.global_batch, tc.seq_len, reps, max_bytes))
    if cfg.remat == "save_dots":
      return {"seconds": None, "bytes": 3 * 2 ** 30, "compile_s": 1.0}
    return {"seconds": seconds[cfg.remat, plain], "bytes": 2 ** 20, "compile_s": 1.0, "raw": _raw(),
            "bias_norm": 0.0}

  def flops_per_token(cfg, seq_len):
    assert seq_len == 64
    return {"train_model": 6e6, "train": 8e6 if cfg.remat == "full" else 6e6}

  peaks = []
  monkeypatch.setattr(ts, "_time_policy", time_policy)
  monkeypatch.setattr(ts, "_batch", lambda b, t: None)
  monkeypatch.setattr(ts, "flops", types.SimpleNamespace(flops_per_token=flops_per_token))
  monkeypatch.setattr(common, "report_cpu", lambda: {})
  monkeypatch.setattr(common, "best_peak_flops",
                      lambda sizes, reps, dtype="bfloat16": peaks.append((sizes, reps, dtype)) or
                      ((1e10, 1024) if dtype == "bfloat16" else (2.5e9, 1024)))
  a = argparse.Namespace(quick=True, batch=4, seq_len=64, remat="none,full,save_dots",
                         backward="compute,plain", reps=5, peak_n=[4096], max_gib=2.0)
  out = ts.run(a)
  assert peaks == [([1024], 10, "bfloat16"), ([1024], 10, "float32")]
  assert [s[:2] for s in seen] == [("none", False), ("none", True), ("full", False), ("full", True),
                                   ("save_dots", False), ("save_dots", True)]
  assert all(s[2:] == (4, 64, 5, 2.0 * 2 ** 30) for s in seen)
  assert out["peak_flops"] == 1e10 and out["bf16_over_f32_peak"] == 4.0 and out["tokens_per_step"] == 256
  # none: 256 tokens / 0.5 s = 512 tokens/s; MFU = HFU = 6e6 x 512 / 1e10.
  assert out["none"] == {"step_s": 0.5, "tokens_per_s": 512.0, "mfu": pytest.approx(0.3072),
                         "hfu": pytest.approx(0.3072), "flops_per_token_train": 6e6, "peak_bytes": 2 ** 20}
  # full: 400 tokens/s; MFU counts 6e6 FLOPs a token, HFU the 8e6 with the recompute.
  assert out["full"]["tokens_per_s"] == 400.0 and out["full"]["flops_per_token_train"] == 8e6
  assert out["full"]["mfu"] == pytest.approx(0.24) and out["full"]["hfu"] == pytest.approx(0.32)
  assert out["none/plain"]["tokens_per_s"] == 320.0 and out["none/plain"]["mfu"] == pytest.approx(0.192)
  assert out["save_dots"] == out["save_dots/plain"] == {"skipped_gib": 3.0}
  assert out["none/plain_over_none_time"] == pytest.approx(1.6)
  assert out["full_over_none_time"] == pytest.approx(1.28)
  assert out["full/plain_over_none_time"] == pytest.approx(2.0)
  assert not any(k.startswith("save_dots") and k.endswith("_time") for k in out)
  assert "none_over_none_time" not in out
  json.dumps(out)
  table = capsys.readouterr().out
  # GFLOP/s column: 6e6 x 400 / 1e9 = 2.4; MFU 24.00 %, HFU 32.00 %.
  row = f"{'full':<15} {0.64:>8.3f} {1.0:>10.1f} {400:>10.0f} {2.4:>9.2f} {24.0:>6.2f}% {32.0:>6.2f}%"
  assert row in table
  assert "save_dots       skipped: needs 3.0 GiB" in table


# Forward FLOPs per token of a stand-in config (tiny's layers: 2 DSA, 2 Delta, 1 dense, 3 MoE), per
# part summed over its layers: DSA 200, Delta 200, dense 60, MoE 300, head 500; forward 1000 (+ 260
# in components no part times, to show they are not counted).
_PER_TOKEN = {"dsa_projections": 100.0, "indexer_projections": 20.0, "dsa_attention": 40.0,
              "indexer_scores": 30.0, "indexer_selected": 10.0, "delta_projections": 150.0,
              "delta_chunk": 50.0, "dense_ffn": 60.0, "router": 30.0, "routed_experts": 216.0,
              "shared_experts": 54.0, "lm_head": 500.0, "embedding": 0.0, "forward": 1260.0,
              "weights": 130.0, "sequence": 130.0}


def test_train_step_parts_shares_and_rates(monkeypatch, capsys):
  seconds = {"dsa": 0.004, "delta": 0.003, "dense": 0.002, "moe": 0.01, "head": 0.005}
  layers = {"dsa": 2, "delta": 2, "dense": 1, "moe": 3, "head": 1}
  found = [(f"{k} part", k, layers[k], k, ()) for k in seconds]
  peaks = []
  monkeypatch.setattr(parts, "best_peak_flops",
                      lambda sizes, reps: peaks.append((sizes, reps)) or (1e10, 1024))
  monkeypatch.setattr(parts, "_step_and_sgd_step", lambda cfg, tc, batch, reps: (0.1, 0.08))
  monkeypatch.setattr(parts, "_batch", lambda b, t: None)
  monkeypatch.setattr(parts, "Horizon", lambda cfg, rngs: None)
  monkeypatch.setattr(parts, "_parts", lambda model, b, t: found)
  monkeypatch.setattr(parts, "_median_seconds", lambda fn, args, reps: seconds[fn])
  monkeypatch.setattr(parts, "report_cpu", lambda: {})
  monkeypatch.setattr(parts.flops, "flops_per_token", lambda cfg, t: _PER_TOKEN)
  a = argparse.Namespace(quick=True, variant="small", batch=8, seq_len=10000, reps=5, peak_n=[4096])
  out = parts.run(a)
  assert peaks == [([1024], 10)]  # --quick measures at n=1024, the best of 10
  assert out["step_ms"] == pytest.approx(100.0) and out["peak_gflops"] == 10.0
  # ms = seconds x layers: 8, 6, 2, 30, 5 (51); optimizer 100 - 80 = 20; rest 80 - 51 = 29.
  want = {"dsa part": 0.08, "delta part": 0.06, "dense part": 0.02, "moe part": 0.3, "head part": 0.05,
          "optimizer (step - SGD step)": 0.2, "rest (SGD step - parts)": 0.29}
  assert out["share"] == pytest.approx(want, abs=1e-12)
  # One layer's 3 x forward FLOPs x 80000 tokens / its time: 3 x 100 x 80000 / 0.004 = 6 GFLOP/s, ...
  assert out["gflops"] == {"dsa part": 6.0, "delta part": 8.0, "dense part": 7.2, "moe part": 2.4,
                           "head part": 24.0}
  text = capsys.readouterr().out
  assert "train step 100.0 ms (30.2% MFU)" in text  # 3 x 1260 x 80000 / 0.1 s / 1e10
  assert f"{'moe part':<27} {3:>6} {'10.0':>8} {30.0:>8.1f} {30.0:>6.1f}% {'2.4':>8} {'24.0%':>8}" in text


def test_compile_time_ratios_and_timeouts(monkeypatch, capsys):
  results = {(8, False): {"lower_s": 0.5, "compile_s": 1.5, "total_s": 2.0, "scanned_units": 1},
             (8, True): {"lower_s": 0.4, "compile_s": 0.6, "total_s": 1.0, "scanned_units": 1},
             (24, False): {"timed_out_s": 100.0},
             (24, True): {"lower_s": 1.0, "compile_s": 3.0, "total_s": 4.0, "scanned_units": 5}}
  seen = []

  def spawn(what, layers, scan, seq, timeout_s):
    seen.append((what, layers, scan, seq, timeout_s))
    return results[layers, scan]
  monkeypatch.setattr(compile_time, "_spawn", spawn)
  a = argparse.Namespace(layers="8,24", programs="forward", seq=32, timeout_s=100.0)
  out = compile_time.run(a)
  assert seen == [("forward", 8, False, 32, 100.0), ("forward", 8, True, 32, 100.0),
                  ("forward", 24, False, 32, 100.0), ("forward", 24, True, 32, 100.0)]
  assert out["forward_8"]["unrolled_over_scanned"] == 2.0
  assert out["forward_24"]["unrolled_over_scanned"] is None
  assert out["forward_24"]["unrolled"] == {"timed_out_s": 100.0}
  lines = capsys.readouterr().out.splitlines()
  assert lines[-1] == (f"{'forward':<11} {24:>6} {5:>6} {'>100 (timeout)':>16} {'4.0':>10} {'1.0+3.0':>16} "
                       f"{'>25.0x':>17}")  # the timed-out unrolled case: at least 100 / 4
  assert lines[-2] == f"{'forward':<11} {8:>6} {1:>6} {'2.0':>16} {'1.0':>10} {'0.4+0.6':>16} {'2.00x':>17}"


def test_train_step_times_the_median_step_after_compile_and_warmup(monkeypatch):
  clock = iter([0.0, 5.0, 10.0, 13.0, 20.0, 21.0, 30.0, 32.0])  # compile 5 s; steps of 3, 1, 2 s
  monkeypatch.setattr(ts, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  calls = []

  class Jitted:
    def lower(self, *args):
      return types.SimpleNamespace(compile=lambda: "compiled")

    def __call__(self, model, optimizer, batch, tc):
      calls.append(batch)
      return {"loss": 2.0 + len(calls)}
  monkeypatch.setattr(ts, "nnx", types.SimpleNamespace(Optimizer=lambda *a, **k: None, Param=None,
                                                       Rngs=lambda seed: None, jit=lambda *a, **k: Jitted()))
  monkeypatch.setattr(ts, "Horizon", lambda cfg, rngs: None)
  monkeypatch.setattr(ts, "make_optimizer", lambda tc: None)
  monkeypatch.setattr(ts.metrics, "router_bias_norm", lambda model: 0.25)
  monkeypatch.setattr(common, "compiled_peak_bytes", lambda compiled: 100)
  got = ts._time_step(None, None, "batch", 3, max_bytes=100)
  assert got == {"seconds": 2.0, "bytes": 100, "compile_s": 5.0, "raw": {"loss": 7.0}, "bias_norm": 0.25}
  assert len(calls) == 5  # 2 untimed (the call's compile + first step, a warm-up), 3 timed
  clock = iter([0.0, 5.0])
  assert ts._time_step(None, None, "batch", 3, max_bytes=99) == {"seconds": None, "bytes": 100,
                                                                 "compile_s": 5.0}
  assert len(calls) == 5  # over the limit: compiled, not run


def test_train_step_parts_times_the_two_steps_alternately(monkeypatch):
  # Timed: adamw 3, sgd 1.5, adamw 1, sgd 0.5, adamw 2, sgd 4 s: medians 2 and 1.5 (minima 1 and 0.5).
  stamps = [0.0, 3.0, 10.0, 11.5, 20.0, 21.0, 30.0, 30.5, 40.0, 42.0, 50.0, 54.0]
  clock = iter(stamps)
  monkeypatch.setattr(parts, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  calls = []

  def step(model, optimizer, batch, tc):
    calls.append(optimizer)
    return {}
  monkeypatch.setattr(parts, "nnx", types.SimpleNamespace(Optimizer=lambda model, tx, wrt: tx, Param=None,
                                                          Rngs=lambda seed: None, jit=lambda *a, **k: step))
  monkeypatch.setattr(parts, "Horizon", lambda cfg, rngs: None)
  monkeypatch.setattr(parts, "make_optimizer", lambda tc: "adamw")
  monkeypatch.setattr(parts.leaf_groups, "apply_if_finite", lambda tx, n: "sgd")
  assert parts._step_and_sgd_step(None, None, None, 3) == (2.0, 1.5)
  assert calls == ["adamw"] * 2 + ["sgd"] * 2 + ["adamw", "sgd"] * 3
