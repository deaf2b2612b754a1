"""rl/train/trainer.py's bookkeeping, which mutation testing found unchecked outside the slow end-to-end
runs: each step's jobs (tasks, tiers, seeds), dynamic sampling's rounds and stats, the per-domain
metrics, trajectories, the resumed origin and what a checkpoint's data_state holds. RLRun is
built without its model or engine; `_play` is replaced by a scripted rollout."""

import dataclasses
import json
import types

import numpy as np
import pytest

from configs import rl as rl_configs
from rl.agent.episode import Episode
from rl.tasks.generators import math as math_gen
from rl.tasks.task_files import write_tasks
from rl.train.mixture import MixtureSampler
from serving.types import Message, TextPart


def _run(tmp_path, algorithm="grpo", **rl):
  from rl.train.trainer import RLRun
  config = rl_configs.get_config(f"{algorithm},tiny")
  config.rl.update(**rl)
  config.metrics.tensorboard = False
  return RLRun(config, str(tmp_path))


def test_jobs_draw_key_tiers_and_seeds(tmp_path):
  """Round r of step s draws with key s * 1000 + r; each prompt's tier comes from
  rng([seed, s, r, 11]) over the sorted tier names ('off' plays with thinking off); the group's
  samples share task and tier, and sample g of prompt j has seed
  (seed * 1_000_003 + s * 10_007 + r * 1_009 + j * 101 + g) mod 2^31."""
  mix = {"math": 1.0, "terminal": 1.0}
  r = _run(tmp_path, seed=3, prompts_per_step=8, samples_per_prompt=2, tiers="off=1,high=3",
           temperature=0.7, mixture="math=1,terminal=1")
  jobs, sources = r._jobs(2, 1)
  want = MixtureSampler(mix, {"math": 0, "terminal": 0}, seed=3).draw(2001, 8)
  picks = np.random.default_rng([3, 2, 1, 11]).choice(2, size=8, p=[0.75, 0.25])  # sorted: high, off
  want_tiers = [("high", None)[i] for i in picks]
  assert len(jobs) == 16 and sources == [s for s, _ in want for _ in range(2)]
  for n, (task, tier, sampling) in enumerate(jobs):
    j, g = divmod(n, 2)
    assert task.id == want[j][1].id and tier == want_tiers[j], n
    assert sampling.seed == (3 * 1_000_003 + 2 * 10_007 + 1 * 1_009 + j * 101 + g) % 2**31, n
    assert sampling.temperature == 0.7 and sampling.max_tokens_per_turn == 48
  # both tiers and both sources occur, so the mappings are checked
  assert set(want_tiers) == {None, "high"} and set(sources) == {"math", "terminal"}
  # another step's first round: its own key and seeds
  r0 = _run(tmp_path, seed=3, prompts_per_step=8, samples_per_prompt=2, mixture="math=1,terminal=1")
  jobs0, _ = r0._jobs(5, 0)
  assert [s.seed for _, _, s in jobs0] == [(3 * 1_000_003 + 5 * 10_007 + j * 101 + g) for j in range(8)
                                           for g in range(2)]
  first = MixtureSampler(mix, {"math": 0, "terminal": 0}, seed=3).draw(5000, 8)
  assert [t.id for t, _, _ in jobs0[::2]] == [t.id for _, t in first]


HI, LO, ERR = "hi", "lo", "err"
# Per round, the outcomes of its 4 jobs (2 prompts x 2 samples); group 0 is math, group 1 code.
PLAN = [[HI, LO, HI, HI],    # round 0: group 0 mixed (kept), group 1 equal (dropped)
        [ERR, HI, HI, HI],   # round 1: group 0 has a failed episode (invalid), group 1 equal (dropped)
        [LO, HI, HI, LO]]    # round 2: both mixed (kept): 6 episodes kept, enough


def _scripted(r, plan):
  """A `_play` that ends job j of round k as plan[k][j] (reward 0.5 with success for HI: the
  success rate and the reward differ), with generated_tokens 10 * k + j; the executor's busy time
  grows by 1.5 s per round."""
  r.executor = types.SimpleNamespace(busy_s=10.0)
  calls = []

  def play(jobs):
    k = len(calls)
    calls.append(jobs)
    r.executor.busy_s += 1.5
    out = []
    for j, (task, tier, _) in enumerate(jobs):
      what = plan[k][j]
      out.append(Episode(task.id, "math" if j < 2 else "code", tier, reward=0.5 if what == HI else 0.0,
                         success=what == HI, end="error" if what == ERR else "answer",
                         error="boom" if what == ERR else None, generated_tokens=10 * k + j))
    return out

  r._play = play
  return calls


def test_dynamic_sampling_rounds_and_stats(tmp_path):
  path = tmp_path / "tasks.jsonl"
  write_tasks(math_gen.generate(split="train", difficulty=0, n=16), path)
  source = f"file:{path}"
  r = _run(tmp_path / "w", "dapo", mixture=f"{source}=1", prompts_per_step=2, samples_per_prompt=2,
           max_refills=2)
  calls = _scripted(r, PLAN)
  kept, sources, stats = r.rollout(0)
  assert len(calls) == 3 == stats["rounds"]
  # kept: round 0's group 0 and all of round 2, in play order
  assert [e.generated_tokens for e in kept] == [0, 1, 20, 21, 22, 23]
  assert sources == [source] * 6
  assert [e.generated_tokens for e in r.last_played] == [20, 21, 22, 23]
  # valid episodes (round 1's failed group left out): successes in play order
  played = [1, 0, 1, 1] + [1, 1] + [0, 1, 1, 0]
  assert stats["episodes_played"] == 10
  assert stats["groups"] == 5 and stats["groups_invalid"] == 1 and stats["groups_dropped"] == 2
  assert stats["groups_dropped/code"] == 2 and "groups_dropped/math" not in stats
  assert stats["first_failure"] == "boom"  # from round 1, kept through round 2
  assert stats["played_success"] == pytest.approx(np.mean(played))
  assert stats["played_success/math"] == pytest.approx(np.mean([1, 0, 0, 1]))
  assert stats["played_success/code"] == pytest.approx(np.mean([1, 1, 1, 1, 1, 0]))
  assert stats["by_source"] == {source: pytest.approx(0.7)}  # keyed by the source, not the domain
  assert stats["generated_tokens"] == 0 + 1 + 20 + 21 + 22 + 23
  assert stats["env_busy_s"] == pytest.approx(4.5)
  # the next step's round 0 draws new tasks (the stream moved on)
  assert calls[1][0][0].id != calls[0][0][0].id != calls[2][0][0].id


def test_dynamic_sampling_stops_once_the_batch_is_full(tmp_path):
  """prompts_per_step x samples_per_prompt kept episodes end the refills (exactly full counts)."""
  r = _run(tmp_path, "dapo", prompts_per_step=2, samples_per_prompt=2, max_refills=2)
  calls = _scripted(r, [[HI, LO, LO, HI]] * 3)
  kept, _, stats = r.rollout(0)
  assert len(calls) == 1 and stats["rounds"] == 1 and len(kept) == 4 and stats["groups_dropped"] == 0
  # without dynamic sampling one round is played and every valid group kept, equal rewards too
  r = _run(tmp_path, "grpo", prompts_per_step=2, samples_per_prompt=2, max_refills=2)
  calls = _scripted(r, [[HI, HI, LO, LO]] * 3)
  kept, _, stats = r.rollout(0)
  assert len(calls) == 1 and len(kept) == 4 and stats["groups_dropped"] == 0


def test_a_step_without_groups_to_train_on_keeps_what_it_played(tmp_path):
  """The loop writes `last_played` as the trajectories of a step with nothing to train on; it was
  the last round's kept episodes, always empty exactly then, so such steps wrote no trajectory."""
  r = _run(tmp_path, "dapo", prompts_per_step=2, samples_per_prompt=2, max_refills=1)
  calls = _scripted(r, [[HI, HI, LO, LO], [LO, LO, ERR, LO]])
  kept, _, stats = r.rollout(0)
  assert kept == [] and stats["rounds"] == 2 and stats["groups_dropped"] == 3
  assert [e.task_id for e in r.last_played] == [t.id for t, _, _ in calls[1]]
  assert [e.end for e in r.last_played] == ["answer", "answer", "error", "answer"]


def test_domain_metrics_against_written_out_means(tmp_path):
  r = _run(tmp_path)
  say = [Message("user", [TextPart("q")]), Message("assistant", [TextPart("a")])]
  eps = [Episode("a", "math", "high", success=True, generated_tokens=10, thinking_tokens=4, messages=say * 2,
                 tool_errors=1, malformed_calls=0, end="length", grade={"grader_failed": True}, tool_calls=5),
         Episode("b", "code", "high", success=False, generated_tokens=6, thinking_tokens=0, messages=say,
                 tool_errors=0, malformed_calls=2, end="max_turns", tool_calls=3),
         Episode("c", "math", "high", success=False, generated_tokens=2, thinking_tokens=1, messages=say,
                 end="answer")]
  rewards = np.array([0.3, 1.0, -0.5])
  parts = {"correct": np.array([0.5, 1.0, 0.0]), "budget": np.array([-0.2, 0.0, 0.0])}
  mask = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
  entropy = np.array([[2.0, 4.0, 9.0, 9.0], [1.0, 7.0, 7.0, 7.0], [5.0, 5.0, 5.0, 5.0]])
  m = r._domain_metrics(eps, rewards, parts, {"mask": mask}, entropy)
  want = {"reward": [0.3, 1.0, -0.5], "correct": [0.5, 1.0, 0.0], "success": [1, 0, 0],
          "response_tokens": [10, 6, 2], "thinking_tokens": [4, 0, 1], "turns": [2, 1, 1],
          "tool_errors": [1, 0, 0], "malformed_calls": [0, 2, 0], "truncated": [1, 0, 0],
          "grader_failed": [1, 0, 0], "forced_think_end": [1, 0, 0],
          "entropy": [3.0, 1.0, 0.0]}  # over each row's sampled tokens; a row without any: 0
  for name, v in want.items():
    assert m[name] == pytest.approx(np.mean(v)), name
    assert m[f"{name}/math"] == pytest.approx((v[0] + v[2]) / 2), name
    assert m[f"{name}/code"] == pytest.approx(v[1]), name


def test_trajectories_append_the_first_n_per_step(tmp_path):
  r = _run(tmp_path, trajectories_per_step=2)
  say = [Message("user", [TextPart("2+2?")]), Message("assistant", [TextPart("4")], thinking="t")]
  eps = [Episode(f"t{i}", "math", "high", messages=say, reward=float(i)) for i in range(3)]
  r.write_trajectories(4, eps)
  r.write_trajectories(5, eps[::-1])
  lines = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
  assert [(x["step"], x["task_id"], x["reward"]) for x in lines] == [(4, "t0", 0.0), (4, "t1", 1.0),
                                                                    (5, "t2", 2.0), (5, "t1", 1.0)]
  assert lines[0]["messages"][1] == {"role": "assistant", "thinking": "t", "text": "4", "tool_calls": []}
  off = _run(tmp_path / "off", trajectories_per_step=0)
  off.write_trajectories(0, eps)
  assert not (tmp_path / "off" / "trajectories.jsonl").exists()


def test_resumed_origin_keeps_the_saved_one(tmp_path, caplog):
  r = _run(tmp_path)
  saved = {"init_from": "/ckpt/a", "step": 7}
  assert r._resumed_origin(dict(saved), "/ckpt/a") == saved
  assert r._resumed_origin(None, "/ckpt/b") == {"init_from": "/ckpt/b", "step": None}  # an old checkpoint
  assert r._resumed_origin(dict(saved), "/ckpt/b") == saved  # no KL reference: the override is ignored
  r.obj = dataclasses.replace(r.obj, kl="k3", kl_coef=0.1)
  with pytest.raises(ValueError, match=r"init_from='/ckpt/a' \(step 7\), and it is now '/ckpt/b'"):
    r._resumed_origin(dict(saved), "/ckpt/b")
  assert r._resumed_origin(dict(saved), "/ckpt/a") == saved


def test_a_resume_without_init_from_keeps_the_origin(tmp_path, caplog):
  """Resuming a KL run without repeating config.checkpoint.init_from was refused with 'it is now ''
  ... Drop the override', advice the command already followed (and without KL it warned that an
  override was ignored). No init_from names no other weights: the run keeps its saved origin."""
  r = _run(tmp_path, kl="k3", kl_coef=0.1)
  saved = {"init_from": "/ckpt/a", "step": 7}
  with caplog.at_level("WARNING"):
    assert r._resumed_origin(dict(saved), "") == saved
    assert _run(tmp_path)._resumed_origin(dict(saved), "") == saved
  assert "override" not in caplog.text


def test_save_keeps_the_given_sampler_state_and_the_origin(tmp_path):
  r = _run(tmp_path)
  got = {}
  r.ckpt = types.SimpleNamespace(save=lambda step, **kw: got.update(step=step, **kw) or True)
  r.model = r.optimizer = None
  r.origin = {"init_from": "/x", "step": 3}
  r.sampler.draw(0, 5)  # the live sampler has moved on; the given state is what is saved
  assert r.save(4, sampler_state={"positions": {"math": 2}, "fast": {}, "slow": {}})
  assert got["step"] == 4 and got["force"] is False
  assert got["data_state"] == {"positions": {"math": 2}, "fast": {}, "slow": {},
                               "origin": {"init_from": "/x", "step": 3}}
  r.save(6, force=True)  # none given: the sampler's own
  assert got["data_state"]["positions"] == {"math": 5} and got["force"] is True
