"""Second mutation audit of the accounting surface: model/flops.py's argument handling and the
experiments/param_count.py CLI's table, each against numbers worked out by hand for tiny.

tiny: d 56, vocab 331, 4 layers (DSA, Delta, DSA, Delta), 8 experts of width 26 (top-2, 1 shared)
in layers 1-3; tests/test_flops_param_count_mutants.py derives every component count.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from model import flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flops_accept_a_numpy_seq_len(tiny_cfg):
  """A numpy integer (an array's shape entry) is a token count: it was refused as 'not an int'."""
  want = flops.flops_per_token(tiny_cfg, 20)
  got = flops.flops_per_token(tiny_cfg, np.int64(20))
  assert got == want
  # Selected keys at T = 20: (1 + ... + 16 + 4 x 16) / 20 = 10, 150 MACs each, 2 DSA layers.
  assert got["dsa_attention"] == 2 * 150 * 10 * 2


def test_flops_refuse_a_bool_seq_len(tiny_cfg):
  """True is an int to isinstance; it was counted as a 1-token sequence."""
  with pytest.raises(ValueError, match="seq_len=True"):
    flops.flops_per_token(tiny_cfg, True)


def test_param_count_cli_table_and_json():
  out = subprocess.run([sys.executable, "-m", "experiments.param_count", "--config=configs/horizon.py:tiny"],
                       cwd=ROOT, capture_output=True, text=True, check=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
  lines = out.strip().splitlines()
  rows = {line.split()[0]: line.split()[1:] for line in lines[1:-2]}
  # 3 x 56 x 26 per expert; 6 of the 8 routed experts idle in each of the 3 MoE layers.
  total, idle = 214492, 3 * 6 * 3 * 56 * 26
  assert rows["embeddings"] == ["18,536", "18.536K"]  # 331 x 56
  assert rows["routed_experts"] == ["104,832", "104.832K"]  # 3 layers x 8 x 4368
  assert rows["total"] == [f"{total:,}", "214.492K"]
  assert rows["active"] == [f"{total - idle:,}", "135.868K"]
  assert rows["total_with_vision"] == [f"{total + 11684:,}", "226.176K"]
  assert lines[-2].startswith("layers: {'dsa': 2, 'delta': 2}  ffn: {'dense': 1, 'moe': 3}")
  res = json.loads(lines[-1])
  assert (res["total"], res["active"], res["total_with_vision"]) == (total, total - idle, total + 11684)
