"""Per-component parameter counts of a config, built abstractly.

    python -m experiments.param_count --config=configs/horizon.py:full

Last line: JSON {"total", "active", "layers": {"dsa", "delta"}, ...}.
"""

import json

from experiments.config_util import define_config_flag, run_app
from model.config import model_config
from model.param_count import count_parameters

_CONFIG = define_config_flag()


def _fmt(n: int) -> str:
  for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if round(n / div, 3) >= 1:  # 999,999,999 is 1.000B (it printed as 1000.000M)
      return f"{n / div:.3f}{unit}"
  return str(n)


def main(argv):
  del argv
  cfg = model_config(_CONFIG.value)
  res = count_parameters(cfg)
  print(f"{'component':<18} {'params':>18} {'human':>10}")
  for name, n in res["components"].items():
    print(f"{name:<18} {n:>18,} {_fmt(n):>10}")
  for name in ("total", "active", "total_with_vision"):
    print(f"{name:<18} {res[name]:>18,} {_fmt(res[name]):>10}")
  print(f"layers: {res['layers']}  ffn: {res['ffn']}  (total/active: language model only)")
  print(json.dumps(res))


if __name__ == "__main__":
  run_app(main)
