"""Paired comparison of two evaluations of the same tasks: did the change move success?

Two runs of `experiments.evaluate` over the same task list (same keys `task|tier|sample`)
are *paired*: each task is scored before and after. The difference of two success rates
then has the paired standard error

    SE = sqrt(b + c - (c - b)^2 / n) / n

where b counts episodes that went from success to failure, c from failure to success and n
the pairs (the variance of the mean of the per-task differences d_i in {-1, 0, 1}). Tasks
both runs solve, or both miss, carry no noise into the difference, so the paired SE is
smaller than the unpaired sqrt(p1 q1 / n + p2 q2 / n) whenever the runs agree on many tasks;
both are reported. The exact McNemar test (McNemar, 1947) gives a two-sided p-value: under
"no change" each of the b + c discordant pairs is a fair coin.

Greedy evaluations (temperature 0) make a run a function of the policy, so the pairing is
exact; with sampling, the same seed per key pairs the draws but the test then also counts
sampling noise as change. `compare` refuses runs whose sampling settings differ unless told.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rl.agent.episode import unplayed as is_unplayed
from rl.eval import harness
from rl.eval.report import TIER_ORDER

# run.json fields that must agree for the pairing to mean "the same test, another policy".
_SAME = ("temperature", "top_p", "top_k", "seed", "max_tokens_per_turn")


class CompareError(ValueError):
  """Two evaluation directories that cannot be compared (the message says why and what to do)."""


# Record fields compare reads: (field, type, what it must be).
_FIELDS = (("key", str, "a string (task|tier|sample)"), ("domain", str, "a string"),
           ("tier", str, "a string"), ("success", bool, "a JSON bool (true or false)"))


def _record(path: Path, lineno: int, r: Any) -> tuple[str, dict[str, Any]]:
  """(key, {domain, tier, success}) of one results.jsonl record; CompareError naming the line if it
  is not one (a missing field, or one of another type: the string "false" is no failure)."""
  try:
    fields = {name: r[name] for name, _, _ in _FIELDS}
  except (KeyError, TypeError) as e:
    raise CompareError(f"{path}:{lineno}: not an evaluation record ({e}).") from e
  for name, kind, what in _FIELDS:
    if not isinstance(fields[name], kind):
      raise CompareError(f"{path}:{lineno}: not an evaluation record: {name!r} is {fields[name]!r} "
                         f"({type(fields[name]).__name__}), not {what}; fix that line or rerun "
                         "experiments.evaluate to rewrite the file.")
  return fields.pop("key"), fields


def _json_object(path: Path) -> dict[str, Any]:
  """The JSON object in a file the harness wrote (run.json, the signature); CompareError if it is not one."""
  try:
    meta = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise CompareError(f"{path}: not JSON ({e}); rerun experiments.evaluate to rewrite it.") from e
  if not isinstance(meta, dict):
    raise CompareError(f"{path}: not a JSON object (a {type(meta).__name__}); rerun experiments.evaluate "
                       "to rewrite it.")
  return meta


def _run_meta(out: Path, results: Path) -> dict[str, Any]:
  """run.json, its 'sampling' taken from the results' signature when run.json lacks it."""
  meta_path = out / "run.json"
  meta = _json_object(meta_path) if meta_path.is_file() else {}
  source, signature = meta_path, harness.signature_path(results)
  if "sampling" not in meta and signature.is_file():
    # run.json is written when an evaluation finishes; an interrupted one has only its signature.
    source, sig = signature, _json_object(signature)
    meta = {**meta, "sampling": sig.get("sampling", {})}
  if "sampling" in meta and not isinstance(meta["sampling"], dict):
    raise CompareError(f"{source}: field 'sampling' is {meta['sampling']!r}, not an object of sampling "
                       "settings ({\"temperature\": ..., \"seed\": ...}); rerun experiments.evaluate to "
                       "rewrite it.")
  return meta


def load_run(out_dir: str | Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
  """(records by key, run.json) of an `experiments.evaluate --out` directory; the run.json dict gains
  'unplayed', the keys whose latest record the policy failed to play."""
  out = Path(out_dir)
  path = out / "results.jsonl"
  if not path.is_file():
    raise CompareError(f"{out}: no results.jsonl; pass the --out directory of experiments.evaluate.")
  records: dict[str, dict[str, Any]] = {}
  unplayed: set[str] = set()
  for lineno, r in harness.iter_results(path):
    key, record = _record(path, lineno, r)
    # An unplayed episode is no score; the harness replays it on resume, and the latest record
    # of a key counts.
    records.pop(key, None)
    unplayed.discard(key)
    if is_unplayed(r):
      unplayed.add(key)
    else:
      records[key] = record
  return records, {**_run_meta(out, path), "unplayed": sorted(unplayed)}


def mcnemar_p(b: int, c: int) -> float:
  """Exact two-sided McNemar p-value for b and c discordant pairs (binomial(b + c, 1/2))."""
  n = b + c
  if n == 0:
    return 1.0
  tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2.0 ** n
  return min(1.0, 2.0 * tail)


def paired_row(pairs: Sequence[tuple[bool, bool]]) -> dict[str, float]:
  """Statistics of one group of (before, after) success pairs."""
  n = len(pairs)
  before = sum(a for a, _ in pairs) / n
  after = sum(z for _, z in pairs) / n
  down = sum(a and not z for a, z in pairs)
  up = sum(z and not a for a, z in pairs)
  diff = after - before
  se = math.sqrt(max(up + down - (up - down) ** 2 / n, 0.0)) / n
  se_unpaired = math.sqrt(before * (1 - before) / n + after * (1 - after) / n)
  return {"n": n, "before": before, "after": after, "diff": diff, "up": up, "down": down,
          # no discordant-pair variance: z is undefined (diff 0) or infinite; McNemar's p stands
          "se_paired": se, "z_paired": diff / se if se > 0 else None,
          "se_unpaired": se_unpaired, "p_mcnemar": mcnemar_p(down, up)}


def check_comparable(meta_before: Mapping[str, Any], meta_after: Mapping[str, Any]) -> None:
  """Raises CompareError when the runs' sampling settings differ (run.json 'sampling')."""
  for name, meta in (("before", meta_before), ("after", meta_after)):
    if "sampling" not in meta:
      raise CompareError(f"the {name} run records no sampling settings (no run.json, which an "
                         "evaluation writes when it finishes, and no results.jsonl.signature.json): finish "
                         "it by rerunning its command, or pass allow_different_sampling "
                         "(--allow_different_sampling).")
  sb, sa = meta_before["sampling"], meta_after["sampling"]
  diffs = [f"{k}: {sb.get(k)!r} vs {sa.get(k)!r}" for k in _SAME if sb.get(k) != sa.get(k)]
  if diffs:
    raise CompareError("the runs sampled differently (" + "; ".join(diffs) + "), so a paired test would "
                       "count that as a change of policy; rerun one with the other's settings, or pass "
                       "allow_different_sampling (--allow_different_sampling).")


def compare(before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]]
            ) -> list[dict[str, Any]]:
  """One row per (domain, tier) over the keys both runs hold, then one per tier over all domains."""
  keys = sorted(before.keys() & after.keys())
  if not keys:
    raise CompareError("the runs share no episode keys (task|tier|sample): evaluate the same task list "
                       "(same --domains/--split/--difficulty/--n or --tasks, same --tiers and --samples).")
  groups: dict[tuple[str, str], list[tuple[bool, bool]]] = collections.defaultdict(list)
  for k in keys:
    b, a = before[k], after[k]
    if (b["domain"], b["tier"]) != (a["domain"], a["tier"]):
      raise CompareError(f"episode {k!r} is {b['domain']}/{b['tier']} in one run and "
                         f"{a['domain']}/{a['tier']} in the other: not the same task list.")
    pair = (bool(b["success"]), bool(a["success"]))
    groups[(b["domain"], b["tier"])].append(pair)
    groups[("all", b["tier"])].append(pair)
  order = sorted(groups, key=lambda g: (g[0] == "all", g[0], TIER_ORDER.get(g[1], 9)))
  return [{"domain": d, "tier": t, **paired_row(groups[(d, t)])} for d, t in order]


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
  """The comparison as a markdown table (percentages; z and p of the paired test)."""
  head = ("| domain | tier | n | before % | after % | diff (pts) | up / down | paired SE (pts) | z | "
          "McNemar p | unpaired SE (pts) |\n|---|---|---|---|---|---|---|---|---|---|---|")
  lines = [head]
  for r in rows:
    lines.append(f"| {r['domain']} | {r['tier']} | {r['n']} | {100 * r['before']:.1f} "
                 f"| {100 * r['after']:.1f} | {100 * r['diff']:+.1f} | {r['up']} / {r['down']} "
                 f"| {100 * r['se_paired']:.2f} "
                 f"| {'–' if r['z_paired'] is None else format(r['z_paired'], '+.2f')} "
                 f"| {r['p_mcnemar']:.3g} | {100 * r['se_unpaired']:.2f} |")
  return "\n".join(lines)


def compare_dirs(before_dir: str | Path, after_dir: str | Path, allow_different_sampling: bool = False
                 ) -> tuple[list[dict[str, Any]], dict[str, int]]:
  """(rows, counts of keys only in one run and of episodes a run's policy failed to play) for two
  `experiments.evaluate --out` directories. A key scored in one run and unplayed in the other is
  counted as unplayed, not as only in the first."""
  before, meta_b = load_run(before_dir)
  after, meta_a = load_run(after_dir)
  if not allow_different_sampling:
    check_comparable(meta_b, meta_a)
  rows = compare(before, after)
  # "only in" one run: scored there and absent from the other. A key the other run holds unplayed is
  # in both files and counted once, under that run's "unplayed".
  unplayed_b, unplayed_a = set(meta_b["unplayed"]), set(meta_a["unplayed"])
  return rows, {"only_before": len(before.keys() - after.keys() - unplayed_a),
                "only_after": len(after.keys() - before.keys() - unplayed_b),
                "unplayed_before": len(unplayed_b), "unplayed_after": len(unplayed_a)}
