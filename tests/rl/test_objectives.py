"""rl/train/objectives.py against per-token NumPy references written loop by loop."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.train import objectives as obj_lib

B, T = 6, 11
# Ragged samples: lengths 11, 3, 7, 1, 9, 5; tool-result tokens (mask 0) inside two of them.
LENGTHS = [11, 3, 7, 1, 9, 5]


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  mask = np.zeros((B, T), np.float32)
  for b, n in enumerate(LENGTHS):
    mask[b, :n] = 1
  mask[0, 4:6] = 0  # a tool result inside sample 0
  mask[4, 2] = 0  # a forced token
  logp_old = -rng.uniform(0.05, 3.0, (B, T)).astype(np.float32)
  logp = logp_old + rng.normal(0, 0.3, (B, T)).astype(np.float32)
  logp_rollout = logp_old + rng.normal(0, 0.4, (B, T)).astype(np.float32)
  logp_ref = logp_old + rng.normal(0, 0.2, (B, T)).astype(np.float32)
  # Two groups of three; group 1 has a tie (two equal rewards).
  rewards = np.array([1.0, 0.0, 0.5, 1.0, 1.0, 0.0])
  groups = np.array([0, 0, 0, 1, 1, 1])
  arrays = dict(mask=mask, logp_old=logp_old, logp_rollout=logp_rollout, logp_ref=logp_ref)
  return arrays, logp, rewards, groups


def _ref_advantages(rewards, groups, kind, eps=1e-6):
  out = []
  for i, r in enumerate(rewards):
    same = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
    mean = sum(same) / len(same)
    if kind == "loo":
      others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
      out.append(r - sum(others) / len(others))
    elif kind == "group_mean":
      out.append(r - mean)
    else:
      std = math.sqrt(sum((x - mean) ** 2 for x in same) / len(same))
      out.append((r - mean) / (std + eps))
  return np.array(out)


def _ref_kl_term(logp, batch, o):
  """The reference-KL loss term, aggregated like the policy term."""
  mask = batch["mask"]
  kl = np.zeros((B, T))
  for b in range(B):
    for t in range(T):
      if mask[b, t]:
        d = float(logp[b, t] - batch["logp_ref"][b, t])
        kl[b, t] = d if o.kl == "k1" else math.exp(-d) + d - 1
  if o.aggregation == "token_mean":
    return kl.sum() / mask.sum()
  if o.aggregation == "seq_mean":
    return np.mean([kl[b].sum() / max(mask[b].sum(), 1) for b in range(B)])
  return kl.sum() / (B * (o.norm_tokens or T))


def _ratios(logp, batch, o):
  """(row, position, policy ratio) of every sampled token: per token, or the row's geometric mean."""
  mask, old = batch["mask"], batch["logp_old"]
  for b in range(B):
    n = mask[b].sum()
    seq_lr = sum(float(logp[b, t] - old[b, t]) for t in range(T) if mask[b, t]) / max(n, 1)
    for t in range(T):
      if mask[b, t]:
        yield b, t, math.exp(seq_lr) if o.ratio == "sequence" else math.exp(float(logp[b, t] - old[b, t]))


def _ref_loss(logp, batch, adv, o):
  """The objective, one token at a time."""
  mask, old, roll = batch["mask"], batch["logp_old"], batch["logp_rollout"]
  tok_loss = np.zeros((B, T))
  for b, t, r in _ratios(logp, batch, o):
    c = min(max(r, 1 - o.eps_low), 1 + o.eps_high)
    loss = -min(r * adv[b], c * adv[b])
    if o.tis_cap:
      loss *= min(math.exp(float(old[b, t] - roll[b, t])), o.tis_cap)
    tok_loss[b, t] = loss
  if o.aggregation == "token_mean":
    total = tok_loss.sum() / mask.sum()
  elif o.aggregation == "seq_mean":
    total = np.mean([tok_loss[b].sum() / max(mask[b].sum(), 1) for b in range(B)])
  else:
    total = tok_loss.sum() / (B * (o.norm_tokens or T))
  if o.kl != "none" and o.kl_place == "in_loss":
    total += o.kl_coef * _ref_kl_term(logp, batch, o)
  return total


@pytest.mark.parametrize("algorithm", obj_lib.ALGORITHMS)
@pytest.mark.parametrize("kl", ["none", "k1", "k3"])
def test_loss_matches_per_token_reference(algorithm, kl):
  batch, logp, rewards, groups = _batch()
  o = obj_lib.objective(algorithm, kl=kl, kl_coef=0.1 if kl != "none" else 0.0)
  adv = obj_lib.advantages(rewards, groups, o)
  np.testing.assert_allclose(adv, _ref_advantages(rewards, groups, o.advantage), rtol=1e-12)
  jb = {k: jnp.asarray(v) for k, v in batch.items()} | {"advantages": jnp.asarray(adv, jnp.float32)}
  loss, metrics = obj_lib.policy_loss(jnp.asarray(logp), jb, o)
  np.testing.assert_allclose(float(loss), _ref_loss(logp, batch, adv, o), rtol=2e-5, atol=1e-7)
  assert 0 <= float(metrics["clip_frac"]) <= 1 and 0 <= float(metrics["tis_clip_frac"]) <= 1
  assert float(metrics["rollout_kl"]) > 0 and float(metrics["abs_dlogp"]) > 0


@pytest.mark.parametrize("algorithm", obj_lib.ALGORITHMS)
def test_micro_batches_sum_to_the_whole_batch(algorithm):
  """With the whole batch's token_weights, the losses of row micro-batches add up to the loss."""
  batch, logp, rewards, groups = _batch(3)
  o = obj_lib.objective(algorithm, kl="k3", kl_coef=0.05)
  adv = obj_lib.advantages(rewards, groups, o)
  full = {k: jnp.asarray(v) for k, v in batch.items()} | {"advantages": jnp.asarray(adv, jnp.float32)}
  whole = float(obj_lib.policy_loss(jnp.asarray(logp), full, o)[0])
  w = obj_lib.token_weights(batch["mask"], o)
  parts = 0.0
  for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
    micro = {k: v[rows] for k, v in full.items()} | {"weights": jnp.asarray(w[rows])}
    parts += float(obj_lib.policy_loss(jnp.asarray(logp[rows]), micro, o)[0])
  np.testing.assert_allclose(parts, whole, rtol=1e-5)


def test_presets_and_overrides():
  assert obj_lib.objective("dapo").eps_high == 0.28 and obj_lib.objective("dapo").dynamic_sampling
  assert obj_lib.objective("gspo").ratio == "sequence"
  assert obj_lib.objective("dr_grpo").aggregation == "constant"
  assert obj_lib.objective("grpo", eps_high=0.3).eps_high == 0.3
  with pytest.raises(ValueError, match="config.rl.algorithm='ppo'"):
    obj_lib.objective("ppo")
  with pytest.raises(ValueError, match=r"unknown objective knob\(s\) \['epsilon'\]"):
    obj_lib.objective("grpo", epsilon=0.1)
  with pytest.raises(ValueError, match="config.rl.aggregation='sum'"):
    obj_lib.objective("grpo", aggregation="sum")


@pytest.mark.parametrize("algorithm", obj_lib.ALGORITHMS)
def test_on_policy_gradient_is_the_plain_policy_gradient(algorithm):
  """At ratio 1 (logp_old = logp, rollout = old) the clipped loss's gradient is that of
  -sum(A * logp) aggregated the same way; masked tokens get exactly zero gradient."""
  batch, logp, rewards, groups = _batch(1)
  o = obj_lib.objective(algorithm)
  adv = jnp.asarray(obj_lib.advantages(rewards, groups, o), jnp.float32)
  lp = jnp.asarray(logp)
  jb = {"mask": jnp.asarray(batch["mask"]), "logp_old": lp, "logp_rollout": lp, "advantages": adv}
  g = jax.grad(lambda x: obj_lib.policy_loss(x, jb, o)[0])(lp)
  mask = jb["mask"]
  n = jnp.maximum(mask.sum(1, keepdims=True), 1)
  if o.ratio == "sequence":  # every token carries -A x the sample's mean log-prob
    plain_loss = lambda x: obj_lib._aggregate(  # noqa: E731
        jnp.broadcast_to(-adv[:, None] * jnp.sum(x * mask, 1, keepdims=True) / n, x.shape), mask, o)
  else:
    plain_loss = lambda x: obj_lib._aggregate(-adv[:, None] * x, mask, o)  # noqa: E731
  np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(plain_loss)(lp)), rtol=1e-5, atol=1e-8)
  assert np.all(np.asarray(g)[np.asarray(batch["mask"]) == 0] == 0)


def test_advantage_ties_and_all_equal_groups():
  o = obj_lib.objective("grpo")
  rewards, groups = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), np.array([0, 0, 0, 1, 1, 1])
  adv = obj_lib.advantages(rewards, groups, o)
  assert np.all(adv[:3] == 0)  # all equal: no signal, no NaN
  assert adv[4] > 0 > adv[3] and adv[3] == adv[5]
  np.testing.assert_array_equal(obj_lib.informative_groups(rewards, groups), [0, 0, 0, 1, 1, 1])
  loo = obj_lib.advantages(np.array([1.0, 0.0, 0.0]), np.zeros(3), obj_lib.objective("rloo"))
  np.testing.assert_allclose(loo, [1.0, -0.5, -0.5])


def test_overlong_penalty_ramp():
  o = obj_lib.objective("dapo", overlong_buffer=10, overlong_penalty=1.0)
  pen = obj_lib.overlong_penalty(np.array([50, 90, 95, 100, 120]), 100, o)
  np.testing.assert_allclose(pen, [0.0, 0.0, -0.5, -1.0, -1.0])
  assert np.all(obj_lib.overlong_penalty(np.array([100]), 100, obj_lib.objective("grpo")) == 0)


def test_kl_in_reward():
  batch, _, _, _ = _batch(2)
  o = obj_lib.objective("grpo", kl="k1", kl_coef=0.5, kl_place="in_reward")
  pen = obj_lib.kl_reward_penalty(batch["logp_rollout"], batch["logp_ref"], batch["mask"], o)
  want = [0.5 * sum(float(batch["logp_rollout"][b, t] - batch["logp_ref"][b, t])
                    for t in range(T) if batch["mask"][b, t]) for b in range(B)]
  np.testing.assert_allclose(pen, want, rtol=1e-6)


@pytest.mark.parametrize("knob", ["kl_coef", "overlong_penalty", "eps_low"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_knobs_must_be_finite(knob, value):
  """overlong_penalty=inf made NaN advantages, kl_coef=inf a NaN loss, one full step later."""
  with pytest.raises(ValueError, match=rf"config\.rl\.{knob}={value!r}: must be"):
    obj_lib.objective("dapo", **{"kl": "k3", "kl_coef": 0.1, knob: value})


def test_inf_stays_a_deliberate_no_cap():
  o = obj_lib.objective("grpo", eps_high=math.inf, tis_cap=math.inf)
  assert o.eps_high == math.inf and o.tis_cap == math.inf
  with pytest.raises(ValueError, match=r"config\.rl\.tis_cap=-inf: must be >= 0 \(inf: no cap\)"):
    obj_lib.objective("grpo", tis_cap=-math.inf)
  with pytest.raises(ValueError, match=r"Objective\.adv_eps=inf: must be finite and > 0"):
    obj_lib.Objective(adv_eps=math.inf)


@pytest.mark.parametrize("overrides, message", [
  (dict(kl="k3"), r"config\.rl\.kl='k3' with config\.rl\.kl_coef=0: the KL term would have no effect"),
  (dict(kl_coef=0.5), r"config\.rl\.kl_coef=0\.5 with config\.rl\.kl='none': there is no KL term"),
  (dict(kl_place="in_reward"), r"config\.rl\.kl_place='in_reward' with config\.rl\.kl='none'"),
  (dict(norm_tokens=1000), r"config\.rl\.norm_tokens=1000 is used only by config\.rl\.aggregation="),
  (dict(overlong_penalty=5.0), r"config\.rl\.overlong_penalty=5\.0 with config\.rl\.overlong_buffer=0"),
])
@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "rloo"])
def test_knobs_that_would_do_nothing_are_refused(algorithm, overrides, message):
  with pytest.raises(ValueError, match=message):
    obj_lib.objective(algorithm, **overrides)


def test_every_preset_and_its_meaningful_overrides_still_build():
  for algorithm in obj_lib.ALGORITHMS:
    obj_lib.objective(algorithm)
    obj_lib.objective(algorithm, kl="k1", kl_coef=0.1, kl_place="in_reward")
    obj_lib.objective(algorithm, kl="none", kl_coef=0.0, overlong_buffer=16, overlong_penalty=0.5)
  assert obj_lib.objective("dr_grpo", norm_tokens=1000).norm_tokens == 1000
  assert obj_lib.objective("dapo", overlong_buffer=0, overlong_penalty=0.0).overlong_buffer == 0
  with pytest.raises(ValueError, match=r"config\.rl\.overlong_penalty=2\.0 with config\.rl\.overlong_buf"):
    obj_lib.objective("dapo", overlong_buffer=0, overlong_penalty=2.0)


def _ref_metrics(logp, batch, adv, o):
  """clip_frac, tis_clip_frac, rollout_kl, abs_dlogp and kl_ref over the sampled tokens, one at a time."""
  mask, old, roll, ref = batch["mask"], batch["logp_old"], batch["logp_rollout"], batch["logp_ref"]
  n_tok = mask.sum()
  clip = tis = rkl = dlogp = kl_ref = 0.0
  for b, t, r in _ratios(logp, batch, o):
    clip += (adv[b] > 0 and r > 1 + o.eps_high) or (adv[b] < 0 and r < 1 - o.eps_low)
    d = float(old[b, t] - roll[b, t])
    tis += math.exp(d) > o.tis_cap
    rkl += math.exp(d) - d - 1  # k3 of KL(rollout || trainer): e^-(roll - old) + (roll - old) - 1
    dlogp += abs(d)
    k = float(logp[b, t] - ref[b, t])
    kl_ref += k if o.kl == "k1" else math.exp(-k) + k - 1
  return dict(clip_frac=clip / n_tok, tis_clip_frac=tis / n_tok, rollout_kl=rkl / n_tok,
              abs_dlogp=dlogp / n_tok, kl_ref=kl_ref / n_tok)


@pytest.mark.parametrize("algorithm", ["dapo", "grpo"])
@pytest.mark.parametrize("kl", ["k1", "k3"])
def test_metrics_match_per_token_reference(algorithm, kl):
  """The diagnostics (clip_frac with DAPO's asymmetric clip, TIS cap hits, rollout KL, |dlogp|, the
  reference KL) over the sampled tokens only, against the loop reference; off-policy enough that
  every count is nonzero."""
  batch, logp, rewards, groups = _batch(4)
  logp = batch["logp_old"] + np.random.default_rng(5).normal(0, 0.4, (B, T)).astype(np.float32)
  # Ratios between the two clip edges (1 + eps_low < r < 1 + eps_high, 1 - eps_high < r < 1 - eps_low)
  # on positive- and negative-advantage samples (two and one, so that swapped edges do not cancel):
  # clipped only if each edge uses its own eps.
  for b, t, r in ((0, 1, 1.24), (3, 0, 1.24), (1, 1, 0.76)):
    logp[b, t] = batch["logp_old"][b, t] + np.log(r)
  o = obj_lib.objective(algorithm, kl=kl, kl_coef=0.1, tis_cap=1.5)
  adv = obj_lib.advantages(rewards, groups, o)
  jb = {k: jnp.asarray(v) for k, v in batch.items()} | {"advantages": jnp.asarray(adv, jnp.float32)}
  _, metrics = obj_lib.policy_loss(jnp.asarray(logp), jb, o)
  want = _ref_metrics(logp, batch, adv, o)
  assert want["clip_frac"] > 0 and want["tis_clip_frac"] > 0
  for name, value in want.items():
    np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("kind", obj_lib.ADVANTAGES)
def test_advantages_of_uneven_and_two_sample_groups(kind):
  """Groups of 2, 3 and 4 samples, interleaved in the batch (as dynamic-sampling refills leave
  them): each sample is compared with its own group only, against the loop-by-loop reference."""
  rewards = np.array([1.0, 0.2, 0.0, 0.7, 1.0, 0.4, 0.9, 0.0, 0.3])
  groups = np.array([5, 2, 5, 9, 2, 9, 9, 2, 9])  # 5: two samples, 2: three, 9: four
  o = obj_lib.objective({"group_norm": "grpo", "group_mean": "dr_grpo", "loo": "rloo"}[kind])
  assert o.advantage == kind
  adv = obj_lib.advantages(rewards, groups, o)
  np.testing.assert_allclose(adv, _ref_advantages(rewards, groups, kind), rtol=1e-12)
  if kind == "group_norm":  # two distinct rewards: +-1 whatever their gap
    np.testing.assert_allclose(adv[[0, 2]], [1.0, -1.0], rtol=1e-5)
