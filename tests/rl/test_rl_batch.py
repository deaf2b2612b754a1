"""rl/train: episodes -> batch arrays, reward shaping, groups; the task mixture and its state."""

import json
import re

import numpy as np
import pytest

from rl.agent.episode import Episode, TurnSpan
from rl.train import batch as batch_lib
from rl.train import objectives as obj_lib
from rl.train.mixture import RL_SEED_BASE, AdaptiveWeights, MixtureSampler, parse_levels, parse_mixture

THINK_END = 99


def _episode(task, tier, ids, mask, logprobs, turns, reward=1.0):
  ep = Episode(task_id=task, domain="math", tier=tier, token_ids=ids, loss_mask=mask, logprobs=logprobs,
               turns=turns)
  ep.reward = reward
  return ep


def _two_turn():
  # prompt [1 2 3], turn 1 generates [4 5 6], tool result [7 8], turn 2 generates [9 THINK_END(forced) 10]
  ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, THINK_END, 10]
  mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1]
  lps = [0, 0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, 0.0, -0.5]
  turns = [TurnSpan(0, 3, 6, "stop"), TurnSpan(6, 8, 11, "stop")]
  return _episode("t0", "high", ids, mask, lps, turns)


def test_to_batch_shifts_and_masks():
  ep = _two_turn()
  short = _episode("t1", "low", [1, 2, 3], [0, 0, 1], [0, 0, -0.7], [TurnSpan(0, 2, 3, "stop")], 0.0)
  o = obj_lib.objective("dapo")
  b = batch_lib.to_batch([ep, short], np.array([0.5, -0.5]), o, pad_multiple=8)
  assert b["inputs"].shape == (2, 16)  # 10 positions padded to a multiple of 8
  np.testing.assert_array_equal(b["inputs"][0, :10], ep.token_ids[:-1])
  np.testing.assert_array_equal(b["targets"][0, :10], ep.token_ids[1:])
  np.testing.assert_array_equal(b["mask"][0, :10], ep.loss_mask[1:])  # tool result and forced token: 0
  np.testing.assert_allclose(b["logp_rollout"][0, :10], ep.logprobs[1:])
  np.testing.assert_array_equal(b["segment_ids"][0], [1] * 10 + [0] * 6)
  np.testing.assert_array_equal(b["positions"][1, :2], [0, 1])
  assert b["mask"][:, 10:].sum() == 0 and b["mask"][1].sum() == 1
  np.testing.assert_allclose(b["weights"].sum(), 1.0, rtol=1e-6)  # token_mean: weights sum to one
  np.testing.assert_array_equal(b["advantages"], [0.5, -0.5])


def test_micro_batches_group_rows_by_length():
  lengths = [5, 130, 700, 64, 640, 129, 1, 300, 768, 200, 130]
  chunks = batch_lib.micro_batches(lengths, 3, 128)
  rows = np.concatenate([r for r, _ in chunks])
  np.testing.assert_array_equal(np.sort(rows), np.arange(len(lengths)))  # every row once
  assert [len(r) for r, _ in chunks] == [3, 3, 3, 2]
  by_len = [lengths[i] for i in rows]
  assert by_len == sorted(lengths, reverse=True)
  assert list(rows[[5, 6]]) == [1, 10]  # equal lengths keep batch order
  for r, t in chunks:  # each cut holds its rows, to the next multiple of 128 and no further
    longest = max(lengths[i] for i in r)
    assert t % 128 == 0 and longest <= t < longest + 128
  assert [t for _, t in chunks] == [768, 384, 256, 128]
  padded = batch_lib.micro_batches(lengths, 3, 128, by_length=False)
  assert [list(r) for r, _ in padded] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
  assert {t for _, t in padded} == {768}
  assert batch_lib.micro_batches([], 3, 128) == []
  with pytest.raises(ValueError, match="config.rl.micro_batch"):
    batch_lib.micro_batches(lengths, 0, 128)


def test_processes_split_whole_groups_and_reassemble_job_order():
  from rl.train import multiprocess as mp
  assert mp.my_groups(5, 0, 2) == [0, 2, 4] and mp.my_groups(5, 1, 2) == [1, 3]
  assert mp.my_groups(3, 0, 1) == [0, 1, 2]
  jobs = [f"g{g}s{s}" for g in range(5) for s in range(3)]  # 5 groups of 3 samples
  played = [[jobs[g * 3 + s] for g in mp.my_groups(5, p, 2) for s in range(3)] for p in range(2)]
  assert mp.in_job_order(played, 5, 3) == jobs
  with pytest.raises(RuntimeError, match="process 1 returned 5 episodes for 2 groups of 3"):
    mp.in_job_order([played[0], played[1][:5]], 5, 3)
  assert mp.gather_objects([1, "a"]) == [[1, "a"]]  # one process: its own list


def test_reward_shaping_and_groups():
  ep = _two_turn()  # the engine forced </think> in turn 2
  clean = _two_turn()
  clean.loss_mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]  # the model closed its thinking itself
  long = _two_turn()
  long.turns = [TurnSpan(0, 3, 6, "stop"), TurnSpan(6, 8, 11, "length")]
  o = obj_lib.objective("dapo", overlong_buffer=2, overlong_penalty=1.0)
  total, parts = batch_lib.shape_rewards([ep, clean, long], o, batch_lib.Shaping(0.25, 4), THINK_END)
  np.testing.assert_allclose(parts["budget"], [-0.25, 0.0, -0.25])
  np.testing.assert_allclose(parts["overlong"], [-0.5, -0.5, -0.5])  # 3 of 4 tokens: half the ramp
  np.testing.assert_allclose(total, parts["correct"] + parts["budget"] + parts["overlong"])
  eps = [_episode("a", "low", [1], [0], [0], []), _episode("a", "high", [1], [0], [0], []),
         _episode("b", "low", [1], [0], [0], []), _episode("a", "low", [1], [0], [0], [])]
  np.testing.assert_array_equal(batch_lib.group_ids(eps), [0, 1, 2, 0])


def test_groups_with_an_unplayed_or_ungraded_episode_are_not_trained_on():
  """An engine failure (end 'error') or a grader failure scored 0 and entered the batch as if the
  policy had failed; its whole group goes (a partial group would skew the advantages)."""
  eps = [_episode(t, "low", [1], [0], [0], []) for t in ("a", "a", "b", "b", "c", "c")]
  eps[1].end = "error"
  eps[2].grade = {"grader_failed": True}
  kept, sources, dropped = batch_lib.drop_invalid(eps, ["s0", "s1", "s2", "s3", "s4", "s5"])
  assert [e.task_id for e in kept] == ["c", "c"] and sources == ["s4", "s5"] and dropped == 2
  assert batch_lib.drop_invalid(eps[4:], ["x", "y"]) == (eps[4:], ["x", "y"], 0)


def test_mixture_parsing_errors_name_the_fix():
  assert parse_mixture("math=1, terminal=2") == {"math": 1.0, "terminal": 2.0}
  with pytest.raises(ValueError, match="unknown source 'chess'"):
    parse_mixture("chess=1")
  with pytest.raises(ValueError, match="is not source=weight"):
    parse_mixture("math")
  with pytest.raises(ValueError, match="at least one source a positive weight"):
    parse_mixture("math=0")
  assert parse_levels("1,cad=0", ["math", "cad"]) == {"math": 1, "cad": 0}
  with pytest.raises(ValueError, match="math level 9 is outside 0..4"):
    parse_levels("9", ["math"])


def test_sampler_is_deterministic_and_resumes_exactly():
  a = MixtureSampler({"math": 1.0, "terminal": 1.0}, {"math": 0, "terminal": 0}, seed=3)
  first = [(s, t.id) for s, t in a.draw(0, 6)]
  state = json.loads(json.dumps(a.get_state()))
  nxt = [(s, t.id) for s, t in a.draw(1, 6)]
  b = MixtureSampler({"math": 1.0, "terminal": 1.0}, {"math": 0, "terminal": 0}, seed=3)
  assert [(s, t.id) for s, t in b.draw(0, 6)] == first
  c = MixtureSampler({"math": 1.0, "terminal": 1.0}, {"math": 0, "terminal": 0}, seed=3)
  c.set_state(state)
  assert [(s, t.id) for s, t in c.draw(1, 6)] == nxt
  assert len({t for _, t in first + nxt}) == 12  # streams never repeat a task
  with pytest.raises(ValueError, match="same config.rl.mixture"):
    MixtureSampler({"math": 1.0, "cad": 1.0}, {}, seed=3).set_state(state)


def test_rl_streams_do_not_replay_the_sft_task_set():
  """SFT trains on generate(seed=config.sft.task_seed); RL's streams draw other tasks."""
  from rl.tasks import generators
  sft_prompts = {t.prompt for t in generators.generate("math", split="train", difficulty=0, n=64, seed=0)}
  drawn = [t for _, t in MixtureSampler({"math": 1.0}, {"math": 0}, seed=0).draw(0, 64)]
  shared = sum(t.prompt in sft_prompts for t in drawn)
  # Before RL_SEED_BASE the first chunk was SFT's first 64 tasks (64 shared); now only chance
  # coincidences remain (8 here: level 0 draws one-digit operands often, and those questions repeat).
  assert shared <= 16, shared
  assert all(f"-s{RL_SEED_BASE}-" in t.id for t in drawn)


def test_file_source(tmp_path):
  from rl.tasks.generators import math as gen
  from rl.tasks.task_files import write_tasks
  path = tmp_path / "t.jsonl"
  write_tasks(gen.generate(split="train", difficulty=0, n=3), path)
  s = MixtureSampler({f"file:{path}": 1.0}, {}, seed=0)
  ids = [t.id for _, t in s.draw(0, 7)]
  assert len(set(ids)) == 7 and all(i.rsplit("#p", 1)[0].startswith("math-train") for i in ids)


def test_adaptive_weights_follow_progress_with_a_floor():
  w = AdaptiveWeights({"math": 1.0, "code": 1.0, "cad": 1.0}, enabled=True, floor=0.1)
  assert w.weights() == pytest.approx({"math": 1 / 3, "code": 1 / 3, "cad": 1 / 3})
  for step in range(20):  # math improves, code is flat, cad is flat at zero
    w.observe({"math": min(1.0, 0.05 * step), "code": 0.5, "cad": 0.0})
  ws = w.weights()
  assert ws["math"] > 0.7 and ws["code"] > 0 and ws["cad"] > 0
  assert ws["code"] == pytest.approx(ws["cad"]) and sum(ws.values()) == pytest.approx(1.0)
  assert not AdaptiveWeights({"math": 1.0}, enabled=False).fast


def test_config_knobs_reach_the_objective_and_bad_values_name_the_field():
  from configs import rl as rl_config
  from rl.sft.data import parse_tier_mix as parse_tiers
  from rl.train.checks import objective_from_config
  from rl.train.trainer import RLRun
  config = rl_config.get_config("dapo,tiny")
  assert objective_from_config(config.rl).eps_high == 0.28  # the preset
  config.rl.eps_high = 0.35
  config.rl.dynamic_sampling = False
  o = objective_from_config(config.rl)
  assert o.eps_high == 0.35 and not o.dynamic_sampling and o.aggregation == "token_mean"
  assert parse_tiers("low=1,high=3") == {"low": 1.0, "high": 3.0} and parse_tiers("max") == {"max": 1.0}
  with pytest.raises(ValueError, match="unknown tier 'huge'"):
    parse_tiers("huge")
  config.rl.overlong_buffer = 48
  with pytest.raises(ValueError, match="overlong_buffer=48 must be below config.env.max_tokens_per_turn=48"):
    RLRun(config, "/tmp/unused")
  dr = RLRun(rl_config.get_config("dr_grpo,tiny"), "/tmp/unused")
  assert dr.obj.aggregation == "constant" and dr.obj.norm_tokens == 48 * 8  # tokens per turn x turns
  with pytest.raises(ValueError, match="unknown algorithm 'ppo'"):
    rl_config.get_config("ppo")


def test_run_knobs_out_of_range_name_the_field_before_anything_is_built():
  from configs import rl as rl_config
  from rl.sft.data import parse_tier_mix
  from rl.train.checks import check_run_knobs
  from rl.train.trainer import RLRun
  check_run_knobs(rl_config.get_config("grpo").rl)  # every preset's defaults pass
  check_run_knobs(rl_config.get_config("grpo,tiny").rl)
  for field, value, message in (
      ("prompts_per_step", 0, "prompts_per_step=0: must be an int >= 1"),
      ("samples_per_prompt", 1, "samples_per_prompt=1: must be an int >= 2 (the group size"),
      ("updates_per_step", 0, "updates_per_step=0: must be an int >= 1"),
      ("steps", -1, "steps=-1: must be an int >= 0"),
      ("micro_batch", 0, "micro_batch=0: must be an int >= 1"),
      ("eval_n", 0, "eval_n=0: must be an int >= 1"),
      ("max_refills", -2, "max_refills=-2: must be an int >= 0"),
      ("budget_penalty", -0.5, "budget_penalty=-0.5: must be a finite number >= 0"),
      ("temperature", float("nan"), "temperature=nan: must be a finite number >= 0"),
      ("temperature", 0.0, "temperature=0: greedy samples of a prompt are all the same episode"),
  ):
    config = rl_config.get_config("grpo,tiny")
    config.rl[field] = value
    with pytest.raises(ValueError, match=re.escape(f"config.rl.{message}")):
      RLRun(config, "/tmp/unused")
  config = rl_config.get_config("grpo,tiny")
  config.checkpoint.every = 0  # checked with the run knobs, as pretraining checks it
  with pytest.raises(ValueError, match=re.escape("config.checkpoint.every=0: must be an int >= 1")):
    RLRun(config, "/tmp/unused")
  config = rl_config.get_config("grpo,tiny")
  config.rl.update(adaptive=True, adaptive_floor=0.0)
  with pytest.raises(ValueError, match=r"adaptive_floor=0.0: must be > 0 with adaptive=True"):
    RLRun(config, "/tmp/unused")
  for text, message in (("low=x", "weight 'x' of tier 'low' is not a number"),
                        ("low=-1,high=2", "weight of tier 'low' is -1; weights must be finite and >= 0"),
                        ("high=inf", "weight of tier 'high' is inf")):
    with pytest.raises(ValueError, match=re.escape(f"config.rl.tiers: {message}")):
      parse_tier_mix(text, "config.rl.tiers")


def test_a_resumed_run_keeps_its_kl_reference(caplog):
  """The KL reference is the weights the run started from: a resume reads init_from at the saved
  step, and an init_from that now names other weights is refused (with KL) or ignored (without)."""
  from configs import rl as rl_config
  from rl.train.trainer import RLRun
  config = rl_config.get_config("grpo,tiny")
  config.rl.update(kl="k3", kl_coef=0.1)
  r = RLRun(config, "/tmp/unused")
  saved = {"init_from": "/runs/sft/checkpoints", "step": 300}
  assert r._resumed_origin(saved, "/runs/sft/checkpoints") == saved  # the step is kept, not "latest"
  with pytest.raises(ValueError, match=re.escape("started from config.checkpoint.init_from='/runs/sft/"
                                                 "checkpoints' (step 300), and it is now '/runs/other'")):
    r._resumed_origin(saved, "/runs/other")
  legacy = r._resumed_origin(None, "/runs/sft/checkpoints")  # a checkpoint from before origins
  assert legacy == {"init_from": "/runs/sft/checkpoints", "step": None}
  config.rl.update(kl="none", kl_coef=None)  # a kl_coef without a KL term is refused
  with caplog.at_level("WARNING"):
    assert RLRun(config, "/tmp/unused")._resumed_origin(saved, "/runs/other") == saved
  assert "the override is ignored" in caplog.text


@pytest.mark.parametrize("text", ["math=nan", "math=inf", "math=1e309", "math=1,terminal=-inf"])
def test_mixture_refuses_non_finite_weights(text):
  """A NaN/inf weight passed parse_mixture and died in the sampler after the model was built."""
  with pytest.raises(ValueError, match=r"config\.rl\.mixture: weight of '\w+' is -?(nan|inf); weights must "
                                       r"be finite and >= 0"):
    parse_mixture(text)


def test_mixture_and_levels_refuse_repeated_and_unused_entries():
  """'math=1,math=2' kept the last weight; a level for a domain outside the mixture was ignored."""
  for text in ("math=1,math=2", "math=1,math=0", "file:/t.jsonl=1,terminal=1,file:/t.jsonl=2"):
    with pytest.raises(ValueError, match=r"config\.rl\.mixture: \S+ appears twice"):
      parse_mixture(text)
  with pytest.raises(ValueError, match=r"config\.rl\.difficulty: math appears twice in 'math=1,math=0'"):
    parse_levels("math=1,math=0", ["math"])
  with pytest.raises(ValueError, match=r"config\.rl\.difficulty=.*more than one level for every domain"):
    parse_levels("1,2", ["math"])
  with pytest.raises(ValueError, match=r"config\.rl\.difficulty: cad=1 sets a level for cad, which "
                                       r"config\.rl\.mixture does not draw from \(its domains: math\)"):
    parse_levels("cad=1", ["math"])
  with pytest.raises(ValueError, match=r"config\.rl\.difficulty: math=2 .*\(its domains: none\)"):
    parse_levels("math=2", ["file:/t.jsonl"])
  with pytest.raises(ValueError, match=r"config\.rl\.difficulty='2': config\.rl\.mixture has no generated"):
    parse_levels("2", ["file:/t.jsonl"])
  assert parse_levels("0", ["file:/t.jsonl"]) == {}  # the default level stays harmless
  assert parse_levels("1,math=2", ["math", "cad", "file:/t.jsonl"]) == {"math": 2, "cad": 1}


def test_to_batch_routing_rows_and_mask():
  """Routing [B, T, layers, k] follows the inputs (position p = the token fed at p); routing_mask is
  1 wherever the engine fed the token, whichever experts it chose, expert 0 included."""
  layers, k = 2, 2
  a = _two_turn()  # 11 tokens: 10 inputs; the engine fed every token but the last sampled one
  rng = np.random.default_rng(0)
  a.routing = rng.integers(0, 4, (11, layers, k)).astype(np.int32)
  a.routing[3, 0] = [0, 1]  # expert 0 first in layer 0
  a.routing[5] = 0  # every slot expert 0
  a.routing[10] = -1
  b = _episode("t1", "low", [1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -0.1, -0.2], [TurnSpan(0, 2, 4, "stop")])
  b.routing = np.full((4, layers, k), -1, np.int32)
  b.routing[:2] = [[0, 2], [1, 0]]  # a prefix-cached prompt fed by an earlier request; 2, 3 unfed
  out = batch_lib.to_batch([a, b], np.zeros(2), obj_lib.objective("grpo"), pad_multiple=8)
  assert out["routing"].shape == (2, 16, layers, k)
  for row, ep in enumerate((a, b)):
    n = len(ep.token_ids) - 1
    for p in range(16):
      want = ep.routing[p] if p < n else np.full((layers, k), -1)
      np.testing.assert_array_equal(out["routing"][row, p], want, err_msg=f"row {row} position {p}")
      fed = p < n and bool(np.all(ep.routing[p] >= 0))
      assert out["routing_mask"][row, p] == fed, (row, p)
  assert out["routing_mask"][0, [3, 5]].tolist() == [1, 1]


def _fake_rollout_run(reward_of):
  """An RLRun (dapo,tiny: 2 prompts x 4 samples, up to 2 refills) whose episodes come from
  `reward_of(task index in its stream, sampling seed)` instead of the engine; returns (run, played
  jobs per round)."""
  import types

  from configs import rl as rl_config
  from rl.train.trainer import RLRun
  r = RLRun(rl_config.get_config("dapo,tiny"), "/tmp/unused")
  assert (r.rl.prompts_per_step, r.rl.samples_per_prompt, r.rl.max_refills) == (2, 4, 2)
  r.executor = types.SimpleNamespace(busy_s=0.0)
  played = []

  def play(jobs):
    played.append([(task.id, tier, s.seed) for task, tier, s in jobs])
    eps = []
    for task, tier, s in jobs:
      ep = _episode(task.id, tier, [1, 2], [0, 1], [0.0, -0.1], [TurnSpan(0, 1, 2, "stop")],
                    reward_of(int(task.id.rsplit("-", 1)[1]), s.seed))
      ep.domain, ep.success = task.domain, ep.reward > 0
      eps.append(ep)
    return eps

  r._play = play
  return r, played


def test_dynamic_sampling_drops_equal_groups_and_refills_with_new_prompts():
  # even task indices: every sample scores 1 (no signal); odd ones: half the samples score 1
  r, played = _fake_rollout_run(lambda index, seed: 1.0 if index % 2 == 0 else float(seed % 2))
  kept, sources, stats = r.rollout(0)
  assert len(played) == 2  # round 0 keeps one group of 4: one refill reaches 2 x 4
  assert stats["rounds"] == 2 and stats["episodes_played"] == 16
  assert stats["groups"] == 4 and stats["groups_dropped"] == 2 and stats["groups_dropped/math"] == 2
  want = [e for rnd in played for e in rnd if int(e[0].rsplit("-", 1)[1]) % 2 == 1]
  assert [(e.task_id, e.tier) for e in kept] == [(t, tier) for t, tier, _ in want]
  assert len(kept) == 8 and sources == ["math"] * 8
  for g in set(batch_lib.group_ids(kept)):
    assert len({e.reward for e, k in zip(kept, batch_lib.group_ids(kept), strict=True) if k == g}) == 2
  # the refill plays new prompts with new sampling seeds
  assert not {t for t, _, _ in played[0]} & {t for t, _, _ in played[1]}
  assert not {s for _, _, s in played[0]} & {s for _, _, s in played[1]}
  # success over every played episode (dropped groups included), not only the kept ones
  successes = [int(t.rsplit("-", 1)[1]) % 2 == 0 or s % 2 == 1 for rnd in played for t, _, s in rnd]
  assert stats["played_success"] == pytest.approx(np.mean(successes)) and np.mean(successes) == 0.75


def test_dynamic_sampling_stops_after_max_refills():
  r, played = _fake_rollout_run(lambda index, seed: 0.5)  # no group ever has signal
  kept, sources, stats = r.rollout(3)
  assert len(played) == 3 and stats["rounds"] == 3  # the first round and max_refills=2 refills
  assert kept == [] and sources == [] and stats["groups_dropped"] == stats["groups"] == 6


def test_update_trains_on_advantages_of_each_task_and_tier_group(monkeypatch):
  """RLRun.update's advantages, as the gradient step receives them, equal the plain per-group
  (task, tier) normalisation of the shaped rewards; step metrics add loss terms over micro-batches
  and average the rest by tokens; the engine gets the weights unless the caller syncs. The model
  programs are stand-ins."""
  import jax.numpy as jnp

  from configs import rl as rl_config
  from rl.train import update as update_lib
  from rl.train.trainer import RLRun
  r = RLRun(rl_config.get_config("grpo,tiny"), "/tmp/unused")
  r.model = r.optimizer = r.ref_model = None
  specs = [("a", "low", 1.0), ("a", "low", 0.0), ("a", "low", 0.0), ("a", "high", 1.0), ("a", "high", 1.0),
           ("a", "high", 0.0), ("b", "low", 0.3), ("b", "low", 0.9), ("a", "low", 0.0), ("a", "high", 0.5)]
  eps = [_episode(task, tier, [100 + i, 5, 6, 7 + i % 3], [0, 1 - i % 2, 1, 1], [0, -0.1, -0.2, -0.3],
                  [TurnSpan(0, 1, 4, "stop")], reward) for i, (task, tier, reward) in enumerate(specs)]
  seen = {}

  def score(model, batch, replay=False):
    shape = batch["inputs"].shape
    return jnp.zeros(shape), jnp.zeros(shape), jnp.asarray(-1.0)

  def micro_grads(model, optimizer, batch, obj, tc, n_micro, replay=False):
    index = np.asarray(batch["inputs"][:, 0]) - 100
    seen.update(zip(index.tolist(), np.asarray(batch["advantages"]).tolist(), strict=True))
    tokens = np.asarray(batch["mask"]).sum(1)
    # a loss term (sums over micro-batches) and a token average (the micro-batch's own)
    return {"g": jnp.zeros(())}, {"loss": jnp.asarray(float(index.sum())), "policy_loss": jnp.zeros(()),
                                  "clip_frac": jnp.asarray(float((index * tokens).sum() / tokens.sum()))}

  syncs = []
  monkeypatch.setattr(update_lib, "score", score)
  monkeypatch.setattr(update_lib, "micro_grads", micro_grads)
  monkeypatch.setattr(update_lib, "apply_grads", lambda *a: {"grad_norm": jnp.zeros(())})
  monkeypatch.setattr(r, "sync_weights", lambda: syncs.append(1) or 0.0)
  monkeypatch.setitem(r.rl, "micro_batch", 3)  # 10 rows: micro-batches of 3, 3, 3 and 1 rows
  m = r.update(eps, sync=False)
  assert syncs == []  # asynchronous rollouts: the caller syncs
  tokens = np.array([sum(ep.loss_mask[1:]) for ep in eps], float)
  assert m["loss"] == pytest.approx(sum(range(len(eps))))
  assert m["clip_frac"] == pytest.approx((np.arange(len(eps)) * tokens).sum() / tokens.sum())
  assert m["tokens"] == tokens.sum() and m["batch_rows"] == len(eps)
  r.update(eps, sync=True)
  assert syncs == [1]  # the engine gets the updated weights
  want = []
  for task, tier, reward in specs:
    same = [x for t, ti, x in specs if (t, ti) == (task, tier)]
    mean = sum(same) / len(same)
    std = (sum((x - mean) ** 2 for x in same) / len(same)) ** 0.5
    want.append((reward - mean) / (std + 1e-6))
  np.testing.assert_allclose([seen[i] for i in range(len(specs))], want, rtol=1e-5, atol=1e-6)
