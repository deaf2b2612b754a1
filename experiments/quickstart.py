"""Quickstart: prepare the embedded corpus, pretrain `tiny` on CPU, checkpoint, sample.

    python -m experiments.quickstart --config=configs/pretrain.py:tiny

Runs the one training loop (training/loop.py, as experiments/pretrain.py
does) on the Python standard library's source (tokenized with the bundled
BPE), for config.train.steps steps (~1-3 minutes on 2 CPU cores), then
reloads the last checkpoint the way the server does, checks that prefill +
decode reproduce the full forward pass, and samples a continuation of a code
prompt (training/quickstart.py). Prints the final loss next to the corpus's
unigram entropy (the loss of the best model that ignores context), where the
logs and checkpoints are, and a last line of JSON.
"""

from __future__ import annotations

import json
import math

from absl import flags
from etils import epath

from experiments.config_util import define_config_flag, log_to_workdir, run_app
from training import quickstart

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/horizon_quickstart", "Run directory.")
_PROMPT = flags.DEFINE_string("prompt", "def fibonacci(n):\n    ", "Prompt for the sample.")
_NEW = flags.DEFINE_integer("new_tokens", 48, "Tokens to sample.")
_TEMP = flags.DEFINE_float("temperature", 0.7, "Sampling temperature (0 = greedy).")


def main(argv):
  del argv
  log_to_workdir(_WORKDIR.value, "quickstart")
  r = quickstart.run(_CONFIG.value, _WORKDIR.value, prompt=_PROMPT.value, new_tokens=_NEW.value,
                     temperature=_TEMP.value)
  final, entropy = r["final_loss"], r["unigram_entropy"]
  n = r["final_loss_steps"]  # a launch that trained nothing (the run had finished) reads metrics.jsonl
  window = f"the last {n} steps" if r["steps_this_launch"] else f"the {n} logged losses of the last 20 steps"
  loss = ("no loss of the last 20 steps in metrics.jsonl" if final is None else
          f"final training loss (mean of {window}) {final:.3f} = {final / entropy:.2f} x unigram, "
          f"perplexity {math.exp(final):.1f}")
  print(f"\ntrained {r['steps']} steps ({r['steps_this_launch']} in this launch); corpus unigram entropy "
        f"{entropy:.3f} nats/token; {loss}")
  print(f"prefill + decode vs full forward: max |logit diff| {r['decode_max_logit_diff']:.2e} "
        f"(top-k over every key; with the config's top-k {r['decode_max_logit_diff_sparse']:.2e})")
  print(f"sample (temperature {_TEMP.value}):\n{_PROMPT.value}{r['sample']}\n")
  work = epath.Path(r["workdir"])
  print(f"metrics:     {work / 'metrics.jsonl'} (TensorBoard: {work / 'tensorboard'})")
  print(f"logs:        {work / 'logs'}")
  print(f"checkpoints: {r['checkpoint_dir']} (latest step {r['latest_checkpoint']})")
  print(json.dumps({k: v for k, v in r.items() if k != "latest_checkpoint"}))


if __name__ == "__main__":
  run_app(main)
