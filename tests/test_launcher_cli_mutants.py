"""The launchers' wiring, which a mutation audit found unpinned: what experiments/serve.py,
pretrain.py, rl.py and quickstart.py refuse, and what they pass to the library (the host, port,
checkpoint and uvicorn's log_config; the distributed flags; --init_checkpoint; the quickstart's
prompt, token count and temperature), which process prints, and the summary line each prints.

One child process runs every case (absl flags are globals, kept out of pytest's process): each
launcher's `main` with its heavy calls replaced by recorders, then its flags deleted so that the
next launcher can define its own. Nothing trains, loads or binds a port."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]

_DRIVER = r"""
import contextlib, io, json, sys, types
from pathlib import Path
import jax
from absl import flags
from sharding import distributed

work = sys.argv[1]
said, calls = {}, []
distributed.initialize = lambda mode, **kw: calls.append(["init", mode, kw]) or False


def launch(module, name, args, index=0, count=1):
  out = io.StringIO()
  saved = jax.process_index, jax.process_count
  jax.process_index, jax.process_count = (lambda: index), (lambda: count)
  calls.clear()
  sys.argv = [module.__name__, *args]  # ml_collections reads --config.* overrides from sys.argv
  try:
    with contextlib.redirect_stdout(out):
      module.main(flags.FLAGS(sys.argv))
    said[name] = {"out": out.getvalue().splitlines(), "calls": list(calls)}
  except BaseException as e:
    said[name] = {"error": f"{type(e).__name__}: {e}", "calls": list(calls)}
  finally:
    jax.process_index, jax.process_count = saved
    flags.FLAGS.unparse_flags()


def forget(before):
  for name in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, name)


class Engine:
  slots, max_context, tokenizer = 4, 256, "tok"
  def start(self):
    return self
  def stop(self):
    calls.append(["stop"])


def uvicorn_run(app, **kw):
  calls.append(["uvicorn", app, kw])
  if kw["port"] == 1:
    raise RuntimeError("address in use")


before = set(flags.FLAGS)
from experiments import serve
serve.build_engine = lambda config, ck, model_overrides: calls.append(
    ["build", config.serving.model_name, ck, model_overrides]) or Engine()
serve.create_app = lambda engine, tok, config: f"app({tok})"
serve.uvicorn = types.SimpleNamespace(run=uvicorn_run)
launch(serve, "serve_defaults", [f"--workdir={work}/serve"])
launch(serve, "serve_given", ["--config=configs/serve.py:tiny", "--checkpoint=/ck", "--host=0.0.0.0",
                              "--port=65535", "--config.model.kernels=xla", f"--workdir={work}/serve"])
launch(serve, "serve_fails", ["--port=1", f"--workdir={work}/serve"])
launch(serve, "serve_port0", ["--port=0", f"--workdir={work}/serve"])
said["serve_log"] = (Path(work) / "serve" / "logs" / "serve.INFO").exists()
forget(before)

from experiments import pretrain
pretrain.run = lambda config, workdir: calls.append(["run", config.train.steps, workdir]) or {"losses": [2.5]}
launch(pretrain, "pretrain_no_workdir", ["--config=configs/pretrain.py:tiny"])
launch(pretrain, "pretrain_flags", ["--config=configs/pretrain.py:tiny", "--config.train.steps=7",
                                    f"--workdir={work}/pre", "--coordinator_address=h0:5",
                                    "--num_processes=3", "--process_id=2", "--local_device_ids=1,0",
                                    "--distributed=on"])
launch(pretrain, "pretrain_p1", ["--config=configs/pretrain.py:tiny", f"--workdir={work}/pre"],
       index=1, count=2)
said["pretrain_logs"] = sorted(p.name for p in (Path(work) / "pre" / "logs").glob("*.INFO"))
forget(before)

from experiments import rl
def rl_run(config, workdir):
  calls.append(["run", config.checkpoint.init_from, workdir])
  return {"history": [{"loss": 1.0}], "steps": 2, "dir": Path("/x/y")}
rl.run = rl_run
launch(rl, "rl_init", ["--config=configs/rl.py:grpo,tiny", f"--workdir={work}/rl", "--init_checkpoint=/sft"])
launch(rl, "rl_no_init", ["--config=configs/rl.py:grpo,tiny", f"--workdir={work}/rl"])
launch(rl, "rl_two_inits", ["--config=configs/rl.py:grpo,tiny", f"--workdir={work}/rl",
                            "--init_checkpoint=/sft", "--config.checkpoint.init_from=/pre"])
launch(rl, "rl_no_workdir", ["--config=configs/rl.py:grpo,tiny"])
launch(rl, "rl_p1", ["--config=configs/rl.py:grpo,tiny", f"--workdir={work}/rl"], index=1, count=2)
said["rl_logs"] = sorted(p.name for p in (Path(work) / "rl" / "logs").glob("*.INFO"))
forget(before)

from experiments import quickstart
qs_losses = {"final_loss": 2.0, "final_loss_steps": 7, "steps_this_launch": 7}
def qs_run(config, workdir, prompt, new_tokens, temperature):
  calls.append(["run", config.model.vocab_size, workdir, prompt, new_tokens, temperature])
  return {"final_loss": qs_losses["final_loss"], "final_loss_steps": qs_losses["final_loss_steps"],
          "unigram_entropy": 4.0, "steps": 9, "steps_this_launch": qs_losses["steps_this_launch"],
          "sample": "SAMPLE", "decode_max_logit_diff": 0.0, "decode_max_logit_diff_sparse": 0.0,
          "workdir": workdir, "checkpoint_dir": "ck", "latest_checkpoint": 9}
quickstart.quickstart.run = qs_run
launch(quickstart, "qs_defaults", ["--config=configs/pretrain.py:tiny", f"--workdir={work}/qs"])
launch(quickstart, "qs_given", ["--config=configs/pretrain.py:tiny", f"--workdir={work}/qs", "--prompt=x = ",
                                "--new_tokens=5", "--temperature=0.25"])
qs_losses.update(final_loss=3.0, final_loss_steps=2, steps_this_launch=0)  # relaunched after the last step
launch(quickstart, "qs_finished", ["--config=configs/pretrain.py:tiny", f"--workdir={work}/qs"])
qs_losses.update(final_loss=None, final_loss_steps=0)  # ... and metrics.jsonl holds none of its last steps
launch(quickstart, "qs_no_losses", ["--config=configs/pretrain.py:tiny", f"--workdir={work}/qs"])
print("SAID", json.dumps(said))
"""


@pytest.fixture(scope="module")
def said(tmp_path_factory):
  work = tmp_path_factory.mktemp("launchers")
  run = subprocess.run([sys.executable, "-c", _DRIVER, str(work)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=subprocess_env(1))
  lines = [line for line in run.stdout.splitlines() if line.startswith("SAID ")]
  assert run.returncode == 0 and lines, run.stderr[-3000:]
  return json.loads(lines[-1][len("SAID "):])


def test_serve_binds_localhost_8000_by_default_and_stops_the_engine(said):
  """A random model on 127.0.0.1:8000 (not every interface), uvicorn's own log config off (it would
  close the log file's handler), the engine stopped when uvicorn returns."""
  got = said["serve_defaults"]
  assert got["calls"] == [["build", "horizon-tiny", None, {}],
                          ["uvicorn", "app(tok)", {"host": "127.0.0.1", "port": 8000, "log_level": "info",
                                                   "log_config": None}],
                          ["stop"]], got
  assert got["out"][0] == "loading a random model (horizon-tiny) ..."
  assert said["serve_log"]


def test_serve_passes_the_checkpoint_host_port_and_model_overrides(said):
  got = said["serve_given"]
  assert got["calls"][0] == ["build", "horizon-tiny", "/ck", {"kernels": "xla"}], got
  assert got["calls"][1][2]["host"] == "0.0.0.0" and got["calls"][1][2]["port"] == 65535
  assert said["serve_port0"]["calls"][1][2]["port"] == 0  # both ends of [0, 65535] are ports
  assert got["out"][0] == "loading /ck (horizon-tiny) ..."


def test_serve_stops_the_engine_when_uvicorn_fails(said):
  got = said["serve_fails"]
  assert got["error"] == "RuntimeError: address in use" and got["calls"][-1] == ["stop"], got


def test_pretrain_needs_a_workdir_before_anything_starts(said):
  got = said["pretrain_no_workdir"]
  assert got["error"].startswith("UsageError: --workdir is required") and got["calls"] == [], got


def test_pretrain_passes_the_distributed_flags_then_trains_and_prints_the_summary(said):
  got = said["pretrain_flags"]
  assert got["calls"] == [["init", "on", {"coordinator_address": "h0:5", "num_processes": 3, "process_id": 2,
                                          "local_device_ids": "1,0"}],
                          ["run", 7, got["calls"][1][2]]], got
  assert got["calls"][1][2].endswith("/pre") and got["out"] == ['{"losses": [2.5]}']


def test_only_process_0_prints_and_each_process_logs_to_its_own_file(said):
  assert said["pretrain_p1"]["out"] == [] and said["pretrain_p1"]["calls"][0][1] == "auto"
  assert said["pretrain_logs"] == ["pretrain.p0.INFO", "pretrain.p1.INFO"]
  assert said["rl_p1"]["out"] == []
  assert said["rl_logs"] == ["rl.INFO", "rl.p1.INFO"]  # one process: "rl"; many: "rl.p<index>"


def test_rl_init_checkpoint_sets_init_from_and_the_summary_drops_history(said):
  got = said["rl_init"]
  assert got["calls"][0][:2] == ["init", "auto"] and got["calls"][1][:2] == ["run", "/sft"], got
  assert got["out"] == ['{"steps": 2, "dir": "/x/y"}']  # a Path printed as its string
  assert said["rl_no_init"]["calls"][1][1] == ""  # configs/rl.py's default, untouched
  assert said["rl_two_inits"] == {  # refused before anything starts (--init_checkpoint won silently)
      "error": "ConfigError: --init_checkpoint='/sft' and --config.checkpoint.init_from='/pre' name "
               "different starting weights; give one of them.", "calls": []}
  refused = said["rl_no_workdir"]
  assert refused["error"].startswith("IllegalFlagValueError: flag --workdir=None") and refused["calls"] == []


def test_quickstart_passes_its_flags_and_prints_the_summary(said):
  got = said["qs_defaults"]
  assert got["calls"][0][3:] == ["def fibonacci(n):\n    ", 48, 0.7], got
  given = said["qs_given"]
  assert given["calls"][0][3:] == ["x = ", 5, 0.25], given
  assert given["calls"][0][2].endswith("/qs")
  assert "final training loss (mean of the last 7 steps) 2.000 = 0.50 x unigram" in given["out"][1]
  assert given["out"][-1] == json.dumps({"final_loss": 2.0, "final_loss_steps": 7, "unigram_entropy": 4.0,
                                         "steps": 9, "steps_this_launch": 7, "sample": "SAMPLE",
                                         "decode_max_logit_diff": 0.0, "decode_max_logit_diff_sparse": 0.0,
                                         "workdir": given["calls"][0][2], "checkpoint_dir": "ck"})
  # a relaunch of a finished run: the losses the earlier launches logged, or none (it printed NaN)
  assert ("trained 9 steps (0 in this launch); corpus unigram entropy 4.000 nats/token; final training loss "
          "(mean of the 2 logged losses of the last 20 steps) 3.000 = 0.75 x unigram, perplexity 20.1"
          ) == said["qs_finished"]["out"][1]
  assert said["qs_no_losses"]["out"][1].endswith("nats/token; no loss of the last 20 steps in metrics.jsonl")
  assert json.loads(said["qs_no_losses"]["out"][-1])["final_loss"] is None
  assert "sample (temperature 0.25):" in given["out"] and "x = SAMPLE" in given["out"]
