"""Evaluation reports: a markdown table domain x tier, a PNG plot, a JSON summary.

Columns: n (episodes), success % with its 95% Wilson interval, pass@k (when several samples),
mean reward, thinking tokens, turns, tool errors (means per episode), latency p50/p95 (episode
wall seconds).
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Sequence
from typing import Any

from rl.agent.episode import unplayed as _unplayed
from rl.eval.stats import pass_at_k, percentile, wilson

TIER_ORDER = {"off": 0, "low": 1, "high": 2, "max": 3}


def _mean(xs: Sequence[float]) -> float:
  return sum(xs) / len(xs) if xs else float("nan")


def unplayed(records: Sequence[dict[str, Any]]) -> dict[str, int]:
  """Episodes the policy failed to play (end 'error': a server down, a rejected request), by
  'domain/tier': no score, so `aggregate` leaves them out; a resumed evaluation replays them."""
  return dict(sorted(collections.Counter(f"{r['domain']}/{r['tier']}" for r in records
                                         if _unplayed(r)).items()))


def aggregate(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per (domain, tier), then one per tier over all domains ('all'), over the episodes
  that were played (`unplayed` counts the others)."""
  groups: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
  for r in records:
    if _unplayed(r):
      continue
    groups[(r["domain"], r["tier"])].append(r)
    groups[("all", r["tier"])].append(r)
  rows = []
  for (domain, tier), rs in sorted(
    groups.items(), key=lambda kv: (kv[0][0] == "all", kv[0][0], TIER_ORDER.get(kv[0][1], 9))
  ):
    n, wins = len(rs), sum(bool(r["success"]) for r in rs)
    lo, hi = wilson(wins, n)
    row = {
      "domain": domain,
      "tier": tier,
      "n": n,
      "tasks": len({r["task_id"] for r in rs}),
      "success": wins / n,
      "ci_low": lo,
      "ci_high": hi,
      "reward": _mean([float(r["reward"]) for r in rs]),
      "thinking_tokens": _mean([float(r["thinking_tokens"]) for r in rs]),
      "turns": _mean([float(r["turns"]) for r in rs]),
      "tool_errors": _mean([float(r["tool_errors"]) for r in rs]),
      # broken calls ended as text (engine policies; absent from results written before the field)
      "malformed_calls": _mean([float(r.get("malformed_calls", 0)) for r in rs]),
      "latency_p50": percentile([float(r["wall_s"]) for r in rs], 50),
      "latency_p95": percentile([float(r["wall_s"]) for r in rs], 95),
      # episodes scored 0 because the grader raised (rl.agent.loop): not the model's failures
      "grader_failed": sum(bool((r.get("grade") or {}).get("grader_failed")) for r in rs),
    }
    per_task = collections.defaultdict(list)
    for r in rs:
      per_task[r["task_id"]].append(bool(r["success"]))
    k = min(len(v) for v in per_task.values())
    if k > 1:
      row[f"pass@{k}"] = _mean([pass_at_k(len(v), sum(v), k) for v in per_task.values()])
    rows.append(row)
  return rows


def _fmt(x: float, digits: int = 2) -> str:
  return "–" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}f}"


def markdown(rows: Sequence[dict[str, Any]], not_played: dict[str, int] | None = None) -> str:
  passk = sorted({k for r in rows for k in r if k.startswith("pass@")})
  head = [
    "domain",
    "tier",
    "n",
    "success % (95% CI)",
    *passk,
    "reward",
    "thinking tok",
    "turns",
    "tool err",
    "bad calls",
    "latency p50 s",
    "latency p95 s",
  ]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [
      r["domain"],
      r["tier"],
      str(r["n"]),
      f"{100 * r['success']:.1f} ({100 * r['ci_low']:.1f}–{100 * r['ci_high']:.1f})",
      *[_fmt(100 * r[k], 1) if k in r else "–" for k in passk],
      _fmt(r["reward"], 3),
      _fmt(r["thinking_tokens"], 1),
      _fmt(r["turns"], 2),
      _fmt(r["tool_errors"], 2),
      _fmt(r["malformed_calls"], 2),
      _fmt(r["latency_p50"], 3),
      _fmt(r["latency_p95"], 3),
    ]
    lines.append("| " + " | ".join(cells) + " |")
  failed = {f"{r['domain']}/{r['tier']}": r["grader_failed"] for r in rows
            if r.get("grader_failed") and r["domain"] != "all"}
  if failed:  # these scored 0 without the model failing: the success column undercounts
    lines.append("\n**Grading failed** (scored 0; `grade.error` in results.jsonl says why): "
                 + ", ".join(f"{k} {v}" for k, v in failed.items()))
  if not_played:
    lines.append("\n**Not played** (the policy failed: `error` in results.jsonl says why; not counted "
                 "above; run the same command again to replay them): "
                 + ", ".join(f"{k} {v}" for k, v in not_played.items()))
  return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str, title: str = "success vs thinking tokens") -> None:
  """Success (with Wilson intervals) against mean thinking tokens; one line per domain through
  its tiers."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
  markers = {"off": "o", "low": "s", "high": "^", "max": "D"}
  by_domain = collections.defaultdict(list)
  for r in rows:
    if r["domain"] != "all":
      by_domain[r["domain"]].append(r)
  for domain, rs in sorted(by_domain.items()):
    rs = sorted(rs, key=lambda r: TIER_ORDER.get(r["tier"], 9))
    xs = [r["thinking_tokens"] for r in rs]
    ys = [100 * r["success"] for r in rs]
    err = [
      [100 * (r["success"] - r["ci_low"]) for r in rs],
      [100 * (r["ci_high"] - r["success"]) for r in rs],
    ]
    line = ax.errorbar(xs, ys, yerr=err, capsize=3, label=domain, alpha=0.9)
    for r, x, y in zip(rs, xs, ys, strict=True):
      ax.plot([x], [y], markers.get(r["tier"], "x"), color=line[0].get_color())
  ax.set_xlabel("mean thinking tokens per episode")
  ax.set_ylabel("success % (95% Wilson)")
  ax.set_ylim(-2, 102)
  ax.set_title(title + "  (markers: ○ off  □ low  △ high  ◇ max)", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc="best")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def summary_json(rows: Sequence[dict[str, Any]]) -> str:
  """The last line of an evaluation: per (domain, tier) success and interval, rounded."""
  out = {
    f"{r['domain']}/{r['tier']}": {
      k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("domain", "tier")
    }
    for r in rows
  }
  return json.dumps(out, sort_keys=True)
