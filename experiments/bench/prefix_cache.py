"""Prefix cache: time to first token per turn of an 8-turn tool conversation, cache off vs on.

    python -m experiments.bench.prefix_cache            # agent variant, growing to ~4K tokens
    python -m experiments.bench.prefix_cache --quick    # tiny, ~1.7K tokens, one repetition

An agent resends its whole history every turn: turn t's prompt is the system part (tools,
instructions, a reference document: ~1K tokens), the task, and every earlier assistant turn
(~200 tokens of thinking, kept in the history as our chat format does, and a shell tool
call) with its tool result (~150 tokens); real text from `pydoc_data.topics` throughout.
Each turn the model "writes" the scripted assistant message: a processor forces its tokens,
so the completion is exactly what the next prompt re-sends, as when a model's own output is
replayed (what an agent does; the tokens a model samples are the ones it is sent back).

Two engines on the same random weights run the same conversation in one process, one with
the prefix cache off and one with it on (serving/prefix_cache.py), after compiling every
program; time to first token (submit -> first token, through the engine's loop thread) is
the turn's prefill time, as a client would wait for it. Repeated `--reps` times (each on a
fresh cache), the median per turn is reported. Last line: JSON with `prefill_speedup`
(total TTFT off / on) and the cache's hit rate (reused / prompt tokens).
"""

from __future__ import annotations

import json
import logging
import statistics
import time

import numpy as np
from absl import app, flags

from configs import serve
from experiments.bench.common import quick_flag
from serving.build import build_engine
from serving.chat import ChatRenderer
from serving.engine import Engine, Request
from serving.types import Message, SamplingParams, TextPart, Tool, ToolCall

_QUICK = quick_flag("tiny model, a short conversation.")
_TURNS = flags.DEFINE_integer("turns", 8, "Assistant turns.")
_REPS = flags.DEFINE_integer("reps", 3, "Repetitions (each on a fresh cache); medians reported.",
                            lower_bound=1)

TOOLS = [Tool("shell", "Run a shell command in the workspace and return its output.",
              {"type": "object", "properties": {"command": {"type": "string", "description": "The command."}},
               "required": ["command"]})]


class _Script:
  """A processor that forces the given ids (the scripted assistant turn), then lets it stop."""

  def __init__(self, ids: list[int]):
    self.ids, self.k, self.thinking_tokens = ids, 0, 0

  def next_constraint(self):
    return self.ids[self.k] if self.k < len(self.ids) else None

  def feed(self, token_id: int):
    self.k += 1
    return [], None

  def close(self, reason: str):
    return []


def _text(words: int, offset: int) -> str:
  """`words` words of real documentation (Python's own pydoc topics), from `offset`."""
  import pydoc_data.topics as topics
  all_words = " ".join(topics.topics[k] for k in sorted(topics.topics)).split()
  return " ".join(all_words[offset:offset + words])


def conversation(renderer: ChatRenderer, turns: int, doc_words: int, think_words: int, result_words: int):
  """[(prompt ids, forced completion ids)] per turn; each prompt extends the previous turn's.

  The system part holds `doc_words` of reference text; each assistant turn thinks
  `think_words` (kept in the history, as our chat format does) and calls the shell, whose
  result has `result_words`.
  """
  messages = [Message("system", [TextPart("You are a careful engineer working in a Linux shell. Reference:\n"
                                          + _text(doc_words, 0))]),
              Message("user", [TextPart("Find out why the test suite fails and summarise the cause.")])]
  out = []
  for t in range(turns):
    prompt = renderer.render(messages, tools=TOOLS, thinking=True, effort="high").ids
    command = f"sed -n {40 * t + 1},{40 * t + 40}p notes.txt"
    call = ToolCall(f"call_{t}", "shell", json.dumps({"command": command}))
    thinking = f"Step {t + 1}: what the last output says, and what to read next. " + _text(
        think_words, 50_000 + t * think_words)
    reply = Message("assistant", [], thinking=thinking, tool_calls=[call])
    whole = renderer.render(messages + [reply], tools=TOOLS, thinking=True, effort="high",
                            add_generation_prompt=False).ids
    if whole[:len(prompt)] != prompt:
      raise RuntimeError("the chat format is not append-only here; the benchmark's premise fails")
    out.append((prompt, whole[len(prompt):]))  # the completion ends with <|end_of_turn|> (a stop id)
    messages += [reply, Message("tool", [TextPart(_text(result_words, doc_words + t * result_words))],
                                tool_call_id=call.id, name="shell")]
  return out


def _ttft(engine: Engine, prompt: list[int], completion: list[int]) -> float:
  params = SamplingParams(max_tokens=len(completion), temperature=0.0)
  t0 = time.time()
  handle = engine.submit(Request(list(prompt), params, processor=_Script(completion)))
  first = None
  for ev in handle.events():
    first = ev.time if first is None else first
  return first - t0


def _warm(engine: Engine, vocab: int) -> None:
  """Compiles every program (prefill at each width, decode, sampling; with the cache: its copies,
  hit and miss)."""
  for w in engine.prefill_buckets:
    prompt = [int(t) for t in np.random.default_rng(w).integers(3, vocab, engine.prefill_chunk + w)]
    for _ in range(2):
      engine.generate(Request(prompt, SamplingParams(max_tokens=4, temperature=0.0)))


def run(config, turns: int, reps: int, words: tuple[int, int, int]) -> dict:
  base = build_engine(config)
  off = Engine(base.model, base.tokenizer, slots=base.slots, max_context=base.max_context,
               prefill_chunk=base.prefill_chunk)
  renderer = ChatRenderer(base.tokenizer, base.cfg.vision.num_patches if base.cfg.vision.enabled else 0)
  convo = conversation(renderer, turns, *words)
  longest = len(convo[-1][0]) + len(convo[-1][1])
  if longest > base.max_context:
    raise ValueError(f"the conversation reaches {longest} tokens > max_context={base.max_context}")
  times = {"off": [[] for _ in convo], "on": [[] for _ in convo]}
  reused = []
  s = config.serving
  for rep in range(reps):
    on = Engine(base.model, base.tokenizer, slots=base.slots, max_context=base.max_context,
                prefill_chunk=base.prefill_chunk, prefix_cache_mb=s.prefix_cache_mb,
                prefix_cache_block=s.prefix_cache_block)  # a fresh cache per repetition
    for name, engine in (("off", off), ("on", on)):
      if rep == 0 or name == "on":
        _warm(engine, base.cfg.vocab_size)
      engine.start()
      try:
        before = engine.metrics.prefix_reused_tokens.value()
        for t, (prompt, completion) in enumerate(convo):
          times[name][t].append(_ttft(engine, prompt, completion))
          if name == "on" and rep == 0:
            now = engine.metrics.prefix_reused_tokens.value()
            reused.append(int(now - before))
            before = now
      finally:
        engine.stop()
  rows = []
  for t, (prompt, _) in enumerate(convo):
    rows.append({"turn": t + 1, "prompt_tokens": len(prompt), "reused_tokens": reused[t],
                 "ttft_off_ms": 1e3 * statistics.median(times["off"][t]),
                 "ttft_on_ms": 1e3 * statistics.median(times["on"][t])})
  return {"rows": rows, "model": s.model_name, "block": s.prefix_cache_block, "chunk": base.prefill_chunk}


def main(argv) -> None:
  del argv
  logging.getLogger("jax").setLevel(logging.WARNING)
  quick = _QUICK.value
  config = serve.get_config("tiny" if quick else "agent")
  if quick:
    config.model.max_seq_len = 2048  # tiny's tokenizer spends ~4 tokens per word
    config.serving.update(max_context=2048, slots=2)
    words = (40, 3, 6)
  else:
    config.serving.update(max_context=4096, slots=2)
    words = (560, 85, 95)  # ~1K tokens of system part; each turn adds ~200 + ~150 tokens
  out = run(config, _TURNS.value, 1 if quick else _REPS.value, words)
  rows = out["rows"]
  print(f"model {out['model']} (random weights): prefill chunk {out['chunk']}, cache block {out['block']}, "
        f"median of {1 if quick else _REPS.value}")
  print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'TTFT off':>10} {'TTFT on':>9} {'speedup':>8}")
  for r in rows:
    print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['reused_tokens']:>7} {r['ttft_off_ms']:>8.1f}ms "
          f"{r['ttft_on_ms']:>7.1f}ms {r['ttft_off_ms'] / r['ttft_on_ms']:>7.2f}x")
  off_total = sum(r["ttft_off_ms"] for r in rows)
  on_total = sum(r["ttft_on_ms"] for r in rows)
  prompt_total = sum(r["prompt_tokens"] for r in rows)
  reused_total = sum(r["reused_tokens"] for r in rows)
  print(f" all {prompt_total:>7} {reused_total:>7} {off_total:>8.1f}ms {on_total:>7.1f}ms "
        f"{off_total / on_total:>7.2f}x")
  print(json.dumps({"model": out["model"], "turns": len(rows),
                    "final_prompt_tokens": rows[-1]["prompt_tokens"],
                    "prefill_ms_off": round(off_total, 1), "prefill_ms_on": round(on_total, 1),
                    "ttft_ms_off": [round(r["ttft_off_ms"], 1) for r in rows],
                    "ttft_ms_on": [round(r["ttft_on_ms"], 1) for r in rows],
                    "hit_rate": round(reused_total / prompt_total, 4),
                    "prefill_speedup": round(off_total / on_total, 2)}))


if __name__ == "__main__":
  app.run(main)
