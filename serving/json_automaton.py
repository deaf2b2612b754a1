"""A character-level pushdown automaton for canonical JSON tool calls under a JSON schema.

serving.constrained turns it into token masks (grammar-constrained decoding); this module
only knows characters. It accepts exactly the texts

    {"name": NAME, "arguments": ARGS}

that `json.dumps({"name": n, "arguments": args}, separators=(", ", ": "))` prints for their
own parsed value -- the form the chat renderer writes back into history
(serving.chat.tool_call_json) -- with ARGS valid under the tool's schema. Canonical text
means: ASCII only (non-ASCII and control characters as json.dumps' short or lowercase
`\\uXXXX` escapes; astral characters, which need surrogate pairs, are never produced), no
`\\/`, numbers in Python's float repr form without exponents, keys in the schema's order.

Which schema compiles to which nodes, and within which bounds, is serving/schema_compiler.py
(the grammar compiler, which also lists the supported schema subset); this module is the
runtime: the node kinds and `step` / `walk` over a state, plus `validate_arguments`, the
same subset checked on a parsed value (the output parser and RL graders use it).

A state is a stack (tuple) of frames; a frame is a tuple (node, *state), immutable and
hashable, so states can key a cache. node.feed(stack, ch) returns the new stack, None (ch
is invalid) or _POP (the top frame is complete and ch belongs to its parent).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

SEPARATORS = (", ", ": ")
_POP = object()  # a complete frame that does not take the character: its parent must
PLAIN = frozenset(map(chr, range(0x20, 0x7F))) - {'"', "\\"}  # string characters needing no escape
_SHORT_ESCAPES = frozenset('"\\bfnrt')
_HEX = frozenset("0123456789abcdef")
# Code points json.dumps (ensure_ascii) writes as \uXXXX: controls without a short escape,
# DEL and the rest of the BMP; surrogates are excluded, so astral characters never appear.
_U_RANGES = ((0x00, 0x07), (0x0B, 0x0B), (0x0E, 0x1F), (0x7F, 0xD7FF), (0xE000, 0xFFFF))
_NUM_CHARS = frozenset("-0123456789.")
_FLOAT_DIGITS = 15  # a decimal with <= 15 digits is its own float repr (DBL_DIG)


def _replace(stack: tuple, frame: tuple) -> tuple:
  return stack[:-1] + (frame,)


def step(stack: tuple, ch: str) -> tuple | None:
  """The stack after one more character, or None if `ch` cannot extend a valid text."""
  while stack:
    out = stack[-1][0].feed(stack, ch)
    if out is not _POP:
      return out
    stack = stack[:-1]
  return None


def walk(stack: tuple | None, text: str) -> tuple | None:
  """The stack after `text`, or None if some character is invalid."""
  for ch in text:
    if stack is None:
      return None
    stack = step(stack, ch)
  return stack


def _push(stack: tuple, parent: tuple, child, ch: str) -> tuple | None:
  """Top := `parent` (in its after-child phase); a new `child` frame consumes `ch`."""
  return child.feed(stack[:-1] + (parent, child.initial()), ch)


def number_need(text: str, integer: bool) -> int:
  """Characters still needed to make `text` a canonical number (0: complete); -1: never.

  Canonical = json.dumps(json.loads(text)) == text: no leading zeros, no "-0" integer, no
  exponent, a fraction is "0" or ends in a non-zero digit, "0." + at most 3 zeros before a
  digit (repr switches to 1e-05 below 1e-4), at most 15 digits.
  """
  body = text[1:] if text.startswith("-") else text
  whole, dot, frac = body.partition(".")
  if not whole:
    return -1 if dot else 1
  if not whole.isdigit() or (len(whole) > 1 and whole[0] == "0"):
    return -1
  if not dot:
    if whole == "0" and body is not text:
      return -1 if integer else 2  # "-0" -> "-0.0"
    return 0
  if integer or (frac and not frac.isdigit()):
    return -1
  if whole == "0" and len(frac) - len(frac.lstrip("0")) > 3 and frac != "0":
    return -1
  need = 0 if frac == "0" or (frac and frac[-1] != "0") else 1
  return need if len(whole) + len(frac) + need <= _FLOAT_DIGITS else -1


def _u_feasible(digits: str) -> bool:
  """Whether lowercase hex `digits` (1-4) can start a canonical \\uXXXX escape."""
  span = 16 ** (4 - len(digits))
  lo = int(digits, 16) * span
  return any(a <= lo + span - 1 and lo <= b for a, b in _U_RANGES)


class LitNode:
  """One of a fixed set of JSON texts (enum/const values, true/false, null). Frame (node, text)."""

  def __init__(self, texts: Sequence[str]):
    self.texts = frozenset(texts)
    self.prefixes = frozenset(t[:i] for t in texts for i in range(1, len(t) + 1))
    self.first = frozenset(t[0] for t in texts)
    self.max_len = max(map(len, texts))

  def initial(self) -> tuple:
    return (self, "")

  def feed(self, stack, ch):
    text = stack[-1][1]
    if text + ch in self.prefixes:
      return _replace(stack, (self, text + ch))
    return _POP if text in self.texts else None  # "1" of enum [1, 12] ends at the parent's ","


class NumNode:
  """A canonical integer or number of at most `max_chars` characters. Frame (node, text)."""

  first = frozenset("-0123456789")

  def __init__(self, integer: bool, max_chars: int):
    self.integer = integer
    self.max_len = max_chars

  def initial(self) -> tuple:
    return (self, "")

  def feed(self, stack, ch):
    text = stack[-1][1]
    if ch in _NUM_CHARS:
      need = number_need(text + ch, self.integer)
      if need >= 0 and len(text) + 1 + need <= self.max_len:
        return _replace(stack, (self, text + ch))
    return _POP if text and number_need(text, self.integer) == 0 else None


class StrNode:
  """A JSON string of lo..hi characters (an escape counts one).

  Frame (node, phase, count, esc, raw): phase 0 expects the opening quote, 1 is inside, 2 is
  closed; esc is None, "\\\\" after a backslash, or "u" + the hex digits of a \\u escape. With
  `unique` (keys of a free-key object) escapes are not allowed, raw is the key so far, and the
  parent AnyObjNode frame's used keys (its index 3) are read and extended on close.
  """

  first = frozenset('"')

  def __init__(self, lo: int, hi: int, unique: bool = False):
    self.lo, self.hi, self.unique = lo, hi, unique
    self.max_len = 2 + hi * (1 if unique else 6)

  def initial(self) -> tuple:
    return (self, 0, 0, None, "")

  def feed(self, stack, ch):
    _, phase, count, esc, raw = stack[-1]
    if phase != 1:
      if phase == 2:
        return _POP
      return _replace(stack, (self, 1, 0, None, "")) if ch == '"' else None
    if esc is None:
      return self._plain(stack, count, raw, ch)
    if esc == "\\":
      if ch in _SHORT_ESCAPES:
        return self._char(stack, count, "")
      return _replace(stack, (self, 1, count, "u", "")) if ch == "u" else None
    digits = esc[1:] + ch
    if ch not in _HEX or not _u_feasible(digits):
      return None
    if len(digits) < 4:
      return _replace(stack, (self, 1, count, "u" + digits, ""))
    return self._char(stack, count, "")

  def _plain(self, stack, count, raw, ch):
    if ch == '"':
      return self._close(stack, count, raw)
    if count >= self.hi:
      return None
    if ch == "\\":
      return None if self.unique else _replace(stack, (self, 1, count, "\\", ""))
    return self._char(stack, count, raw + ch if self.unique else "") if ch in PLAIN else None

  def _char(self, stack, count, raw):
    """One more character; `raw` is the key including it (unique) or ""."""
    if self.unique and count + 1 == self.hi and raw in stack[-2][3]:
      return None  # it would have to close on a key already used
    return _replace(stack, (self, 1, count + 1, None, raw))

  def _close(self, stack, count, raw):
    if count < self.lo:
      return None
    if not self.unique:
      return _replace(stack, (self, 2, count, None, ""))
    parent = stack[-2]
    if raw in parent[3]:
      return None
    return stack[:-2] + (parent[:3] + (parent[3] + (raw,),), (self, 2, count, None, raw))


class ArrNode:
  """[item, item] with lo..hi items. Frame (node, phase, n): 0 expects '[', 1 after '[', 2 after
  an item, 3 after ',', 4 closed, 5 after ', '."""

  first = frozenset("[")

  def __init__(self, item, lo: int, hi: int):
    self.item, self.lo, self.hi = item, lo, hi
    self.max_len = 2 + hi * item.max_len + 2 * max(hi - 1, 0)

  def initial(self) -> tuple:
    return (self, 0, 0)

  def feed(self, stack, ch):
    _, phase, n = stack[-1]
    if phase == 0:
      return _replace(stack, (self, 1, 0)) if ch == "[" else None
    if phase == 1:
      if ch == "]":
        return _replace(stack, (self, 4, 0)) if self.lo == 0 else None
      return _push(stack, (self, 2, 1), self.item, ch) if self.hi > 0 else None
    if phase == 2:
      if ch == ",":
        return _replace(stack, (self, 3, n)) if n < self.hi else None
      return _replace(stack, (self, 4, n)) if ch == "]" and n >= self.lo else None
    if phase == 3:
      return _replace(stack, (self, 5, n)) if ch == " " else None
    if phase == 5:
      return _push(stack, (self, 2, n + 1), self.item, ch)
    return _POP


class ObjNode:
  """A schema object: its properties in order, optional ones may be left out.

  Frame (node, phase, last, key): `last` is the index of the last property written (-1: none
  yet), `key` the key text matched so far. Phases: 0 expects '{', 1 after '{', 2 in a key,
  3 expects ':', 4 expects ' ', 5 after ', ', 6 after a value, 7 after ',', 8 closed.
  """

  first = frozenset("{")

  def __init__(self, props: Sequence[tuple[str, Any, bool]]):
    keys = [json.dumps(name) for name, _, _ in props]
    self.values = [node for _, node, _ in props]
    n = len(props)
    # After property `last`, the next may be any later one up to the first required one;
    # quoted keys are prefix-free, so a full match names one property.
    self.prefixes: dict[int, dict[str, int]] = {}
    self.can_close: dict[int, bool] = {}
    for last in range(-1, n):
      later = list(range(last + 1, n))
      req = [j for j in later if props[j][2]]
      window = later[:later.index(req[0]) + 1] if req else later
      self.can_close[last] = not req
      self.prefixes[last] = {keys[j][:m]: (j if m == len(keys[j]) else -1)
                             for j in window for m in range(1, len(keys[j]) + 1)}
    members = sum(len(k) + 2 + v.max_len for k, v in zip(keys, self.values, strict=True))
    self.max_len = 2 + members + 2 * max(n - 1, 0)

  def initial(self) -> tuple:
    return (self, 0, -1, "")

  def feed(self, stack, ch):
    _, phase, last, key = stack[-1]
    if phase == 0:
      return _replace(stack, (self, 1, -1, "")) if ch == "{" else None
    if phase == 1 and ch == "}":
      return _replace(stack, (self, 8, -1, "")) if self.can_close[-1] else None
    if phase in (1, 2, 5):
      j = self.prefixes[last].get(key + ch)
      if j is None:
        return None
      return _replace(stack, (self, 3, j, "") if j >= 0 else (self, 2, last, key + ch))
    if phase == 3:
      return _replace(stack, (self, 4, last, "")) if ch == ":" else None
    if phase == 4:
      return stack[:-1] + ((self, 6, last, ""), self.values[last].initial()) if ch == " " else None
    if phase == 6:
      if ch == ",":
        return _replace(stack, (self, 7, last, "")) if self.prefixes[last] else None
      return _replace(stack, (self, 8, last, "")) if ch == "}" and self.can_close[last] else None
    if phase == 7:
      return _replace(stack, (self, 5, last, "")) if ch == " " else None
    return _POP


class AnyObjNode:
  """An object with distinct free keys and any values, at most `hi` members.

  Frame (node, phase, n, used): `used` holds the keys written (extended by the key's StrNode).
  Phases as ObjNode: 0 '{', 1 after '{', 3 after a key, 4 expects ' ', 5 after ', ', 6 after a
  value, 7 after ',', 8 closed.
  """

  first = frozenset("{")

  def __init__(self, value, key_chars: int, hi: int):
    self.value, self.hi = value, hi
    self.key = StrNode(0, key_chars, unique=True)
    self.max_len = 2 + hi * (self.key.max_len + 2 + value.max_len) + 2 * max(hi - 1, 0)

  def initial(self) -> tuple:
    return (self, 0, 0, ())

  def feed(self, stack, ch):
    _, phase, n, used = stack[-1]
    if phase == 0:
      return _replace(stack, (self, 1, 0, ())) if ch == "{" else None
    if phase == 1 and ch == "}":
      return _replace(stack, (self, 8, 0, used))
    if phase in (1, 5):
      return _push(stack, (self, 3, n + 1, used), self.key, ch) if n < self.hi else None
    if phase == 3:
      return _replace(stack, (self, 4, n, used)) if ch == ":" else None
    if phase == 4:
      return stack[:-1] + ((self, 6, n, used), self.value.initial()) if ch == " " else None
    if phase == 6:
      if ch == ",":
        return _replace(stack, (self, 7, n, used)) if n < self.hi else None
      return _replace(stack, (self, 8, n, used)) if ch == "}" else None
    if phase == 7:
      return _replace(stack, (self, 5, n, used)) if ch == " " else None
    return _POP


class UnionNode:
  """One of several value kinds, told apart by their first character. Frame (node,)."""

  def __init__(self, branches: Sequence[Any]):
    self.by_char = {c: b for b in branches for c in b.first}
    if len(self.by_char) != sum(len(b.first) for b in branches):
      raise AssertionError("union branches must start with distinct characters")
    self.first = frozenset(self.by_char)
    self.max_len = max(b.max_len for b in branches)

  def initial(self) -> tuple:
    return (self,)

  def feed(self, stack, ch):
    branch = self.by_char.get(ch)
    return None if branch is None else branch.feed(_replace(stack, branch.initial()), ch)


class Root:
  """{"name": NAME, "arguments": ARGS} for one of the tools. Frame (node, phase, text | index)."""

  def __init__(self, tools: Sequence[tuple[str, Any]]):
    heads = ['{"name": ' + json.dumps(name) + ', "arguments": ' for name, _ in tools]
    self.args = [node for _, node in tools]
    self.prefixes = {h[:m]: (j if m == len(h) else -1) for j, h in enumerate(heads)
                     for m in range(1, len(h) + 1)}
    self.max_len = max(len(h) + a.max_len + 1 for h, a in zip(heads, self.args, strict=True))

  def initial(self) -> tuple:
    return (self, 0, "")

  def feed(self, stack, ch):
    _, phase, text = stack[-1]
    if phase == 0:
      j = self.prefixes.get(text + ch)
      if j is None:
        return None
      if j < 0:
        return _replace(stack, (self, 0, text + ch))
      return stack[:-1] + ((self, 1, j), self.args[j].initial())
    if phase == 1:
      return _replace(stack, (self, 2, text)) if ch == "}" else None
    return _POP  # nothing may follow the closing brace

  @staticmethod
  def complete(stack: tuple) -> bool:
    return len(stack) == 1 and stack[0][1] == 2


def string_room(stack: tuple) -> tuple[int, str, tuple | None] | None:
  """If the top frame is inside a string (not in an escape): (characters left, key so far,
  keys already used -- None unless the string is a key that must be unique); else None."""
  node, *state = stack[-1]
  if not isinstance(node, StrNode) or state[0] != 1 or state[2] is not None:
    return None
  return node.hi - state[1], state[3], (stack[-2][3] if node.unique else None)


# ---- validation of parsed values (the same schema subset) ---------------------------
def validate_arguments(schema: Any, value: Any) -> list[str]:
  """Errors of `value` under the schema subset the automaton enforces ([] = valid).

  Checks type (a list of types: any of them), enum/const (JSON equality: 1 == 1.0, true is
  not 1), min/maxLength, min/maxItems, items, properties, required and additionalProperties
  (false or a schema). Keywords the automaton does not enforce (minimum, pattern,
  uniqueItems, anyOf, ...) are not checked either.
  """
  errors: list[str] = []
  _validate(schema, value, "$", errors)
  return errors


def _validate(schema: Any, value: Any, path: str, errors: list[str]) -> None:
  if not isinstance(schema, dict):
    return
  if "enum" in schema and not any(_json_equal(value, v) for v in schema["enum"]):
    errors.append(f"{path}: {value!r} is not one of the enum values {schema['enum']!r}")
  if "const" in schema and not _json_equal(value, schema["const"]):
    errors.append(f"{path}: {value!r} is not the const value {schema['const']!r}")
  types = schema.get("type")
  if types is not None:
    types = [types] if isinstance(types, str) else list(types)
    if not any(_is_type(value, t) for t in types):
      errors.append(f"{path}: expected {' or '.join(map(str, types))}, got {type(value).__name__}")
      return
  if isinstance(value, str):
    _check_count(len(value), schema, "minLength", "maxLength", path, errors)
  elif isinstance(value, list):
    _check_count(len(value), schema, "minItems", "maxItems", path, errors)
    for i, item in enumerate(value):
      _validate(schema.get("items"), item, f"{path}[{i}]", errors)
  elif isinstance(value, dict):
    _validate_object(schema, value, path, errors)


def _validate_object(schema: dict, value: dict, path: str, errors: list[str]) -> None:
  props = schema.get("properties", {})
  for name in schema.get("required", []):
    if name not in value:
      errors.append(f"{path}: missing required property {name!r}")
  extra = schema.get("additionalProperties", True)
  for name, item in value.items():
    if name in props:
      _validate(props[name], item, f"{path}.{name}", errors)
    elif extra is False:
      errors.append(f"{path}: property {name!r} is not allowed (additionalProperties is false)")
    else:
      _validate(extra, item, f"{path}.{name}", errors)


def _check_count(n: int, schema: dict, kmin: str, kmax: str, path: str, errors: list[str]) -> None:
  if n < schema.get(kmin, 0):
    errors.append(f"{path}: {n} < {kmin}={schema[kmin]}")
  if kmax in schema and n > schema[kmax]:
    errors.append(f"{path}: {n} > {kmax}={schema[kmax]}")


def _is_type(value: Any, t: Any) -> bool:
  if t == "integer":
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())
  if t == "number":
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  kinds = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}
  return isinstance(value, kinds[t]) if t in kinds else True  # unknown types: not checked


def _json_equal(a: Any, b: Any) -> bool:
  """Equality of JSON values: numbers by value, booleans apart from numbers."""
  if isinstance(a, bool) or isinstance(b, bool):
    return isinstance(a, bool) and isinstance(b, bool) and a == b
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    return a == b
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(map(_json_equal, a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
  return type(a) is type(b) and a == b
