"""From played episodes to the trainer's batch: shaped rewards, groups, advantages, token arrays.

Rewards (per episode, `shape_rewards`):
  correctness   the task grader's reward (0..1; cad: IoU)
  budget        -budget_penalty when the engine had to force the end of thinking at the
                tier's budget in any turn (the model ran out of thinking); nothing under it
  overlong      DAPO's soft penalty as the longest turn nears `max_tokens_per_turn`
Groups are (task id, tier): advantages are normalised among samples of the same prompt at
the same budget, so a short `low` answer is never compared with a long `max` one.

Token arrays (`to_batch`), one row per episode (its whole multi-turn stream), right-padded to
a multiple of `pad_multiple` so few shapes compile: inputs = ids[:-1], targets = ids[1:],
mask = loss_mask[1:] (tool results, prompts and forced tokens are 0), logp_rollout =
the engine's log-probabilities of the targets; with recorded routing, routing [B, T, layers, k]
and routing_mask [B, T] (positions the engine fed) for routing replay (R3).

Micro-batches (`micro_batches`): the trainer scores and differentiates the batch a few rows at a
time. Grouped by length, each micro-batch holds rows of similar length and is cut to its own
longest row (rounded up to `pad_multiple`), so a short maths episode is not padded to the
length of a tool episode whose prompt carries the tool schemas. Trailing padding changes
nothing a causal model computes for the real tokens, and `token_weights` are the whole
batch's, so the policy-gradient term is the same sum; MoE auxiliary losses no longer see the
padding tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from rl.agent.episode import Episode, unplayed
from rl.train import objectives as obj_lib


@dataclasses.dataclass(frozen=True)
class Shaping:
  budget_penalty: float = 0.2  # forced end of thinking
  max_tokens_per_turn: int = 256  # the overlong penalty's limit (config.env.max_tokens_per_turn)


def forced_think_end(ep: Episode, think_end_id: int) -> bool:
  """Did the engine force </think> (the tier's budget ran out) in any turn?"""
  for span in ep.turns:
    for i in range(span.gen_start, span.gen_end):
      if ep.token_ids[i] == think_end_id and not ep.loss_mask[i]:
        return True
  return False


def longest_turn(ep: Episode) -> int:
  return max((s.gen_end - s.gen_start for s in ep.turns), default=0)


def shape_rewards(episodes: Sequence[Episode], obj: obj_lib.Objective, shaping: Shaping,
                  think_end_id: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """(total reward [B], its parts {'correct', 'budget', 'overlong'}) per episode."""
  correct = np.array([ep.reward for ep in episodes], np.float64)
  budget = np.array([-shaping.budget_penalty if forced_think_end(ep, think_end_id) else 0.0
                     for ep in episodes])
  overlong = obj_lib.overlong_penalty(np.array([longest_turn(ep) for ep in episodes]),
                                      shaping.max_tokens_per_turn, obj)
  return correct + budget + overlong, {"correct": correct, "budget": budget, "overlong": overlong}


def group_ids(episodes: Sequence[Episode]) -> np.ndarray:
  """One id per (task, tier) group, in first-seen order."""
  seen: dict[tuple[str, str | None], int] = {}
  return np.array([seen.setdefault((ep.task_id, ep.tier), len(seen)) for ep in episodes])


def drop_invalid(episodes: Sequence[Episode], sources: Sequence[str]) -> tuple[list, list, int]:
  """(episodes, sources, groups dropped) without the groups holding an episode the policy failed
  to play (end 'error': an engine failure) or the grader failed on: neither is a sample of the
  policy's behaviour, and a group missing one would skew its advantages."""
  groups = group_ids(episodes)
  bad = {g for g, ep in zip(groups, episodes, strict=True)
         if unplayed(ep) or ep.grade.get("grader_failed")}
  keep = [g not in bad for g in groups]
  return ([e for e, k in zip(episodes, keep, strict=True) if k],
          [s for s, k in zip(sources, keep, strict=True) if k], len(bad))


def first_failure(episodes: Sequence[Episode]) -> str | None:
  """Why the first episode the policy failed to play (or the grader failed on) failed, else None."""
  for ep in episodes:
    if unplayed(ep):
      return ep.error or "the episode ended 'error'"
    if ep.grade.get("grader_failed"):
      return str(ep.grade.get("error"))
  return None


def to_batch(episodes: Sequence[Episode], advantages: np.ndarray, obj: obj_lib.Objective, *,
             pad_multiple: int = 128, pad_id: int = 0) -> dict[str, np.ndarray]:
  """The batch arrays (module docstring) plus advantages [B] and weights [B, T]."""
  lengths = row_lengths(episodes)
  t = -(-max(lengths) // pad_multiple) * pad_multiple
  b = len(episodes)
  out = {"inputs": np.full((b, t), pad_id, np.int32), "targets": np.full((b, t), pad_id, np.int32),
         "positions": np.zeros((b, t), np.int32), "segment_ids": np.zeros((b, t), np.int32),
         "mask": np.zeros((b, t), np.float32), "logp_rollout": np.zeros((b, t), np.float32)}
  for i, ep in enumerate(episodes):
    ids = np.asarray(ep.token_ids, np.int32)
    if len(ids) < 2:
      continue  # the policy failed before generating: nothing to learn from, nothing counted
    n = len(ids) - 1
    out["inputs"][i, :n], out["targets"][i, :n] = ids[:-1], ids[1:]
    out["positions"][i, :n] = np.arange(n)
    out["segment_ids"][i, :n] = 1
    out["mask"][i, :n] = np.asarray(ep.loss_mask[1:], np.float32)
    out["logp_rollout"][i, :n] = np.asarray(ep.logprobs[1:], np.float32)
  if episodes and all(ep.routing is not None for ep in episodes):
    # The engine's routing of each input position (-1 = never fed: replay leaves it to the router).
    layers_k = episodes[0].routing.shape[1:]
    out["routing"] = np.full((b, t) + layers_k, -1, np.int32)
    for i, ep in enumerate(episodes):
      n = min(len(ep.token_ids) - 1, len(ep.routing))
      if n > 0:
        out["routing"][i, :n] = ep.routing[:n]
    out["routing_mask"] = (out["routing"][:, :, 0, 0] >= 0).astype(np.int32)
  out["advantages"] = np.asarray(advantages, np.float32)
  out["weights"] = obj_lib.token_weights(out["mask"], obj)
  return out


def row_lengths(episodes: Sequence[Episode]) -> list[int]:
  """Positions each episode fills in the batch (its tokens but the last; at least one)."""
  return [max(len(ep.token_ids) - 1, 1) for ep in episodes]


def micro_batches(lengths: Sequence[int], micro_batch: int, pad_multiple: int,
                  by_length: bool = True) -> list[tuple[np.ndarray, int]]:
  """(rows, length to cut to) per micro-batch of at most `micro_batch` rows; every row once.

  by_length: rows sorted longest first (ties in batch order), each micro-batch cut to its own
  longest row rounded up to `pad_multiple`. Otherwise consecutive rows, all at the batch's
  length (as `to_batch` pads them).
  """
  if micro_batch < 1 or pad_multiple < 1:
    raise ValueError(f"micro_batches: micro_batch={micro_batch} and pad_multiple={pad_multiple} must be "
                     ">= 1 (config.rl.micro_batch, config.rl.pad_multiple).")
  lengths = np.asarray(lengths, np.int64)
  order = np.argsort(-lengths, kind="stable") if by_length else np.arange(lengths.size)
  chunks = [order[i:i + micro_batch] for i in range(0, order.size, micro_batch)]
  longest = [int(lengths[rows].max()) if by_length else int(lengths.max()) for rows in chunks]
  return [(rows, -(-n // pad_multiple) * pad_multiple) for rows, n in zip(chunks, longest, strict=True)]


def cut(arrays: Mapping[str, np.ndarray], rows, t: int | None) -> dict[str, np.ndarray]:
  """A micro-batch: `rows` of every array, the [B, T, ...] ones cut to their first t positions."""
  return {k: v[rows] if v.ndim == 1 else v[rows, :t] for k, v in arrays.items()}


def domain_means(values: np.ndarray, domains: Sequence[str]) -> Mapping[str, float]:
  """Mean of a per-episode value within each domain."""
  out: dict[str, list[float]] = {}
  for v, d in zip(values, domains, strict=True):
    out.setdefault(d, []).append(float(v))
  return {d: float(np.mean(v)) for d, v in out.items()}
