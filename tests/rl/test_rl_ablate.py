"""experiments.rl_ablate: variant and --set parsing (errors name the field), and a tiny run."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from configs import rl as rl_config
from experiments import rl_ablate
from model.config import ConfigError
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


def _args(tmp_path, variants="grpo", **kw):
  return argparse.Namespace(**{"workdir": str(tmp_path / "abl"), "variants": variants, "model": "tiny",
                               "steps": 2, "init_checkpoint": None, "set": [], **kw})


@pytest.mark.parametrize("variants,kw,match", [
  ("grpo", {"set": ["rl.steps=1"]}, "--set rl.steps=1: config.rl.steps is set by --steps"),
  ("grpo dapo+steps=5", {}, "variant 'dapo+steps=5': config.rl.steps is set by --steps"),
  ("grpo", {"set": ["checkpoint.init_from=/b"], "init_checkpoint": "/a"},
   "--set checkpoint.init_from=/b: --init_checkpoint='/a' and checkpoint.init_from='/b'"),
  ("grpo grpo+checkpoint.init_from=/b", {"init_checkpoint": "/a"}, "variant 'grpo+checkpoint.init_from=/b'"),
])
def test_steps_and_init_checkpoint_are_not_replaced_by_set_or_a_variant(tmp_path, variants, kw, match):
  """`--set=rl.steps=1` ran 1 step while the summary reported --steps; a checkpoint.init_from
  replaced --init_checkpoint silently."""
  with pytest.raises(ConfigError, match=re.escape(match)):
    rl_ablate.build_runs(_args(tmp_path, variants, **kw))
  same = rl_ablate.build_runs(_args(tmp_path, set=["checkpoint.init_from=/a"], init_checkpoint="/a"))
  assert same["grpo"][0].checkpoint.init_from == "/a" and same["grpo"][0].rl.steps == 2


@pytest.mark.parametrize("variants,kw,field", [
  ("grpo", {"set": ["train.seq_len=64"]}, "train.seq_len"),
  ("grpo", {"set": ["train.global_batch=3"]}, "train.global_batch"),
  ("grpo grpo+train.steps=50", {}, "train.steps"),
  ("grpo+train.grad_accum=2", {}, "train.grad_accum"),
])
def test_train_fields_rl_does_not_read_are_refused(tmp_path, variants, kw, field):
  """As experiments.rl refuses them (rl/train/checks.check_rl_overrides): they were accepted and ignored."""
  with pytest.raises(ConfigError, match=re.escape(field) + r".*an RL run does not read it"):
    rl_ablate.build_runs(_args(tmp_path, variants, **kw))


@pytest.mark.parametrize("variants,kw,match", [
  ("grpo", {"steps": 0}, "--steps=0: must be >= 1"),
  ("grpo", {"steps": -1}, "--steps=-1: must be >= 1"),
  ("grpo grpoo", {}, "variant 'grpoo': unknown algorithm 'grpoo'"),
  ("grpo", {"model": "tinny"}, "--model='tinny': unknown"),
  ("grpo+eps_high=abc", {}, "variant 'grpo+eps_high=abc': config.rl.eps_high='abc': needs a number"),
  ("grpo+eps_high=nan", {}, "variant 'grpo+eps_high=nan': config.rl.eps_high=nan: must be >= 0"),
  ("grpo+micro_batch=2.5", {}, "variant 'grpo+micro_batch=2.5': config.rl.micro_batch='2.5': needs an int"),
  ("grpo+routing_replay=1", {}, "variant 'grpo+routing_replay=1': config.rl.routing_replay='1': needs true"),
  ("grpo", {"set": ["rl=3"]}, "--set rl=3: config.rl is a section, not a value"),
  ("grpo", {"set": ["rl.steps.x=3"]}, "--set rl.steps.x=3: config.rl.steps is a value"),
  ("grpo", {"set": ["train.learning_rate=fast"]}, "config.train.learning_rate='fast': needs a number"),
])
def test_bad_input_is_one_config_error_line_naming_it(tmp_path, variants, kw, match):
  """These were tracebacks (ValueError, ml_collections' TypeError) or, for --steps=0, a crash after
  the workdir was made; now one line naming the variant or --set entry, the field and the value."""
  with pytest.raises(ConfigError, match=re.escape(match)) as info:
    rl_ablate.build_runs(_args(tmp_path, variants, **kw))
  assert "\n" not in str(info.value) and not (tmp_path / "abl").exists()


def test_values_of_each_type(tmp_path):
  """inf is a number (eps_high / tis_cap: no cap, as --config.rl.eps_high=inf); true is any case."""
  runs = rl_ablate.build_runs(_args(tmp_path, "grpo+eps_high=inf+tis_cap=inf grpo+routing_replay=TRUE",
                                    set=["rl.micro_batch=2", "train.learning_rate=1"]))
  first, second = runs["grpo+eps_high=inf+tis_cap=inf"][0], runs["grpo+routing_replay=TRUE"][0]
  assert first.rl.eps_high == float("inf") and first.rl.tis_cap == float("inf")
  assert second.rl.routing_replay is True and second.rl.micro_batch == 2
  assert isinstance(second.train.learning_rate, float) and second.train.learning_rate == 1.0


def test_steps_0_ends_in_one_line_and_makes_no_workdir(tmp_path):
  """It crashed in MetricsLogger after making <workdir>/grpo, so the rerun said the workdir exists."""
  cmd = [sys.executable, "-m", "experiments.rl_ablate", f"--workdir={tmp_path / 'abl'}", "--model=tiny",
         "--variants=grpo", "--steps=0"]
  run = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(1), text=True, capture_output=True, timeout=300)
  assert run.returncode == 1, run.stderr[-3000:]
  assert run.stderr.startswith("FATAL ConfigError: --steps=0: must be >= 1"), run.stderr[-3000:]
  assert "Traceback" not in run.stderr and not (tmp_path / "abl").exists()


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
