"""training/quickstart.py without training, edge cases a mutation audit found unpinned: the sampler
(greedy at temperature 0, a fresh key per token), the decode check's last token and its cache
length, the argument checks' boundaries, the final loss's window and the unigram entropy. The model is
a stand-in whose next token is (token + 1) mod 7: each case compiles tiny programs only."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import pretrain
from training import data, quickstart
from training.tokenizer import default_tokenizer_path, load_tokenizer

V = 7


class _Next(nnx.Module):
  """logits favour (token + 1) mod V by `peak`; decoding token `bad` shifts that step's logits by
  `shift` (a decode path that disagrees with the full forward there)."""

  def __init__(self, peak=4.0, bad=-1, shift=0.0):
    self.peak, self.bad, self.shift = peak, bad, shift
    self.cache_lengths = []

  def _logits(self, x):
    return self.peak * jax.nn.one_hot((x + 1) % V, V)

  def __call__(self, x):
    return self._logits(x), {}

  def init_cache(self, batch, max_len):
    self.cache_lengths.append(max_len)
    return jnp.zeros((batch, max_len), jnp.int32)

  def prefill(self, x, lengths, cache):
    return self._logits(x), cache

  def decode_step(self, x, cache):
    return self._logits(x) + self.shift * (x == self.bad)[:, None], cache


def test_temperature_zero_is_greedy_and_sampling_draws_a_new_key_per_token():
  """Greedy from [1, 2]: 3, 4, 5, 6, 0 (a mutant divided by temperature 0 instead). With flat logits
  every token is a fresh draw: the same key each step (a mutant) repeats one token."""
  model = _Next()
  assert quickstart.sample(model, [1, 2], 5, 0.0, seed=0) == [3, 4, 5, 6, 0]
  assert model.cache_lengths == [2 + 5 + 1]  # the decode check's max_len: its programs are reused
  flat = quickstart.sample(_Next(peak=0.0), [1], 12, 1.0, seed=3)
  assert len(flat) == 12 and len(set(flat)) > 1, flat


def test_decode_gap_compares_every_decoded_position_including_the_last():
  """tokens [1, 2, 3, 4], prompt 2: prefill's position 1, then decode steps on 3 and 4, against the
  forward's positions 1..3. A mismatch decoding the last token (4) shows as its shift; max_len equal
  to the tokens is enough (mutants dropped the last position, or refused that max_len)."""
  assert quickstart.decode_gap(_Next(), [1, 2, 3, 4], 2, 4) == 0.0
  assert quickstart.decode_gap(_Next(bad=4, shift=0.75), [1, 2, 3, 4], 2, 4) == 0.75
  assert quickstart.decode_gap(_Next(bad=3, shift=0.5), [1, 2, 3, 4], 2, 5) == 0.5
  with pytest.raises(ValueError, match=r"decode_gap: max_len=3 < 4 tokens"):
    quickstart.decode_gap(_Next(), [1, 2, 3, 4], 2, 3)


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
  """quickstart.run with the training loop, the entropy and the checkpoint stubbed; returns the calls
  (none: the arguments were refused first)."""
  calls = []
  losses = [float(i) for i in range(30)]

  def run(config, workdir):
    calls.append("train")
    return {"prepared_dir": "prep", "losses": losses, "checkpoint_dir": "ck", "latest_checkpoint": 30,
            "mean_tokens_per_s": 1.0, "mean_mfu": 0.1}
  monkeypatch.setattr(quickstart.loop, "run", run)
  monkeypatch.setattr(quickstart, "unigram_entropy", lambda d, v: 2.0)
  monkeypatch.setattr(quickstart, "load_model", lambda d, cfg: _Next())
  return calls


def _run(config, tmp_path, **kw):
  args = {"prompt": "def f():", "new_tokens": 3, "temperature": 0.0, **kw}
  return quickstart.run(config, str(tmp_path), **args)


def test_final_loss_is_the_mean_of_the_last_20_steps(stubbed, tmp_path):
  out = _run(pretrain.get_config("tiny"), tmp_path)
  assert stubbed == ["train"]
  assert out["final_loss"] == pytest.approx(np.mean(np.arange(10, 30)))  # 19.5; a mutant took 10 steps
  assert out["loss_over_unigram"] == pytest.approx(19.5 / 2.0)
  assert out["steps_this_launch"] == 30 and out["decode_max_logit_diff"] == 0.0


def test_new_tokens_bounds_and_the_pipeline_are_checked_before_training(stubbed, tmp_path):
  """The prompt + new tokens + 1 must fit max_seq_len (256): the largest such new_tokens trains, one
  more is refused; a negative new_tokens trained for minutes and then failed in init_cache; a
  pipeline other than grain (no prepared corpus to compare with) is refused."""
  config = pretrain.get_config("tiny")
  n = len(load_tokenizer(default_tokenizer_path("tiny")).encode("def f():"))
  with pytest.raises(ValueError, match=rf"--new_tokens={256 - n}: the prompt \({n} tokens\)"):
    _run(config, tmp_path, new_tokens=256 - n)
  with pytest.raises(ValueError, match=r"--new_tokens=-3: must be an int >= 0"):
    _run(config, tmp_path, new_tokens=-3)
  for t in (math.nan, math.inf):
    with pytest.raises(ValueError, match=rf"--temperature={t}: must be a finite number"):
      _run(config, tmp_path, temperature=t)
  config.data.pipeline = "bytes"
  with pytest.raises(ValueError, match=r"config.data.pipeline='bytes': .* needs 'grain'"):
    _run(config, tmp_path)
  assert stubbed == []
  config.data.pipeline = "grain"
  _run(config, tmp_path, new_tokens=256 - n - 1)
  assert stubbed == ["train"]


def test_unigram_entropy_of_a_prepared_corpus(tmp_path):
  """Two documents, "aaaa" and "ab", each + eos: the entropy of the token counts, computed here from
  the tokenizer's own encoding (a mutant dropped the tokens seen once)."""
  tok = load_tokenizer(default_tokenizer_path("tiny"))
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "0.txt").write_text("aaaa")
  (tmp_path / "a" / "1.txt").write_text("ab")
  data.prepare(data.parse_sources(f"text:{tmp_path}/a/*.txt=1"), tok, tmp_path / "p", log=lambda s: None)
  tokens = tok.encode("aaaa") + [tok.eos_id] + tok.encode("ab") + [tok.eos_id]
  counts = [tokens.count(t) for t in set(tokens)]
  assert 1 in counts  # a token seen once
  want = -sum(c / len(tokens) * math.log(c / len(tokens)) for c in counts)
  assert quickstart.unigram_entropy(str(tmp_path / "p"), tok.vocab_size) == pytest.approx(want, rel=1e-12)


def test_a_relaunch_of_a_finished_run_reports_the_logged_losses(stubbed, monkeypatch, tmp_path):
  """A launch that trained nothing (the run had finished) took the mean of no losses (NaN); it takes
  those metrics.jsonl logged for the last 20 steps (every log_every-th; a step a resumed launch logged
  again counts its last line), or None when there are none."""
  monkeypatch.setattr(quickstart.loop, "run", lambda config, workdir: {
      "prepared_dir": "prep", "losses": [], "checkpoint_dir": "ck", "latest_checkpoint": 30,
      "mean_tokens_per_s": None, "mean_mfu": None})
  out = _run(pretrain.get_config("tiny"), tmp_path)
  assert (out["final_loss"], out["final_loss_steps"], out["loss_over_unigram"]) == (None, 0, None)
  lines = [{"step": 0, "loss": 9.0}, {"step": 10, "loss": 5.0}, {"step": 20, "loss": 4.0},
           {"step": 29, "loss": 9.0}, {"step": 20, "loss": 3.0}, {"step": 29, "loss": 1.0, "mfu": 0.1},
           {"step": 9, "loss": 7.0}, {"step": 15}]
  cut = '{"step": 28, "loss": 0.'  # the last line of a killed launch, then blank, non-object lines
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + cut + "\n\n[1]\n")
  out = _run(pretrain.get_config("tiny"), tmp_path)
  # steps 10..29: 5.0, then step 20's and step 29's last lines (3.0, 1.0); steps 0 and 9 are earlier
  assert (out["final_loss"], out["final_loss_steps"], out["loss_over_unigram"]) == (3.0, 3, 1.5)
  assert out["steps_this_launch"] == 0
  assert quickstart.logged_losses(str(tmp_path), 0, 30) == [9.0, 7.0, 5.0, 3.0, 1.0]
