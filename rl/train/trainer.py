"""The joint multi-domain RL loop behind `experiments.rl`.

Each step:
  1. draw `prompts_per_step` tasks from the mixture (rl/train/mixture.py) and a thinking tier
     per prompt (config.rl.tiers), then play `samples_per_prompt` episodes of each through the
     agent loop on the in-process Engine (continuous batching; tools in the worker pool);
  2. shape rewards (correctness, thinking-budget and overlong terms) and compute advantages
     within (task, tier) groups; with dynamic sampling, groups whose rewards are all equal are
     dropped and more prompts are drawn (up to `max_refills` rounds);
  3. score the batch with the trainer's weights (logp_old, entropy), then `updates_per_step`
     passes of micro-batched gradient steps on the chosen objective, TIS-corrected against the
     engine's log-probs;
  4. hand the new weights to the engine (`Engine.update_weights`: no file round trip), log
     per-domain metrics, write a few whole trajectories, checkpoint, and every `eval_every`
     steps evaluate held-out tasks through the harness.

Checkpoints (orbax, as pretraining) hold the policy, optimizer, step and the task sampler's
state (stream positions, adaptive weights); every sampling seed is a function of (seed, step,
index), so a resumed run continues exactly as an uninterrupted one.

Several processes (`experiments.rl --num_processes=N ...`): the update runs on the global mesh;
each process plays whole groups of the step's jobs on its own engine and all exchange the
episodes, so every process builds the same batch (rl/train/multiprocess.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from etils import epath
from flax import nnx

from model.config import model_config
from model.decoder import Horizon
from model.quant import quantize_model
from rl.agent.episode import Episode
from rl.agent.executor import TimedExecutor, make_executor
from rl.agent.loop import LoopConfig, run_episodes
from rl.agent.policy import EnginePolicy, Sampling
from rl.envs.base import EnvContext
from rl.train import batch as batch_lib
from rl.train import multiprocess as mp
from rl.train import objectives as obj_lib
from rl.train import update as update_lib
from rl.train.checks import FailedSteps, check_rl_config, check_rl_resume, check_step_finite
from rl.train.mixture import MixtureSampler
from serving.chat import ChatRenderer
from serving.engine import Engine
from sharding import mesh as mesh_lib
from sharding.rules import activation_spec
from sharding.state import create_sharded_model
from training import batches as batches_lib
from training import metrics as metrics_lib
from training.checkpoint import Checkpointer, restore_params
from training.train_step import TrainConfig, make_train_state

_ADDITIVE = ("loss", "policy_loss")


class RLRun:
  """One RL launch: policy + optimizer + engine + environments + task sampler + checkpointer."""

  def __init__(self, config, workdir: str, devices: Sequence[jax.Device] | None = None):
    """devices: the mesh's devices (default all; config.mesh sizes them as in pretraining)."""
    self.config, self.workdir, self.rl = config, workdir, config.rl
    settings = check_rl_config(config)  # every config.rl / env knob, before anything is built
    self.cfg = model_config(config)
    check_rl_resume(config, self.cfg, epath.Path(workdir) / "checkpoints")
    self.tc = dataclasses.replace(TrainConfig.from_config(config.train), steps=int(config.rl.steps))
    self.obj, self.tiers, self.eval_tiers = settings.objective, settings.tiers, settings.eval_tiers
    self.sampler = MixtureSampler(settings.mixture, settings.levels, seed=int(config.rl.seed),
                                  adaptive=bool(config.rl.adaptive), floor=float(config.rl.adaptive_floor))
    self.shaping = batch_lib.Shaping(budget_penalty=float(config.rl.budget_penalty),
                                     max_tokens_per_turn=int(config.env.max_tokens_per_turn))
    self.loop_config = LoopConfig.from_config(config.env)
    self.tokenizer = batches_lib.tokenizer_for(config)
    self.think_end = self.tokenizer.special_id("/think")
    self.mesh = mesh_lib.make_mesh(config.mesh, devices)

  # ---- setup ----------------------------------------------------------------------
  def _new_model(self) -> Horizon:
    """The seeded initial model, sharded on the mesh (policy, and the frozen KL reference)."""
    return create_sharded_model(lambda: Horizon(self.cfg, rngs=nnx.Rngs(self.config.seed)), self.mesh)

  def build(self) -> None:
    config, cfg = self.config, self.cfg
    self.model = self._new_model()
    self.optimizer = make_train_state(self.model, self.tc)
    self.ckpt = Checkpointer(str(epath.Path(self.workdir) / "checkpoints"), every=config.checkpoint.every,
                             keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    self.start = 0
    init_from = config.checkpoint.get("init_from") or ""
    # Where the run's weights started: {"init_from": path or "", "step": int or None}, saved with
    # every checkpoint, so a resume rebuilds the KL reference from that exact step.
    self.origin = {"init_from": init_from, "step": None}
    if self.ckpt.latest_step() is not None:
      meta = self.ckpt.restore(model=self.model, optimizer=self.optimizer)
      self.start = int(meta["step"])
      self.sampler.set_state(meta["data_state"])
      self.origin = self._resumed_origin(meta["data_state"].get("origin"), init_from)
      logging.info("resumed RL from %s at step %d", self.ckpt.directory, self.start)
    elif init_from:
      meta = restore_params(init_from, self.model)
      self.origin["step"] = int(meta["step"])
      logging.info("initialised the policy from %s (step %d)", init_from, meta["step"])
    self.ref_model = None
    if self.obj.kl != "none":
      # The frozen reference: the weights the run started from (init_from at the step it was
      # read at, or the seeded init), rebuilt the same way on resume.
      self.ref_model = self._new_model()
      if self.origin["init_from"]:
        restore_params(self.origin["init_from"], self.ref_model, step=self.origin["step"])
    s = config.serving
    weights = self.rollout_weights()
    with mp.engine_context():
      self.engine = Engine(weights, self.tokenizer, slots=s.slots, max_context=s.max_context,
                           prefill_chunk=s.prefill_chunk, seed=s.seed, prefix_cache_mb=s.prefix_cache_mb,
                           prefix_cache_block=s.prefix_cache_block,
                           prefix_cache_exact=s.prefix_cache_exact, decode_steps=s.decode_steps,
                           batch_invariant=s.batch_invariant).start()
    renderer = ChatRenderer(self.tokenizer, cfg.vision.num_patches if cfg.vision.enabled else 0)
    # Routing is always recorded (the mismatch metric); config.rl.routing_replay replays it.
    self.moe = any(k == "moe" for k in cfg.ffn_kinds)
    self.policy = EnginePolicy(self.engine, renderer, dict(s.thinking_budgets), record_routing=self.moe)
    self.ctx = EnvContext.from_config(config.env)
    inner = make_executor(config.env.executor, self.ctx, workers=int(config.env.workers))
    self.executor = TimedExecutor(inner)

  def close(self) -> None:
    self.executor.shutdown()
    self.engine.stop()
    self.ckpt.close()

  # ---- rollouts -------------------------------------------------------------------
  def _jobs(self, step: int, round_: int) -> tuple[list[tuple], list[str]]:
    rl = self.rl
    draws = self.sampler.draw(step * 1000 + round_, int(rl.prompts_per_step))
    rng = np.random.default_rng([int(rl.seed), step, round_, 11])
    names = sorted(self.tiers)
    p = np.array([self.tiers[t] for t in names])
    tiers = [names[i] for i in rng.choice(len(names), size=len(draws), p=p / p.sum())]
    jobs, sources = [], []
    for j, ((source, task), tier) in enumerate(zip(draws, tiers, strict=True)):
      for g in range(int(rl.samples_per_prompt)):
        seed = (int(rl.seed) * 1_000_003 + step * 10_007 + round_ * 1_009 + j * 101 + g) % (2**31)
        jobs.append((task, None if tier == "off" else tier,
                     Sampling(temperature=float(rl.temperature), seed=seed,
                              max_tokens_per_turn=int(self.config.env.max_tokens_per_turn))))
        sources.append(source)
    return jobs, sources

  def rollout(self, step: int) -> tuple[list[Episode], list[str], dict[str, float]]:
    """Episodes of this step (after dynamic sampling), their sources, and rollout stats."""
    kept: list[Episode] = []
    sources: list[str] = []
    stats: dict[str, Any] = {"groups": 0, "groups_dropped": 0, "groups_invalid": 0, "rounds": 0,
                             "episodes_played": 0, "first_failure": None}
    busy0 = self.executor.busy_s
    played_success, played_domains, played_sources = [], [], []  # float, domain and source lists
    for round_ in range(1 + int(self.rl.max_refills) if self.obj.dynamic_sampling else 1):
      jobs, srcs = self._jobs(step, round_)
      played = self._play(jobs)
      stats["first_failure"] = stats.get("first_failure") or batch_lib.first_failure(played)
      eps, srcs, invalid = batch_lib.drop_invalid(played, srcs)
      stats["groups_invalid"] += invalid
      stats["rounds"] += 1
      stats["episodes_played"] += len(eps)
      played_success += [float(e.success) for e in eps]
      played_domains += [e.domain for e in eps]
      played_sources += srcs
      groups = batch_lib.group_ids(eps)
      stats["groups"] += len(set(groups))
      if self.obj.dynamic_sampling:
        rewards, _ = batch_lib.shape_rewards(eps, self.obj, self.shaping, self.think_end)
        keep = obj_lib.informative_groups(rewards, groups)
        stats["groups_dropped"] += len(set(groups[~keep]))
        for g in set(groups[~keep]):
          key = f"groups_dropped/{eps[int(np.flatnonzero(groups == g)[0])].domain}"
          stats[key] = stats.get(key, 0) + 1
        eps = [e for e, k in zip(eps, keep, strict=True) if k]
        srcs = [s for s, k in zip(srcs, keep, strict=True) if k]
      kept += eps
      sources += srcs
      if len(kept) >= int(self.rl.prompts_per_step) * int(self.rl.samples_per_prompt):
        break
    self.last_played = played  # the last round, dropped groups too: a step without an update writes these
    stats["env_busy_s"] = self.executor.busy_s - busy0
    # Success over every played episode: with dynamic sampling the trained batch holds only the
    # groups with mixed outcomes, so its own `success` says nothing about how well the policy does.
    stats["played_success"] = float(np.mean(played_success)) if played_success else float("nan")
    for d, v in batch_lib.domain_means(np.asarray(played_success), played_domains).items():
      stats[f"played_success/{d}"] = v
    # what the adaptive mixture learns from (popped before logging): per source, every episode
    stats["by_source"] = batch_lib.domain_means(np.asarray(played_success), played_sources)
    stats["generated_tokens"] = float(sum(e.generated_tokens for e in kept))
    return kept, sources, stats

  def _play(self, jobs: list[tuple]) -> list[Episode]:
    """Plays `jobs` (in groups of samples_per_prompt): all here with one process; else this
    process's share of the groups, then every process's episodes, in job order."""
    size = int(self.rl.samples_per_prompt)
    groups = len(jobs) // size
    mine = [jobs[g * size + i] for g in mp.my_groups(groups) for i in range(size)]
    eps = asyncio.run(run_episodes(mine, self.policy, self.executor, concurrency=self.engine.slots,
                                   config=self.loop_config))
    return eps if jax.process_count() == 1 else mp.in_job_order(mp.gather_objects(eps), groups, size)

  # ---- the update -----------------------------------------------------------------
  def _micro(self, arrays: dict[str, np.ndarray], rows: slice | np.ndarray, t: int | None = None
             ) -> dict[str, jax.Array]:
    """Rows of the batch (cut to their first t positions) on the mesh, split over its batch axes
    (data, fsdp, expert) as pretraining's batches are; a micro-batch the axes do not divide stays
    whole."""
    out = {}
    for k, part in batch_lib.cut(arrays, rows, t).items():
      spec = activation_spec(("batch",) + (None,) * (part.ndim - 1), part.shape, dict(self.mesh.shape))
      out[k] = mp.put_global(np.ascontiguousarray(part), jax.sharding.NamedSharding(self.mesh, spec))
    return out

  def rollout_weights(self) -> Horizon:
    """What the engine generates with: the policy itself, or (config.rl.rollout_quantization)
    a copy with its routed experts or every linear weight in MXFP4, quantized from the current
    policy at each weight sync; TIS corrects the gap, which abs_dlogp and rollout_kl report."""
    what = str(self.rl.rollout_quantization)
    local = mp.local_copy(self.model)  # the model itself with one process
    if what == "none":
      return local
    copy = nnx.clone(local)
    quantize_model(copy, what)
    return copy

  def sync_weights(self) -> float:
    """Hands the policy's weights to the engine (no file round trip); returns the seconds taken."""
    t0 = time.perf_counter()
    weights = self.rollout_weights()
    with mp.engine_context():
      self.engine.update_weights(weights)
    return time.perf_counter() - t0

  def update(self, episodes: Sequence[Episode], sync: bool = True) -> dict[str, Any]:
    """Scores and updates on `episodes`; sync=False leaves the engine's weights as they were
    (asynchronous rollouts: the caller syncs once the engine's current rollouts are done)."""
    arrays = batch_lib.to_batch(episodes, np.zeros(len(episodes)), self.obj,
                                pad_multiple=int(self.rl.pad_multiple), pad_id=self.tokenizer.pad_id)
    b = len(episodes)
    mb = max(1, min(int(self.rl.micro_batch), b))
    chunks = batch_lib.micro_batches(batch_lib.row_lengths(episodes), mb, int(self.rl.pad_multiple),
                                     bool(self.rl.group_by_length))
    rewards, parts = batch_lib.shape_rewards(episodes, self.obj, self.shaping, self.think_end)
    if self.ref_model is not None:
      arrays["logp_ref"] = np.zeros_like(arrays["mask"])
      for rows, t in chunks:
        ref = update_lib.score(self.ref_model, self._micro(arrays, rows, t))[0]
        arrays["logp_ref"][rows, :t] = mp.to_host(ref)
      parts["kl"] = -obj_lib.kl_reward_penalty(arrays["logp_rollout"], arrays["logp_ref"], arrays["mask"],
                                               self.obj)
      rewards = rewards + parts["kl"]
    adv = obj_lib.advantages(rewards, batch_lib.group_ids(episodes), self.obj)
    arrays["advantages"] = adv.astype(np.float32)
    logp_old = np.zeros_like(arrays["mask"])
    entropy = np.zeros_like(arrays["mask"])
    t0 = time.perf_counter()
    replay = bool(self.rl.routing_replay) and "routing" in arrays
    mismatch = []
    for rows, t in chunks:
      lp, ent, mis = update_lib.score(self.model, self._micro(arrays, rows, t), replay)
      logp_old[rows, :t], entropy[rows, :t] = mp.to_host(lp), mp.to_host(ent)
      mismatch.append(float(mp.to_host(mis)))
    arrays["logp_old"] = logp_old
    t_score = time.perf_counter() - t0
    out: dict[str, Any] = {}
    tokens = arrays["mask"].sum()
    t0 = time.perf_counter()
    for _ in range(int(self.rl.updates_per_step)):
      grads, sums = None, {}
      for rows, t in chunks:
        g, m = update_lib.micro_grads(self.model, self.optimizer, self._micro(arrays, rows, t), self.obj,
                                      self.tc, len(chunks), replay)
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        # loss terms add up over micro-batches (whole-batch weights); the rest are token averages
        share = arrays["mask"][rows].sum() / max(tokens, 1.0)
        for k, v in m.items():
          sums[k] = sums.get(k, 0.0) + mp.to_host(v).astype(np.float64) * (1.0 if k in _ADDITIVE else share)
      load = (sums.pop("load") / len(chunks)).astype(np.float32) if "load" in sums else None
      applied = update_lib.apply_grads(self.model, self.optimizer, grads, load, self.tc,
                                       np.isfinite(sums["loss"]))
      out.update({k: float(mp.to_host(v)) for k, v in applied.items()})
      out.update({k: float(v) for k, v in sums.items()})
    t_update = time.perf_counter() - t0
    t_sync = self.sync_weights() if sync else 0.0
    out.update(self._domain_metrics(episodes, rewards, parts, arrays, entropy))
    if "routing" in arrays:  # experts chosen differently by trainer and engine (before the update)
      out["routing_mismatch"] = float(np.mean(mismatch))
    out.update(score_s=t_score, update_s=t_update, sync_s=t_sync,
               tokens=float(tokens), batch_rows=float(b),
               batch_len=float(arrays["mask"].shape[1]),
               padded_tokens=float(sum(len(rows) * t for rows, t in chunks)))
    return out

  def _domain_metrics(self, episodes, rewards, parts, arrays, entropy) -> dict[str, float]:
    domains = [e.domain for e in episodes]
    mask = arrays["mask"]
    per_ep_entropy = (entropy * mask).sum(1) / np.maximum(mask.sum(1), 1)
    values = {
      "reward": rewards, "correct": parts["correct"],
      "success": np.array([e.success for e in episodes], float),
      "response_tokens": np.array([e.generated_tokens for e in episodes], float),
      "thinking_tokens": np.array([e.thinking_tokens for e in episodes], float),
      "turns": np.array([e.num_turns for e in episodes], float),
      "tool_errors": np.array([e.tool_errors for e in episodes], float),
      "malformed_calls": np.array([e.malformed_calls for e in episodes], float),
      "truncated": np.array([e.end == "length" for e in episodes], float),
      "grader_failed": np.array([bool(e.grade.get("grader_failed")) for e in episodes], float),
      "forced_think_end": (parts["budget"] < 0).astype(float), "entropy": per_ep_entropy,
    }
    out = {name: float(np.mean(v)) for name, v in values.items()}
    for name, v in values.items():
      for d, m in batch_lib.domain_means(v, domains).items():
        out[f"{name}/{d}"] = m
    return out

  # ---- held-out evaluation --------------------------------------------------------
  def evaluate(self, step: int) -> dict[str, float]:
    """Greedy held-out success per domain and tier through the harness (records in <workdir>/eval)."""
    from rl.eval import harness, report
    from rl.tasks import generators

    rl = self.rl
    tasks = []
    for source, level in sorted(self.sampler.levels.items()):
      tasks += generators.generate(source, split="heldout", difficulty=level, n=int(rl.eval_n))
    if not tasks or jax.process_index() != 0:
      return {}
    tiers = self.eval_tiers
    sampling = Sampling(temperature=0.0, seed=int(rl.seed),
                        max_tokens_per_turn=int(self.config.env.max_tokens_per_turn))
    out_dir = epath.Path(self.workdir) / "eval" / f"step_{step}"
    records = harness.evaluate(tasks, self.policy, self.executor, tiers=tiers, sampling=sampling,
                               concurrency=self.engine.slots, results=str(out_dir / "results.jsonl"),
                               config=self.loop_config, progress=False)
    rows = report.aggregate(records)
    (out_dir / "table.md").write_text(report.markdown(rows))
    return {f"eval/{key}/{row['domain']}/{row['tier']}": float(row[key]) for row in rows
            for key in ("success", "ci_low", "ci_high", "thinking_tokens")}

  # ---- bookkeeping ----------------------------------------------------------------
  def write_trajectories(self, step: int, episodes: Sequence[Episode]) -> None:
    n = int(self.rl.trajectories_per_step)
    if n <= 0 or jax.process_index() != 0:
      return
    path = epath.Path(self.workdir) / "trajectories.jsonl"
    with path.open("a") as f:
      for ep in episodes[:n]:
        turns = [{"role": m.role, "thinking": m.thinking,
                  "text": "".join(getattr(p, "text", "") for p in m.content),
                  "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in (m.tool_calls or [])]}
                 for m in ep.messages]
        f.write(json.dumps({"step": step, "task_id": ep.task_id, "domain": ep.domain, "tier": ep.tier,
                            "reward": ep.reward, "success": ep.success, "end": ep.end, "messages": turns},
                           default=str) + "\n")

  def _resumed_origin(self, saved: dict | None, init_from: str) -> dict:
    """The origin a resumed run keeps; an init_from that now names other weights is an error
    while the KL reference depends on it (it would silently become a different model)."""
    if saved is None:  # a checkpoint from before origins were saved: the latest step, as then
      if init_from and self.obj.kl != "none":
        logging.warning("the checkpoint records no origin; the KL reference is read from %r at its "
                        "latest step", init_from)
      return {"init_from": init_from, "step": None}
    if init_from and saved["init_from"] != init_from:  # none given: the run keeps its own origin
      message = (f"this run started from config.checkpoint.init_from={saved['init_from']!r} (step "
                 f"{saved['step']}), and it is now {init_from!r}; a resumed run keeps its origin")
      if self.obj.kl != "none":
        raise ValueError(f"{message}, which is its KL reference. Drop the override, or start a fresh "
                         "--workdir to begin from the new weights.")
      logging.warning("%s (the override is ignored).", message)
    return dict(saved)

  def save(self, step: int, force: bool = False, sampler_state: dict | None = None) -> bool:
    return self.ckpt.save(step, model=self.model, optimizer=self.optimizer,
                          data_state={**(sampler_state or self.sampler.get_state()), "origin": self.origin},
                          rng=None, config=self.config.to_dict(), force=force)


def run(config, workdir: str) -> dict[str, Any]:
  """Runs config.rl.steps RL steps (resuming from <workdir>/checkpoints); returns the summary.

  With config.rl.async_rollouts the engine generates step n+1's episodes (with the weights
  before update n) while the trainer updates on step n's, in a second thread: each batch after
  the first is one update stale (`staleness` 1), which the recomputed log-probs and TIS correct.
  Weights reach the engine between rollouts, never during one. Resuming such a run regenerates
  its first step on-policy (the stale weights are not checkpointed), so only synchronous runs
  resume bitwise. A step whose every episode failed to play or be graded makes no update; after
  config.rl.max_failed_steps such steps in a row the run stops, naming the first failure.
  """
  r = RLRun(config, workdir)
  steps, every = int(config.rl.steps), int(config.rl.eval_every)
  use_async = bool(config.rl.async_rollouts)
  with mesh_lib.activate(r.mesh), futures.ThreadPoolExecutor(1, "rollouts") as pool:
    r.build()
    logger = metrics_lib.MetricsLogger(workdir, total_steps=steps, tensorboard=config.metrics.tensorboard,
                                       console_keys=("reward", "played_success", "step_s"))
    history = []
    failed = FailedSteps(int(config.rl.max_failed_steps))
    try:
      pending, staleness = None, 0
      for step in range(r.start, steps):
        t0 = time.perf_counter()
        episodes, _, stats = pending.result() if pending is not None else r.rollout(step)
        by_source = stats.pop("by_source")
        failed.observe(step, stats, stats.pop("first_failure"))  # before this step is saved
        t_roll = time.perf_counter() - t0
        sampler_state = r.sampler.get_state()  # before the next step's draws (what a resume redoes)
        pending = pool.submit(r.rollout, step + 1) if use_async and step + 1 < steps else None
        m = r.update(episodes, sync=pending is None) if episodes else {}
        if not episodes:
          logging.warning("step %d: no group to train on (%d with equal rewards, %d with an engine or grader "
                          "failure); no update", step, stats["groups_dropped"], stats["groups_invalid"])
        if pending is not None:  # the engine finishes the next step's rollouts, then takes the weights
          futures.wait([pending])
          m["sync_s"] = r.sync_weights()
        r.sampler.adaptive.observe(by_source)  # success of every played episode, not just the kept
        m.update({f"mix/{s}": w for s, w in r.sampler.adaptive.weights().items()})
        m.update(stats, rollout_s=t_roll, step_s=time.perf_counter() - t0, staleness=float(staleness))
        staleness = 1 if pending is not None else 0
        check_step_finite(step, m, r.tc.nan_policy)
        if every > 0 and ((step + 1) % every == 0 or step == steps - 1):
          m.update(r.evaluate(step + 1))
        logger.log(step, m)
        history.append(m)
        r.write_trajectories(step, episodes or r.last_played)
        r.save(step + 1, sampler_state={**r.sampler.get_state(), "positions": sampler_state["positions"]})
      r.save(steps, force=True)
      r.ckpt.wait()
      latest = r.ckpt.latest_step()
    finally:
      if pending is not None:
        futures.wait([pending])
      summary = logger.close()
      r.close()
  summary.update({"workdir": str(workdir), "start_step": r.start, "latest_checkpoint": latest,
                  "history": history})
  return summary
