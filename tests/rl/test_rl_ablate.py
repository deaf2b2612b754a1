"""experiments.rl_ablate: variant and --set parsing (errors name the field), and a tiny run."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from configs import rl as rl_config
from experiments import rl_ablate
from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def test_variant_and_set_parsing():
  assert rl_ablate.parse_variant("dapo+eps_high=0.3+train.learning_rate=1e-4") == (
      "dapo", [("rl.eps_high", "0.3"), ("train.learning_rate", "1e-4")])
  config = rl_config.get_config("grpo,tiny")
  rl_ablate.apply(config, "rl.routing_replay", "true")
  rl_ablate.apply(config, "rl.eps_high", "1")  # an int for a float knob
  rl_ablate.apply(config, "rl.mixture", "math=1,terminal=2")
  rl_ablate.apply(config, "train.learning_rate", "5e-5")
  assert config.rl.routing_replay is True and config.rl.eps_high == 1.0
  assert config.rl.mixture == "math=1,terminal=2" and config.train.learning_rate == 5e-5
  with pytest.raises(ValueError, match="no 'eps_hihg'"):
    rl_ablate.apply(config, "rl.eps_hihg", "0.3")
  with pytest.raises(ValueError, match="knob>=<value>"):
    rl_ablate.parse_variant("grpo+routing_replay")
  rl_ablate.apply(config, "rl.difficulty", "1")  # a string knob keeps the text (was a TypeError)
  assert config.rl.difficulty == "1"


def test_every_variant_is_checked_before_the_first_run(tmp_path):
  """These failed only after the variants before them had run (minutes each), with no table."""
  def args(variants, **kw):
    return argparse.Namespace(workdir=str(tmp_path), variants=variants, model="tiny", steps=2,
                              init_checkpoint=None, set=kw.get("set", []))

  runs = rl_ablate.build_runs(args("grpo dapo+eps_high=0.3"))
  assert list(runs) == ["grpo", "dapo+eps_high=0.3"] and runs["dapo+eps_high=0.3"][0].rl.eps_high == 0.3
  assert runs["grpo"][1] == tmp_path / "grpo"
  with pytest.raises(ValueError, match="no 'eps_hihg'"):
    rl_ablate.build_runs(args("grpo dapo dapo+eps_hihg=0.3"))
  with pytest.raises(SystemExit, match="each once"):
    rl_ablate.build_runs(args("grpo dapo grpo"))
  with pytest.raises(ValueError, match="prompts_per_step"):
    rl_ablate.build_runs(args("grpo dapo", set=["rl.prompts_per_step=0"]))
  # Everything RLRun checks (the objective, the mixture, the tiers): the first variant had run
  # for a minute before `kl=k4` or an unknown eval tier of the second failed.
  for variant, field in (("grpo+kl=k4", "config.rl.kl"), ("grpo+eval_tiers=hgh", "config.rl.eval_tiers"),
                         ("grpo+mixture=maths=1", "config.rl.mixture"), ("grpo+tiers=hi", "config.rl.tiers"),
                         ("grpo+rollout_quantization=fp4", "config.rl.rollout_quantization")):
    with pytest.raises(ValueError, match=field):
      rl_ablate.build_runs(args(f"grpo {variant}"))
  (tmp_path / "dapo").mkdir()
  with pytest.raises(SystemExit, match="dapo exists"):
    rl_ablate.build_runs(args("grpo dapo"))


@pytest.mark.slow
def test_two_variants_side_by_side(tmp_path):
  cmd = [sys.executable, "-m", "experiments.rl_ablate", f"--workdir={tmp_path}", "--model=tiny", "--steps=2",
         "--variants=grpo gspo+routing_replay=true"]
  run = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(1), text=True, capture_output=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert list(out["variants"]) == ["grpo", "gspo+routing_replay=true"]
  for row in out["variants"].values():
    assert 0.0 <= row["success"] <= 1.0 and row["abs_dlogp"] >= 0.0 and row["step_s"] > 0
  assert "| grpo |" in run.stdout
  for name in ("grpo", "gspo_routing_replay=true"):
    assert len((tmp_path / name / "metrics.jsonl").read_text().splitlines()) == 2
