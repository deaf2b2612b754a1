"""The grammar compiler of constrained tool calls: JSON schemas -> json_automaton nodes.

`compile_tools` turns the tools' parameter schemas into the character-level pushdown
automaton of serving/json_automaton.py, which holds the node kinds, their runtime, and
`validate_arguments` for parsed values under the same schema subset (so what the
constrained decoder can write and what the output parser accepts agree).

Supported schema subset (everything else becomes "any JSON value" of bounded size):
  * object: `properties` in schema order; every `required` one is present, each optional
    one may be left out (the model decides; order is kept); a required name without a
    property schema follows the listed ones with any value; additional properties are
    never written, so an object schema without properties gives `{}`.
  * string: `minLength` / `maxLength` in characters (an escape is one), capped at
    `string_chars` unless minLength needs more; `pattern` / `format` are ignored.
  * integer / number: at most `number_chars` characters, no exponent; a number has at most
    15 digits so its repr round-trips. `minimum`, `maximum`, `multipleOf` are NOT enforced
    (and `validate_arguments` does not check them).
  * boolean, null, `enum` / `const` (their json.dumps texts, filtered by the rest of the
    schema), a list of types (told apart by the first character).
  * array: `items`, `minItems` / `maxItems` capped at `array_items` unless minItems needs
    more; `uniqueItems` is ignored.
  * anything else (anyOf/oneOf/allOf/$ref/not, unknown types, no type and neither
    properties nor items): a string, number, boolean, null, array, or object with distinct
    printable-ASCII keys (no escapes; at most min(array_items, 64) members), containers
    nested at most `depth` deep.
Every bound is finite and every transition keeps a completion within the bounds, so a
valid prefix never dead-ends and every text ends: `Root.max_len` bounds its length.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from serving.json_automaton import (
  SEPARATORS,
  AnyObjNode,
  ArrNode,
  LitNode,
  NumNode,
  ObjNode,
  Root,
  StrNode,
  UnionNode,
  validate_arguments,
)

_MAX_FREE_KEYS = 64  # members of a free-key object: far fewer than the distinct 1-char keys
_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")


@dataclasses.dataclass(frozen=True)
class Bounds:
  """Caps that keep every text finite (see the schema subset above): characters of a string
  without maxLength, items of an array without maxItems, characters of a number, and the
  nesting depth of "any JSON value"."""
  string_chars: int
  array_items: int
  number_chars: int
  depth: int


class _Compiler:
  """JSON schema -> automaton nodes (see the module docstring for the subset)."""

  def __init__(self, bounds: Bounds):
    self.b = bounds
    self._any: dict[int, UnionNode] = {}

  def any(self, depth: int) -> UnionNode:
    if depth not in self._any:
      b = self.b
      branches = [StrNode(0, b.string_chars), NumNode(False, b.number_chars),
                  LitNode(("true", "false", "null"))]
      if depth < b.depth:
        branches += [ArrNode(self.any(depth + 1), 0, b.array_items),
                     AnyObjNode(self.any(depth + 1), b.string_chars, min(b.array_items, _MAX_FREE_KEYS))]
      self._any[depth] = UnionNode(branches)
    return self._any[depth]

  def node(self, schema: Any, depth: int, path: str):
    if not isinstance(schema, dict):
      return self.any(depth)
    if "enum" in schema or "const" in schema:
      return self._literals(schema, path)
    types = schema.get("type")
    if types is None:
      types = "object" if "properties" in schema else "array" if "items" in schema else None
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    known = [t for t in dict.fromkeys(types) if t in _TYPES and not (t == "integer" and "number" in types)]
    if not known:
      return self.any(depth)
    nodes = [self._typed(t, schema, depth, path) for t in known]
    return nodes[0] if len(nodes) == 1 else UnionNode(nodes)

  def _typed(self, t: str, schema: dict, depth: int, path: str):
    if t == "string":
      return StrNode(*self._range(schema, "minLength", "maxLength", self.b.string_chars, path))
    if t in ("integer", "number"):
      return NumNode(t == "integer", self.b.number_chars)
    if t in ("boolean", "null"):
      return LitNode(("true", "false") if t == "boolean" else ("null",))
    if t == "array":
      lo, hi = self._range(schema, "minItems", "maxItems", self.b.array_items, path)
      return ArrNode(self.node(schema.get("items"), depth + 1, path + ".items"), lo, hi)
    return self.object(schema, depth, path)

  def object(self, schema: dict, depth: int, path: str) -> ObjNode:
    props = schema.get("properties", {})
    required = schema.get("required", [])
    if not isinstance(props, dict):
      raise ValueError(f"{path}.properties must be an object of property schemas, got {props!r}.")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
      raise ValueError(f"{path}.required must be a list of property names, got {required!r}.")
    entries = [(name, self.node(sub, depth + 1, f"{path}.properties.{name}"), name in required)
               for name, sub in props.items()]
    entries += [(name, self.any(depth + 1), True) for name in dict.fromkeys(required) if name not in props]
    return ObjNode(entries)

  @staticmethod
  def _range(schema: dict, kmin: str, kmax: str, bound: int, path: str) -> tuple[int, int]:
    lo, hi = schema.get(kmin, 0), schema.get(kmax)
    for k, v in ((kmin, lo), (kmax, hi)):
      if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise ValueError(f"{path}.{k}={v!r} must be a non-negative integer.")
    if hi is not None and hi < lo:
      raise ValueError(f"{path}: {kmin}={lo} > {kmax}={hi}, so no value satisfies the schema.")
    return lo, max(lo, bound if hi is None else min(hi, bound))

  @staticmethod
  def _literals(schema: dict, path: str) -> LitNode:
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(values, list):
      raise ValueError(f"{path}.enum must be a list of values, got {values!r}.")
    rest = {k: v for k, v in schema.items() if k not in ("enum", "const")}
    try:
      texts = dict.fromkeys(json.dumps(v, separators=SEPARATORS, allow_nan=False)
                            for v in values if not validate_arguments(rest, v))
    except (TypeError, ValueError) as e:
      raise ValueError(f"{path}: enum/const values must be JSON values: {e}") from None
    if not texts:
      raise ValueError(f"{path}: no enum/const value satisfies the rest of the schema.")
    return LitNode(tuple(texts))


def compile_tools(tools: Sequence[tuple[int, str, Any]], bounds: Bounds) -> Root:
  """The automaton of a call to one of `tools` ([(index in the request, name, parameters)])."""
  compiler = _Compiler(bounds)
  nodes = []
  for i, name, params in tools:
    path = f"tools[{i}].parameters"
    if not isinstance(params, dict) or params.get("type", "object") != "object":
      raise ValueError(f"{path} must be an object schema ({{'type': 'object', 'properties': ...}}), "
                       f"got {params!r}.")
    nodes.append((name, compiler.object(params, 0, path)))
  return Root(nodes)
