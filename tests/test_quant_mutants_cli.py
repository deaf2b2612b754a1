"""experiments/quantize.py (the CLI) passes its flags through to training.quantize.convert in the right
order, with the documented defaults, and prints the table, the held-out line and a JSON line. The
converter is replaced by a recorder (the real one is tested in test_quantize_cli.py)."""

import json
import subprocess
import sys

_RUN = r"""
import runpy, sys, types
fake = types.ModuleType("training.quantize")
def convert(src, out, what, mode, step, config, eval_tokens=0):
  held = {"tokens": 256, "loss_before": 2.5, "loss_after": 2.625, "delta": 0.125} if eval_tokens else None
  args = [src, out, what, mode, step, config is None, eval_tokens]
  return types.SimpleNamespace(decisions=["D"], summary={"out": out, "args": args, "heldout": held})
fake.convert, fake.table = convert, lambda d: f"TABLE {d}"
sys.modules["training.quantize"] = fake
sys.argv = ["quantize", *sys.argv[1:]]
runpy.run_module("experiments.quantize", run_name="__main__")
"""


def _run(*flags):
  return subprocess.run([sys.executable, "-c", _RUN, *flags], capture_output=True, text=True, timeout=120)


def test_flags_reach_the_converter_and_the_output_has_three_parts():
  r = _run("--checkpoint=/in dir/ck", "--out=/o", "--what=all-linear", "--mode=ceil", "--step=3",
           "--eval_tokens=256")
  assert r.returncode == 0, r.stderr[-2000:]
  lines = r.stdout.strip().splitlines()
  assert lines[0] == "TABLE ['D']"
  assert lines[1] == "held-out loss over 256 tokens: 2.5000 dense -> 2.6250 MXFP4 (+0.1250 nats/token)"
  assert json.loads(lines[2])["args"] == ["/in dir/ck", "/o", "all-linear", "ceil", 3, True, 256]
  assert len(lines) == 3


def test_defaults_and_required_flags():
  r = _run("--checkpoint=/in", "--out=/o")
  assert r.returncode == 0, r.stderr[-2000:]
  lines = r.stdout.strip().splitlines()
  assert len(lines) == 2 and json.loads(lines[1])["args"] == ["/in", "/o", "experts", "floor", None, True, 0]
  for given in (["--checkpoint=/in"], ["--out=/o"]):
    r = _run(*given)
    assert r.returncode != 0 and "--checkpoint and --out are required" in r.stderr, r.stderr[-2000:]
