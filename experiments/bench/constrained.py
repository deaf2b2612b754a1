"""Benchmark: tool-call token masks, llguidance (serving.constrained) vs the old hand-written automaton.

The old path (a character-level JSON-schema pushdown automaton walked over a token trie,
serving/json_automaton.py + schema_compiler.py + constrained.py) was replaced by llguidance;
it is loaded here from git (`--old_rev`, the last commit that had it) into private module
names, so both run in one process on the same schemas and tokenizer (`small`: 8192 ids).
Each side drives its own ToolCallConstraint with seeded random allowed tokens (at most
`--max_tokens` per call) and times every mask computation it makes:

  * old cold: `_compute_mask` without the memo, per JSON state reached (median of 3);
  * old next(): as the engine saw it (memoised per state, so repeated states are cache hits;
    forced ids included);
  * new mask: `JsonMatcher.mask()` (llguidance bitmask + unpacking to bool [V]);
  * new next(): as the engine sees it (mask, single allowed id as a forced int).

    python -m experiments.bench.constrained --quick
    flock /tmp/horizon_heavy.lock python -m experiments.bench.constrained

Prints a table and, as the last line, one JSON object with the ratios (old / new).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

from serving import constrained
from serving.types import Tool, ToolChoice
from training.tokenizer import default_tokenizer_path, load_tokenizer

OLD_REV = "53b54012199d42aa6e8c6e7bc4ae58447170674c"  # the last commit with serving/json_automaton.py
_OLD_FILES = ("json_automaton", "schema_compiler", "constrained")

_TOOLS = [
    Tool("get_weather", "", {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}}),
    Tool("plot", "", {"type": "object", "required": ["xs", "title"], "properties": {
        "xs": {"type": "array", "items": {"type": "number"}}, "title": {"type": "string"},
        "log": {"type": "boolean"}}}),
    Tool("store", "", {"type": "object", "required": ["key", "value"], "properties": {
        "key": {"type": "string", "maxLength": 16}, "value": {"anyOf": [{"type": "object"}]},
        "meta": {"type": "object", "properties": {"ttl": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string"}}}}}}),
]


def load_old(rev: str) -> types.ModuleType:
  """The old serving.constrained at `rev`, with its two helper modules, under private names."""
  root = Path(__file__).resolve().parents[2]
  import serving
  mods = {}
  for name in _OLD_FILES:
    src = subprocess.run(["git", "show", f"{rev}:serving/{name}.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    # The old modules import each other as serving.<name>: point those at the private copies.
    src = re.sub(r"\bserving\.(json_automaton|schema_compiler)\b", r"serving._old_\1", src)
    src = re.sub(r"\bimport (json_automaton|schema_compiler) as", r"import _old_\1 as", src)
    src = re.sub(r"\bimport (json_automaton|schema_compiler)$", r"import _old_\1 as \1", src, flags=re.M)
    mod = types.ModuleType(f"serving._old_{name}")
    sys.modules[mod.__name__] = mod
    setattr(serving, f"_old_{name}", mod)
    exec(compile(src, f"{rev[:8]}:serving/{name}.py", "exec"), mod.__dict__)  # noqa: S102
    mods[name] = mod
  return mods["constrained"]


def _pick(rng, allowed) -> int:
  return int(rng.choice(np.flatnonzero(allowed))) if isinstance(allowed, np.ndarray) else int(allowed)


def drive_old(old, tok, rng, runs: int, max_tokens: int):
  """Old constraint: (JSON states reached, seconds of every next() call)."""
  states, calls = [], []
  for _ in range(runs):
    c = old.ToolCallConstraint(tok, _TOOLS, ToolChoice("required"))
    for _ in range(max_tokens):
      if c.done:
        break
      if c._phase == 1:
        states.append(c._stack)
      start = time.perf_counter()
      allowed = c.next()
      calls.append(time.perf_counter() - start)
      c.advance(_pick(rng, allowed))
  return states, calls


def drive_new(tok, rng, runs: int, max_tokens: int):
  """New constraint: (seconds of every JsonMatcher.mask(), seconds of every next() call)."""
  masks, calls = [], []
  for _ in range(runs):
    c = constrained.ToolCallConstraint(tok, _TOOLS, ToolChoice("required"))
    for _ in range(max_tokens):
      if c.done:
        break
      if c._phase == 1 and not c._call._matcher.complete:
        start = time.perf_counter()
        c._call._matcher.mask()
        masks.append(time.perf_counter() - start)
      start = time.perf_counter()
      allowed = c.next()
      calls.append(time.perf_counter() - start)
      c.advance(_pick(rng, allowed))
  return masks, calls


def _cold(old, vocab, states, reps: int = 3) -> list[float]:
  """Per state: the median seconds of `reps` cold (unmemoised) old mask computations."""
  out = []
  for stack in states:
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      old._compute_mask(vocab, stack)
      times.append(time.perf_counter() - start)
    out.append(statistics.median(times))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="few drives")
  parser.add_argument("--variant", default="small", help="bundled tokenizer (tiny/small)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max_tokens", type=int, default=256, help="tokens per drive at most")
  parser.add_argument("--old_rev", default=OLD_REV, help="git revision holding the old automaton")
  args = parser.parse_args()
  runs = 6 if args.quick else 40
  tok = load_tokenizer(default_tokenizer_path(args.variant))
  old = load_old(args.old_rev)
  start = time.perf_counter()
  vocab = old._vocab(old._TokKey(tok))
  old_setup = time.perf_counter() - start
  start = time.perf_counter()
  constrained.ToolCallConstraint(tok, _TOOLS, ToolChoice("required"))
  new_setup = time.perf_counter() - start
  states, old_calls = drive_old(old, tok, np.random.default_rng(args.seed), runs, args.max_tokens)
  distinct = list(dict.fromkeys(states))
  old_cold = _cold(old, vocab, distinct)
  new_masks, new_calls = drive_new(tok, np.random.default_rng(args.seed), runs, args.max_tokens)
  ms = lambda xs, q: 1e3 * float(np.quantile(xs, q))  # noqa: E731
  rows = [("old cold mask", old_cold), ("old next() memoised", old_calls),
          ("new mask (llguidance)", new_masks), ("new next()", new_calls)]
  print(f"tokenizer {args.variant} ({tok.vocab_size} ids); old rev {args.old_rev[:10]}; {runs} drives per "
        f"side, <= {args.max_tokens} tokens each; first-use setup: old token texts {old_setup * 1e3:.0f} ms, "
        f"new tokenizer bridge + grammar {new_setup * 1e3:.0f} ms")
  print(f"{'mask':<24} {'n':>6} {'median ms':>10} {'mean ms':>8} {'p90 ms':>8} {'max ms':>8}")
  for name, xs in rows:
    mean, top = 1e3 * float(np.mean(xs)), 1e3 * max(xs)
    print(f"{name:<24} {len(xs):>6} {ms(xs, 0.5):>10.4f} {mean:>8.4f} {ms(xs, 0.9):>8.4f} {top:>8.3f}")
  print(json.dumps({
      "vocab_size": tok.vocab_size, "old_cold_mask_ms_median": round(ms(old_cold, 0.5), 4),
      "new_mask_ms_median": round(ms(new_masks, 0.5), 4), "new_mask_ms_max": round(1e3 * max(new_masks), 3),
      "old_next_ms_median": round(ms(old_calls, 0.5), 4), "new_next_ms_median": round(ms(new_calls, 0.5), 4),
      "old_cold_over_new_mask_median": round(ms(old_cold, 0.5) / ms(new_masks, 0.5), 1),
      "old_next_over_new_next_median": round(ms(old_calls, 0.5) / ms(new_calls, 0.5), 2),
      "old_next_over_new_next_mean": round(float(np.mean(old_calls) / np.mean(new_calls)), 2),
      "old_next_over_new_next_p90": round(ms(old_calls, 0.9) / ms(new_calls, 0.9), 2)}))


if __name__ == "__main__":
  main()
