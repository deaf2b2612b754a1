"""Constrained tool calls: token masks from a character-level JSON-schema automaton.

For tool_choice 'required' / 'named' (serving_spec.md, "Constrained tool calls") the
answer is forced to be exactly

    <|tool_call|>{"name": "NAME", "arguments": {...}}<|/tool_call|><|end_of_turn|>

with the markers as special ids and the JSON as ordinary text tokens; 'none' bans
<|tool_call|>. This is grammar-constrained decoding (Willard & Louf, 2023, "Efficient
Guided Generation for Large Language Models" -- Outlines; Geng et al., 2023,
"Grammar-Constrained Decoding for Structured NLP Tasks without Finetuning"): before each
token, every vocabulary token whose text cannot extend the output towards a valid document
is masked out. Outlines compiles a regex into a token-level FSM ahead of time; JSON schemas
nest and count (string lengths, item counts), so here a small pushdown automaton over
*characters* (serving.json_automaton: which texts; serving.schema_compiler: which schema
subset, the bounds) runs
instead, and the masks of the states actually reached are computed lazily and memoised.
The JSON is canonical -- json.dumps(json.loads(text), separators=(", ", ": ")) == text --
so a constrained call re-renders into history as the same text; bounded sizes make every
call end within `max_tokens`.

Mask speed (< 20 ms per `next()` for an 8192-token vocabulary; experiments/bench/
constrained.py): a trie of the token strings is walked together with the automaton, so only
valid prefixes are visited. Inside a string, where most tokens are valid, tokens made only
of plain characters are accepted by one numpy length comparison and only the ~100 tokens
holding a quote or backslash are simulated. Token texts are decoded once per tokenizer
(keyed by its fingerprint); masks are memoised per automaton state and shared by every
constraint with the same tokenizer, tools and bounds. Tokens that are not complete ASCII
text (special ids, incomplete UTF-8 that decodes to U+FFFD, non-ASCII) never appear inside
the JSON: canonical JSON is ASCII.

Caveat: the mask admits every tokenization of valid text, not only the one
`tokenizer.encode` would produce; a model trained on rendered calls prefers the latter.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import threading
from collections.abc import Sequence

import numpy as np

from serving import json_automaton as automaton
from serving import schema_compiler
from serving.json_automaton import validate_arguments
from serving.types import Tool, ToolChoice
from training.tokenizer import Tokenizer

__all__ = ["ToolCallConstraint", "validate_arguments"]

_CACHE_BYTES = 32 << 20  # memoised masks per grammar
_FAR = 1 << 30


# ---------------------------------------------------------------------- masks --
@dataclasses.dataclass(frozen=True, eq=False)
class _Vocab:
  """Every token's text, precomputed once per tokenizer.

  ok: [V] bool, may appear inside the JSON (non-empty ASCII, not special; incomplete UTF-8
  decodes to U+FFFD and is never ASCII). plain_len: [V] length of tokens made only of plain
  string characters, else _FAR. stop: [V] index of the first '"' or '\\\\' of tokens plain
  before it, else _FAR. trie: (children {char: node}, [ids of tokens ending here]).
  """
  texts: tuple[str, ...]
  ok: np.ndarray
  plain_len: np.ndarray
  stop: np.ndarray
  trie: tuple


def _build_vocab(tokenizer: Tokenizer) -> _Vocab:
  n = tokenizer.vocab_size
  specials = set(tokenizer.special_ids.values())
  texts = tuple(tokenizer.decode([i]) for i in range(n))
  ok = np.zeros(n, bool)
  plain_len = np.full(n, _FAR, np.int64)
  stop = np.full(n, _FAR, np.int64)
  trie: tuple = ({}, [])
  for i, text in enumerate(texts):
    if i in specials or not text or not text.isascii():
      continue
    ok[i] = True
    p = next((k for k, c in enumerate(text) if c not in automaton.PLAIN), len(text))
    if p == len(text):
      plain_len[i] = p
    elif text[p] in '"\\':
      stop[i] = p
    node = trie
    for c in text:
      node = node[0].setdefault(c, ({}, []))
    node[1].append(i)
  return _Vocab(texts, ok, plain_len, stop, trie)


def _compute_mask(vocab: _Vocab, stack: tuple) -> np.ndarray:
  """[V] bool: the tokens whose whole text keeps `stack` valid (trie walk; string fast path)."""
  room = automaton.string_room(stack)
  if room is not None:
    return _string_mask(vocab, stack, *room)
  step = automaton.step
  ids: list[int] = []
  work = [(vocab.trie, stack)]
  while work:
    node, state = work.pop()
    for ch, child in node[0].items():
      nxt = step(state, ch)
      if nxt is not None:
        ids.extend(child[1])
        if child[0]:
          work.append((child, nxt))
  mask = np.zeros(len(vocab.texts), bool)
  mask[ids] = True
  return mask


def _string_mask(vocab: _Vocab, stack: tuple, room: int, key: str, used: tuple | None) -> np.ndarray:
  """Inside a string: plain tokens by length; tokens with a quote or backslash simulated."""
  mask = vocab.plain_len <= room
  if used is not None:  # a unique key may not end at the bound on a used key
    for i in np.flatnonzero(vocab.plain_len == room):
      mask[i] = key + vocab.texts[i] not in used
  for i in np.flatnonzero(vocab.stop <= room):
    mask[i] = automaton.walk(stack, vocab.texts[i]) is not None
  return mask


def _reference_mask(vocab: _Vocab, stack: tuple) -> np.ndarray:
  """`_compute_mask` by simulating every token on its own (slow; for tests and benchmarks)."""
  return np.array([bool(ok) and automaton.walk(stack, text) is not None
                   for ok, text in zip(vocab.ok, vocab.texts, strict=True)])


class _Grammar:
  """The automaton of one tool set, with its memoised masks (thread-safe)."""

  def __init__(self, vocab: _Vocab, root: automaton.Root):
    self.vocab, self.root = vocab, root
    self._masks: collections.OrderedDict = collections.OrderedDict()
    self._cap = max(64, min(1 << 16, _CACHE_BYTES // len(vocab.texts)))
    self._lock = threading.Lock()

  def allowed(self, stack: tuple) -> tuple[np.ndarray, int]:
    """(read-only [V] mask, the only allowed id or -1)."""
    with self._lock:
      hit = self._masks.get(stack)
      if hit is not None:
        self._masks.move_to_end(stack)
        return hit
    mask = _compute_mask(self.vocab, stack)
    mask.flags.writeable = False
    ids = np.flatnonzero(mask)
    if ids.size == 0:
      raise RuntimeError("constrained decoding reached a state with no allowed token (a bug).")
    hit = (mask, int(ids[0]) if ids.size == 1 else -1)
    with self._lock:
      self._masks[stack] = hit
      if len(self._masks) > self._cap:
        self._masks.popitem(last=False)
    return hit


class _TokKey:
  """Hashes a tokenizer by its file fingerprint: reloading the same file reuses the caches."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer

  def __hash__(self) -> int:
    return hash(self.tokenizer.fingerprint)

  def __eq__(self, other) -> bool:
    return isinstance(other, _TokKey) and other.tokenizer.fingerprint == self.tokenizer.fingerprint


@functools.lru_cache(maxsize=8)
def _vocab(key: _TokKey) -> _Vocab:
  return _build_vocab(key.tokenizer)


@functools.lru_cache(maxsize=64)
def _grammar(key: _TokKey, spec: str, bounds: schema_compiler.Bounds) -> _Grammar:
  """spec: JSON [[index in tools, name, parameters], ...] of the callable tools."""
  return _Grammar(_vocab(key), schema_compiler.compile_tools(json.loads(spec), bounds))


# ----------------------------------------------------------------- public API --
class ToolCallConstraint:
  """Forces one schema-valid tool call ('required' / 'named') or bans calls ('none').

  Phases: <|tool_call|> (forced), the JSON (masks), <|/tool_call|> (forced), <|end_of_turn|>
  (forced), done. 'none' never finishes: every step bans <|tool_call|> only.
  """

  def __init__(self, tokenizer: Tokenizer, tools: Sequence[Tool], choice: ToolChoice, *,
               max_string_chars: int = 48, max_array_items: int = 4, max_number_chars: int = 10,
               max_depth: int = 4):
    for name, value, least in (("max_string_chars", max_string_chars, 1),
                               ("max_array_items", max_array_items, 1),
                               ("max_number_chars", max_number_chars, 1), ("max_depth", max_depth, 0)):
      if not isinstance(value, int) or value < least:
        raise ValueError(f"ToolCallConstraint({name}={value!r}): must be an integer >= {least}.")
    tools = list(tools)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
      raise ValueError(f"tools: names must be distinct, got {names}.")
    self.mode = choice.mode
    self._call = tokenizer.special_id("tool_call")
    self._markers = (self._call, None, tokenizer.special_id("/tool_call"),
                     tokenizer.special_id("end_of_turn"))
    self._text = ""  # immutable state throughout: copy.copy(constraint) is an independent copy
    self._phase = 0
    if choice.mode == "none":
      self._ban = np.ones(tokenizer.vocab_size, bool)
      self._ban[self._call] = False
      self._ban.flags.writeable = False
      return
    if choice.mode == "required":
      if not tools:
        raise ValueError("tool_choice 'required' needs at least one tool in `tools`.")
      chosen = list(enumerate(tools))
    elif choice.mode == "named":
      if choice.name not in names:
        raise ValueError(f"tool_choice.name={choice.name!r} is not one of the tools {names}; name one of "
                         "them or use tool_choice 'required'.")
      chosen = [(names.index(choice.name), tools[names.index(choice.name)])]
    else:
      raise ValueError(f"tool_choice.mode={choice.mode!r} is not constrained: ToolCallConstraint serves "
                       "'required', 'named' and 'none' ('auto' leaves the model free).")
    try:
      spec = json.dumps([[i, t.name, t.parameters] for i, t in chosen])
    except (TypeError, ValueError) as e:
      raise ValueError(f"tools[*].parameters must be JSON: {e}") from None
    bounds = schema_compiler.Bounds(max_string_chars, max_array_items, max_number_chars, max_depth)
    self._grammar = _grammar(_TokKey(tokenizer), spec, bounds)
    self._stack: tuple = (self._grammar.root.initial(),)

  @property
  def done(self) -> bool:
    """The whole call, <|end_of_turn|> included, has been advanced ('none': never)."""
    return self.mode != "none" and self._phase == 4

  @property
  def max_tokens(self) -> int | None:
    """An upper bound on the tokens of the whole constrained answer (None for 'none')."""
    return None if self.mode == "none" else 3 + self._grammar.root.max_len

  @property
  def text(self) -> str:
    """The JSON text advanced so far."""
    return self._text

  def next(self) -> int | np.ndarray | None:
    """The forced id, or a read-only bool [vocab_size] mask of allowed ids, or None when done."""
    if self.mode == "none":
      return self._ban
    if self._phase != 1:
      return None if self._phase == 4 else self._markers[self._phase]
    mask, forced = self._grammar.allowed(self._stack)
    return forced if forced >= 0 else mask

  def advance(self, token_id: int) -> None:
    """Consumes the generated token; ValueError (state unchanged) if it was not allowed."""
    tid = int(token_id)
    if self.mode == "none":
      if tid == self._call:
        raise ValueError("advance(<|tool_call|>): tool_choice 'none' bans tool calls.")
      return
    if self._phase != 1:
      if self._phase == 4 or tid != self._markers[self._phase]:
        raise ValueError(f"advance({tid}): not allowed here; expected {self.next()!r}.")
      self._phase += 1
      return
    vocab = self._grammar.vocab
    ok = 0 <= tid < len(vocab.texts) and vocab.ok[tid]
    stack = automaton.walk(self._stack, vocab.texts[tid]) if ok else None
    if stack is None:
      raise ValueError(f"advance({tid}): token {vocab.texts[tid] if ok else tid!r} cannot continue the "
                       f"tool call {self.text!r}.")
    self._stack = stack
    self._text += vocab.texts[tid]
    if automaton.Root.complete(stack):
      self._phase = 2
