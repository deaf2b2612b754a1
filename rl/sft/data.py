"""SFT examples: a conversation rendered with the chat format, loss on assistant tokens only.

Sources:
  * oracle trajectories of generated tasks, played through the agent loop and the real
    environments (`oracle_conversations`), so tool results are the ones the tools return;
  * any JSONL of conversations in OpenAI chat format (`load_chat_jsonl`): one object per line
    with `messages` (system / user / assistant with optional `reasoning_content`, `tool_calls`
    and OpenAI's `weight` (0: context only, not trained on) / tool with `tool_call_id`) and
    optional `tools` (OpenAI function tools).

The mask is exact by construction: the chat format is append-only, so assistant message i
occupies render(messages[:i+1])[len(render(messages[:i]) + generation prompt):] -- its
thinking, its text, its tool calls and its end-of-turn -- and nothing else is trained.

Packing (`pack`): examples go into rows of `seq_len` tokens, each with its own segment id
and positions restarting at 0, so neither attention nor the delta rule's state crosses from
one conversation into the next (model/attention: segment masks, state resets at segment
starts; tested in tests/rl/test_sft.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rl.tasks.jsonl import read_values
from serving.chat import ChatRenderer
from serving.types import Message, TextPart, Tool, ToolCall


class ChatDataError(ValueError):
  """A chat JSONL line that is not a valid conversation (names file:line and the field)."""


@dataclasses.dataclass(frozen=True)
class Example:
  """ids [n]; mask [n]: 1 where the token is the assistant's (a training target)."""

  ids: np.ndarray
  mask: np.ndarray
  source: str = ""


def parse_tier_mix(text: str, field: str = "tiers") -> dict[str, float]:
  """"low=1,high=1" -> {tier: weight}; "high" -> {'high': 1.0}; 'off' = thinking off."""
  out = {}
  for part in (p.strip() for p in str(text).split(",") if p.strip()):
    name, sep, w = part.partition("=")
    if name not in ("low", "high", "max", "off"):
      raise ValueError(f"{field}: unknown tier {name!r}; tiers: low, high, max, off.")
    if name in out:
      raise ValueError(f"{field}={text!r}: tier {name!r} appears twice; give each tier one weight.")
    try:
      out[name] = float(w) if sep else 1.0
    except ValueError:
      raise ValueError(f"{field}: weight {w!r} of tier {name!r} is not a number "
                       "(e.g. 'low=1,high=2').") from None
    if not math.isfinite(out[name]) or out[name] < 0:
      raise ValueError(f"{field}: weight of tier {name!r} is {w}; weights must be finite and >= 0.")
  if not out or sum(out.values()) <= 0:
    raise ValueError(f"{field}={text!r}: give at least one tier a positive weight.")
  return out


def tier_for_thinking(thinking_tokens: int, budgets: Mapping[str, int]) -> str:
  """The smallest tier whose budget holds the thinking (the largest when none does)."""
  for tier, budget in sorted(budgets.items(), key=lambda kv: kv[1]):
    if thinking_tokens <= budget:
      return tier
  return max(budgets, key=budgets.get)


def render_example(
  renderer: ChatRenderer,
  messages: Sequence[Message],
  tools: Sequence[Tool] = (),
  tier: str | None = None,
  source: str = "",
  untrained: Collection[int] = (),
) -> Example:
  """Token ids of the whole conversation and the assistant-token mask (assistant messages whose
  index is in `untrained`, OpenAI's weight 0, stay context and are masked out)."""
  thinking = tier is not None
  kw = dict(tools=tools, effort=tier, thinking=thinking)
  full = renderer.render(messages, add_generation_prompt=False, **kw).ids
  mask = np.zeros(len(full), np.int32)
  for i, m in enumerate(messages):
    if m.role != "assistant" or i in untrained:
      continue
    before = renderer.render(messages[:i], add_generation_prompt=True, **kw).ids
    upto = renderer.render(messages[: i + 1], add_generation_prompt=False, **kw).ids
    if full[: len(upto)] != upto or upto[: len(before)] != before:
      raise AssertionError("chat rendering is not append-only for this conversation")
    mask[len(before) : len(upto)] = 1
  return Example(np.asarray(full, np.int32), mask, source)


# ---- OpenAI chat JSONL --------------------------------------------------------------------


def _bad(where: str, field: str | None, message: str) -> ChatDataError:
  return ChatDataError(f"{where}: field '{field}': {message}" if field else f"{where}: {message}")


def _content_text(content: Any, where: str, field: str) -> str:
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for j, part in enumerate(content):
      if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
        raise _bad(
          where, f"{field}[{j}]", "only text parts {type: 'text', text: ...} are supported in SFT data"
        )
      parts.append(part["text"])
    return "".join(parts)
  raise _bad(where, field, f"expected a string or a list of text parts, got {type(content).__name__}")


def _tools(obj: dict, where: str) -> list[Tool]:
  tools = []
  for j, t in enumerate(obj.get("tools") or []):
    fn = t.get("function") if isinstance(t, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
      raise _bad(
        where, f"tools[{j}]", "expected {type: 'function', function: {name, description, parameters}}"
      )
    tools.append(Tool(fn["name"], fn.get("description", ""), fn.get("parameters") or {"type": "object"}))
  return tools


def _tool_call(c: Any, where: str, field: str) -> ToolCall:
  fn = c.get("function") if isinstance(c, dict) else None
  if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(c.get("id"), str)):
    raise _bad(where, field, "expected {id, type: 'function', function: {name, arguments}}")
  args = fn.get("arguments", "{}")
  args = args if isinstance(args, str) else json.dumps(args)
  try:
    ok = isinstance(json.loads(args), dict)
  except ValueError:
    ok = False
  if not ok:
    raise _bad(where, f"{field}.function.arguments", "must be a JSON object (as text)")
  return ToolCall(c["id"], fn["name"], args)


def _message(m: Any, where: str, f: str) -> Message:
  if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
    raise _bad(where, f"{f}.role", "expected one of system, developer, user, assistant, tool")
  weight = m.get("weight", 1)
  if weight not in (0, 1) or isinstance(weight, bool) or ("weight" in m and m["role"] != "assistant"):
    raise _bad(where, f"{f}.weight", f"is {m['weight']!r}; as in OpenAI's format, only an assistant "
               "message takes a weight, 0 (not trained on) or 1 (trained on, the default)")
  role = "system" if m["role"] == "developer" else m["role"]
  text = _content_text(m.get("content"), where, f"{f}.content")
  if role == "assistant":
    calls = [_tool_call(c, where, f"{f}.tool_calls[{j}]") for j, c in enumerate(m.get("tool_calls") or [])]
    thinking = m.get("reasoning_content", m.get("reasoning"))
    if thinking is not None and not isinstance(thinking, str):
      raise _bad(where, f"{f}.reasoning_content", "expected a string")
    return Message("assistant", [TextPart(text)], thinking=thinking, tool_calls=calls)
  if role == "tool":
    if not isinstance(m.get("tool_call_id"), str):
      raise _bad(where, f"{f}.tool_call_id", "a tool message needs the id of the call it answers")
    return Message("tool", [TextPart(text)], tool_call_id=m["tool_call_id"], name=m.get("name"))
  return Message(role, [TextPart(text)])


def parse_chat(obj: Any, where: str) -> tuple[list[Message], list[Tool], frozenset[int]]:
  """One OpenAI-format conversation -> (messages, tools, indices of the assistant messages with
  weight 0, which are context but not trained on); errors name where and the field."""
  if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
    raise _bad(where, "messages", "expected an object with a non-empty 'messages' list")
  tools = _tools(obj, where)
  messages = [_message(m, where, f"messages[{i}]") for i, m in enumerate(obj["messages"])]
  untrained = frozenset(i for i, m in enumerate(obj["messages"]) if m.get("weight", 1) == 0)
  if not any(m.role == "assistant" and i not in untrained for i, m in enumerate(messages)):
    raise _bad(where, "messages", "has no assistant message with weight 1: nothing to train on")
  pending: list[str] = []  # tool calls not yet answered; the conversation may end on a call
  for i, m in enumerate(messages):
    if m.role == "assistant" and pending:
      raise _bad(where, f"messages[{i}]", f"an assistant message while tool call(s) {pending} have no "
                 "tool result yet; add a 'tool' message answering each call before the next turn")
    if m.role == "assistant":
      pending = [c.id for c in m.tool_calls]
    elif m.role == "tool" and m.tool_call_id in pending:
      pending.remove(m.tool_call_id)
  return messages, tools, untrained


def load_chat_jsonl(path: str | Path) -> Iterator[tuple[list[Message], list[Tool], frozenset[int], str]]:
  """Yields (messages, tools, untrained message indices, 'file:line') for each conversation in a
  JSONL file (`parse_chat`)."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"SFT data file {str(path)!r} does not exist")
  for _, where, obj in read_values(path, _bad, "conversation object"):
    messages, tools, untrained = parse_chat(obj, where)
    yield messages, tools, untrained, where


def uses_thinking(messages: Sequence[Message]) -> bool:
  return any(m.role == "assistant" and m.thinking for m in messages)


# ---- packing ------------------------------------------------------------------------------


@dataclasses.dataclass
class PackStats:
  examples: int = 0
  dropped_too_long: int = 0
  rows: int = 0
  tokens: int = 0
  target_tokens: int = 0


def pack(
  examples: Iterable[Example], seq_len: int, stats: PackStats | None = None
) -> Iterator[dict[str, np.ndarray]]:
  """Greedy next-fit packing into rows of seq_len + 1 tokens -> train_step batches of one row: an
  example that does not fit in the open row closes it and starts the next (streaming, in order).

  Each row yields inputs/targets [seq_len] (targets = next token), positions restarting per
  segment, segment_ids 1..k (0 = padding) and loss_mask = the mask of each target token
  within its own segment. Examples longer than seq_len + 1 are dropped (counted).
  """
  stats = stats if stats is not None else PackStats()
  width = seq_len + 1
  ids, mask, seg, pos = [], [], [], []

  def flush():
    n = len(ids)
    pad = width - n
    a = np.asarray(ids + [0] * pad, np.int32)
    m = np.asarray(mask + [0] * pad, np.float32)
    s = np.asarray(seg + [0] * pad, np.int32)
    p = np.asarray(pos + [0] * pad, np.int32)
    same = (s[1:] == s[:-1]) & (s[:-1] > 0)  # a target must lie in its input's segment
    stats.rows += 1
    stats.tokens += n
    row = {
      "inputs": a[:-1],
      "targets": a[1:],
      "positions": p[:-1],
      "segment_ids": s[:-1],
      "loss_mask": m[1:] * same,
    }
    stats.target_tokens += int(row["loss_mask"].sum())
    return row

  for ex in examples:
    stats.examples += 1
    n = len(ex.ids)
    if n > width:
      stats.dropped_too_long += 1
      continue
    if len(ids) + n > width:
      yield flush()
      ids, mask, seg, pos = [], [], [], []
    k = (seg[-1] if seg else 0) + 1
    ids += ex.ids.tolist()
    mask += ex.mask.tolist()
    seg += [k] * n
    pos += list(range(n))
  if ids:
    yield flush()


def row_index(n_rows: int, seed: int, step: int, batch_size: int, j: int) -> int:
  """Which packed row is row j of the batch of `step`: a fresh permutation per epoch, so any
  step's batch is computed directly (resume needs no iterator state)."""
  if n_rows == 0:
    raise ValueError("no SFT rows: every example was dropped (longer than seq_len?) or the sources are empty")
  epoch, k = divmod(step * batch_size + j, n_rows)
  return int(np.random.default_rng([seed, epoch]).permutation(n_rows)[k])


def batches(rows: Sequence[dict[str, np.ndarray]], batch_size: int, seed: int,
            step: int) -> dict[str, np.ndarray]:
  """The batch of `step` as host arrays [batch_size, seq_len]."""
  picked = [rows[row_index(len(rows), seed, step, batch_size, j)] for j in range(batch_size)]
  return {key: np.stack([r[key] for r in picked]) for key in picked[0]}
