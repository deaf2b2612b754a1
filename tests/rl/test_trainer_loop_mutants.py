"""rl/train/trainer.run's step loop and RLRun.update's bookkeeping, which mutation testing found
unchecked outside the slow end-to-end runs: which steps run after a resume, what each checkpoint
saves (the step, the sampler positions before the next step's draws), the evaluation schedule,
asynchronous staleness and syncs, trajectories of a step without an update, and the update's
metrics and inputs. The rollouts, model programs and checkpointer are scripted stand-ins."""

import json
import types

import jax.numpy as jnp
import numpy as np
import pytest

from configs import rl as rl_configs
from rl.agent.episode import Episode, TurnSpan
from rl.train import trainer
from rl.train import update as update_lib


def _config(**rl):
  config = rl_configs.get_config("grpo,tiny")
  config.rl.update(**rl)
  config.metrics.tensorboard = False
  return config


def _fake_run_class(log, start=0, failing=(), empty=(), nan=()):
  """An RLRun whose model, engine and checkpointer are stand-ins; every call is appended to `log`.
  Each rollout draws 2 tasks from the real sampler (its positions move by 2 per step)."""

  class Fake(trainer.RLRun):
    def build(self):
      self.start, self.last_played = start, []
      self.ckpt = types.SimpleNamespace(wait=lambda: None, latest_step=lambda: int(self.rl.steps))

    def rollout(self, step):
      draws = self.sampler.draw(step * 1000, 2)
      log.append(("rollout", step))
      eps = [Episode(f"s{step}-{t.id}", "math", "high") for _, t in draws]
      stats = {"groups": 1, "groups_dropped": 0, "groups_invalid": 0, "first_failure": None,
               "by_source": {"math": 0.25 * (step + 1)}}
      if step in failing:
        eps, stats = [], {**stats, "groups": 0, "groups_invalid": 1, "first_failure": f"down at {step}"}
      if step in empty:  # every group dropped (equal rewards): played, nothing to train on
        self.last_played, eps, stats = [Episode(f"played-{step}", "math", "high")], [], {**stats, "groups": 0}
      return eps, ["math"] * len(eps), stats

    def update(self, episodes, sync=True):
      step = episodes[0].task_id.split("-")[0]
      log.append(("update", step, sync))
      return {"loss": float("nan"), "finite": 0.0} if int(step[1:]) in nan else {"loss": 1.0}

    def sync_weights(self):
      log.append(("sync",))
      return 0.5

    def evaluate(self, step):
      log.append(("eval", step))
      return {"eval/x": float(step)}

    def write_trajectories(self, step, episodes):
      log.append(("traj", step, [e.task_id.split("-")[0] for e in episodes]))

    def save(self, step, force=False, sampler_state=None):
      state = sampler_state or self.sampler.get_state()
      log.append(("save", step, force, state["positions"]["math"], dict(state["fast"])))
      return True

    def close(self):
      log.append(("close",))

  return Fake


def _go(monkeypatch, tmp_path, log, config, **fake):
  monkeypatch.setattr(trainer, "RLRun", _fake_run_class(log, **fake))
  summary = trainer.run(config, str(tmp_path))
  records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  return summary, records


def _ema(rates, fast=0.3):
  """The fast success average after each step (started at the first rate)."""
  out, v = [], None
  for r in rates:
    v = r if v is None else v + fast * (r - v)
    out.append(v)
  return out


def test_sync_loop_saves_evaluates_and_logs_each_step(monkeypatch, tmp_path):
  log = []
  summary, records = _go(monkeypatch, tmp_path, log, _config(steps=5, eval_every=2), empty=(2,))
  assert [x[1] for x in log if x[0] == "rollout"] == [0, 1, 2, 3, 4]
  assert [x for x in log if x[0] == "update"] == [("update", f"s{s}", True) for s in (0, 1, 3, 4)]
  assert [x for x in log if x[0] == "eval"] == [("eval", 2), ("eval", 4), ("eval", 5)]  # every 2, the last
  assert ("traj", 2, ["played"]) in log and ("traj", 3, ["s3", "s3"]) in log  # no update: what was played
  fast = _ema([0.25 * (s + 1) for s in range(5)])
  saves = [x for x in log if x[0] == "save"]
  assert [x[1:4] for x in saves] == [(s + 1, False, 2 * (s + 1)) for s in range(5)] + [(5, True, 10)]
  for s in range(5):
    assert saves[s][4]["math"] == pytest.approx(fast[s]), s  # the EMA observed this step's success
  assert log[-1] == ("close",) and ("sync",) not in log
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
  assert all(r["staleness"] == 0.0 and r["mix/math"] == 1.0 and r["groups"] in (0, 1) for r in records)
  assert [r.get("eval/x") for r in records] == [None, 2.0, None, 4.0, 5.0]
  assert "by_source" not in records[0] and "first_failure" not in records[0]
  assert summary["start_step"] == 0 and summary["latest_checkpoint"] == 5 and len(summary["history"]) == 5


def test_a_resumed_run_plays_only_the_remaining_steps(monkeypatch, tmp_path):
  log = []
  summary, records = _go(monkeypatch, tmp_path, log, _config(steps=5), start=3)
  assert [x[1] for x in log if x[0] == "rollout"] == [3, 4]
  assert [x[1] for x in log if x[0] == "save"] == [4, 5, 5]
  assert [r["step"] for r in records] == [3, 4] and summary["start_step"] == 3
  assert len(summary["history"]) == 2


def test_async_rollouts_save_the_positions_before_the_next_steps_draws(monkeypatch, tmp_path):
  """Step n+1's rollout runs (and draws) while step n updates; step n's checkpoint holds the sampler
  positions before those draws, so a resume redraws step n+1's tasks. The engine is synced by the
  loop once the next rollout is done (the update does not sync), and no rollout past the last step."""
  log = []
  _, records = _go(monkeypatch, tmp_path, log, _config(steps=3, async_rollouts=True))
  assert sorted(x[1] for x in log if x[0] == "rollout") == [0, 1, 2]
  assert [x for x in log if x[0] == "update"] == [("update", "s0", False), ("update", "s1", False),
                                                  ("update", "s2", True)]
  assert log.count(("sync",)) == 2
  saves = [x[1:4] for x in log if x[0] == "save"]
  assert saves == [(1, False, 2), (2, False, 4), (3, False, 6), (3, True, 6)]
  assert [r["staleness"] for r in records] == [0.0, 1.0, 1.0]
  assert [r["sync_s"] for r in records[:2]] == [0.5, 0.5]


def test_failed_steps_stop_the_run_after_the_limit(monkeypatch, tmp_path):
  log = []
  with pytest.raises(RuntimeError, match=r"RL steps 1\.\.3: every group failed.*step 3: down at 3"):
    _go(monkeypatch, tmp_path, log, _config(steps=6, max_failed_steps=3), failing=(1, 2, 3))
  assert [x[1] for x in log if x[0] == "save"] == [1, 2, 3]  # step 3 is not saved
  assert log[-1] == ("close",)


def test_adaptive_mixture_weights_are_logged_and_a_nan_step_stops(monkeypatch, tmp_path):
  """mix/<source> is the adaptive weight after the step's observation (not the base weight): step 0
  sets both averages (no progress: the floor alone, 1/2 each); step 1 gives math progress
  |0.325 - 0.2625| (the top), so math gets 1 + 0.1 against terminal's 0.1. A step whose loss is
  not finite stops the run under nan_policy='stop', before it is saved."""
  log = []
  config = _config(steps=3, mixture="math=1,terminal=1", adaptive=True, adaptive_floor=0.1)
  with pytest.raises(FloatingPointError, match="RL step 2: loss nan"):
    _go(monkeypatch, tmp_path, log, config, nan=(2,))
  records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [0, 1]
  assert records[0]["mix/math"] == pytest.approx(0.5) and records[0]["mix/terminal"] == pytest.approx(0.5)
  assert records[1]["mix/math"] == pytest.approx(1.1 / 1.2)
  assert records[1]["mix/terminal"] == pytest.approx(0.1 / 1.2)
  assert [x[1] for x in log if x[0] == "save"] == [1, 2]


# ---- RLRun.update with stand-in programs ----------------------------------------------------------

def _episode(i, tier, reward, n):
  ids = [100 + i] + [10 + i] * n
  return Episode(f"t{i // 2}", "math", tier, token_ids=ids, loss_mask=[0] + [1] * n,
                 logprobs=[0.0] + [-0.1 * (i + 1)] * n, turns=[TurnSpan(0, 1, n + 1, "stop")], reward=reward)


def test_update_metrics_reference_kl_and_inputs(monkeypatch, tmp_path):
  """Rows of 3, 5, 2 and 4 tokens in micro-batches of 2 (longest first: rows 1, 3 | 0, 2). Loss
  terms add up over micro-batches and the rest are token averages; the engine's scores land on
  their own rows; the in-reward KL (k1, coef 0.5) to the reference is subtracted from each reward;
  a non-finite loss reaches apply_grads as not finite; updates_per_step passes each apply once."""
  r = trainer.RLRun(_config(micro_batch=2, pad_multiple=4, updates_per_step=2, kl="k1", kl_coef=0.5,
                            kl_place="in_reward"), str(tmp_path))
  r.model, r.optimizer, r.ref_model = "policy", None, "reference"
  r._micro = lambda arrays, rows, t: {k: v[rows] if v.ndim == 1 else v[rows, :t] for k, v in arrays.items()}
  lengths, rewards = [3, 5, 2, 4], [1.0, 0.0, 1.0, 1.0]
  eps = [_episode(i, "high", rewards[i], n) for i, n in enumerate(lengths)]
  seen, applied = [], []

  def score(model, batch, replay=False):
    row = batch["inputs"][:, :1] - 100.0  # each row's index
    scale = {"policy": 0.01, "reference": 0.02}[model]
    return (-scale * (row + 1) * np.ones(batch["inputs"].shape), (row + 1) * np.ones(batch["inputs"].shape),
            jnp.asarray(-1.0))

  def micro_grads(model, optimizer, batch, obj, tc, n_micro, replay=False):
    rows = (batch["inputs"][:, 0] - 100).tolist()
    seen.append((rows, batch["logp_old"].copy(), batch["advantages"].copy()))
    loss = float("nan") if len(seen) == 4 else float(sum(rows))
    return {"g": jnp.asarray(float(len(rows)))}, {"loss": jnp.asarray(loss), "policy_loss": jnp.asarray(2.0),
                                                  "abs_dlogp": jnp.asarray(float(rows[0]))}

  def apply_grads(model, optimizer, grads, load, tc, loss_finite):
    applied.append((float(grads["g"]), bool(loss_finite)))
    return {"grad_norm": jnp.asarray(3.0)}

  monkeypatch.setattr(update_lib, "score", score)
  monkeypatch.setattr(update_lib, "micro_grads", micro_grads)
  monkeypatch.setattr(update_lib, "apply_grads", apply_grads)
  m = r.update(eps, sync=False)
  assert [rows for rows, _, _ in seen] == [[1, 3], [0, 2]] * 2
  assert applied == [(4.0, True), (4.0, False)]  # both micro-batches summed; pass 2's loss is NaN
  for rows, logp_old, _ in seen:
    for k, i in enumerate(rows):
      assert np.allclose(logp_old[k, :lengths[i]], -0.01 * (i + 1)), i
  # in-reward KL: 0.5 x sum over sampled tokens of (rollout - reference) log-probs
  kl = [0.5 * n * (-0.1 * (i + 1) + 0.02 * (i + 1)) for i, n in enumerate(lengths)]
  shaped = [rewards[i] - kl[i] for i in range(4)]
  assert m["reward"] == pytest.approx(np.mean(shaped))
  assert m["correct"] == pytest.approx(np.mean(rewards))
  assert m["entropy"] == pytest.approx(np.mean([1, 2, 3, 4]))  # row i's stand-in entropy is i + 1
  assert m["loss"] != m["loss"]  # the last pass's: NaN from its second micro-batch
  assert m["policy_loss"] == pytest.approx(4.0)  # 2 per micro-batch, added
  assert m["abs_dlogp"] == pytest.approx((1 * 9 + 0 * 5) / 14)  # token-weighted: rows 1, 3 (9) | 0, 2 (5)
  assert m["grad_norm"] == 3.0 and m["tokens"] == 14 and m["batch_rows"] == 4
  assert m["batch_len"] == 8 and m["padded_tokens"] == 2 * 8 + 2 * 4  # each micro-batch its own length
  # group (t0: rows 0, 1; t1: rows 2, 3) advantages of the shaped rewards
  adv = np.zeros(4)
  for a, b in ((0, 1), (2, 3)):
    pair = np.array([shaped[a], shaped[b]])
    adv[[a, b]] = (pair - pair.mean()) / (pair.std() + 1e-6)
  for rows, _, got in seen:
    np.testing.assert_allclose(got, adv[rows], rtol=1e-5)


def test_play_runs_this_processs_groups_and_returns_every_process_episodes(monkeypatch, tmp_path):
  """Process 1 of 2 with 5 groups of 2 jobs plays groups 1 and 3 (whole groups, every 2nd), and
  returns all 10 episodes in job order once process 0's groups 0, 2, 4 arrive."""
  import jax

  from rl.train import multiprocess as mp
  r = trainer.RLRun(_config(samples_per_prompt=2), str(tmp_path))
  r.engine, r.policy, r.executor = types.SimpleNamespace(slots=3), None, None
  jobs = [f"g{g}s{s}" for g in range(5) for s in range(2)]
  played = []

  async def run_episodes(mine, policy, executor, concurrency, config):
    played.append((list(mine), concurrency))
    return [f"ep:{j}" for j in mine]

  monkeypatch.setattr(trainer, "run_episodes", run_episodes)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(mp, "gather_objects", lambda eps: [[f"ep:g{g}s{s}" for g in (0, 2, 4) for s in (0, 1)],
                                                         list(eps)])
  got = r._play(jobs)
  assert played == [(["g1s0", "g1s1", "g3s0", "g3s1"], 3)]
  assert got == [f"ep:{j}" for j in jobs]
