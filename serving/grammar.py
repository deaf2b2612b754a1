"""JSON-schema grammars on llguidance: compile once, one matcher per request, bool token masks.

Grammar-constrained decoding (Willard & Louf, 2023, "Efficient Guided Generation for Large
Language Models"; Geng et al., 2023, "Grammar-Constrained Decoding for Structured NLP Tasks
without Finetuning"): before each token, every vocabulary token whose bytes cannot extend the
output towards a document in the grammar's language is masked out. The engine here is
llguidance (Microsoft; the one vLLM, SGLang and llama.cpp use), which compiles JSON Schema
(Draft 2020-12: `pattern`, `format`, `minimum`/`maximum`, `anyOf`/`oneOf`/`allOf`, `$ref`/
`$defs`, `enum`/`const`, `prefixItems`, ...) into a lexer + Earley parser and computes a mask
over the whole vocabulary in microseconds (a token trie walked with the lexer's derivative
automaton). What it does not implement (`uniqueItems`, `not`, `if`/`then`, `contains`,
`dependentRequired`, unknown `format`s) is an error naming the keyword, never silently ignored.

Choices made here:
  * Canonical separators, no free whitespace: `{"a": 1, "b": [1, 2]}` -- the form the chat
    renderer writes tool calls back into history (serving.chat.tool_call_json); `\\uXXXX`
    escapes are allowed so json.dumps' ASCII text is in the language too.
  * `closed` schemas (tool arguments, response_format json_schema) get xgrammar's
    "strict mode": an object schema that does not say `additionalProperties` gets
    `false`, so the model writes the declared properties only. Without it a constrained
    model may invent keys that no tool reads. `json_object` (any object) is not closed.
  * Property order is the schema's (llguidance fixes it), so a call renders the same way
    every time.
  * The tokenizer bridge reads the byte-level BPE behind `training.tokenizer.Tokenizer` (HF
    tokenizer.json or tiktoken ranks) and is built once per tokenizer fingerprint; its EOS
    is <|end_of_turn|>: a matcher in an accepting state allows it.

`validate_arguments` checks a parsed value against the same schemas (jsonschema, Draft
2020-12, formats checked): the output parser and RL environments use it on calls the model
made without a mask.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jsonschema
import llguidance
import numpy as np
import referencing.exceptions

from training.tokenizer import Tokenizer

__all__ = ["Grammar", "JsonMatcher", "SchemaError", "check_schema", "compile_schema", "validate_arguments"]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "json_allow_general_unicode_escapes": True}
# Subschema keywords walked by `close_objects`: a schema, a list of schemas, a map of schemas.
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


class SchemaError(ValueError):
  """A schema llguidance cannot compile; the message starts with the request field."""

  def __init__(self, field: str, why: str):
    super().__init__(f"{field}: {why}")
    self.field = field


_OPENERS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})


def _is_object(schema: dict) -> bool:
  types = schema.get("type")
  return "object" in (types if isinstance(types, list) else [types]) or "properties" in schema


def _names(schema: Any) -> list[str] | None:
  """The property names an `allOf` branch declares (properties, required, its own allOf's): the
  names the closed parent admits for it. None when the branch leaves other names open."""
  if not isinstance(schema, dict):  # `true` / `false`: no names of its own
    return []
  if _OPENERS & schema.keys():
    return None
  props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
  required = schema.get("required") if isinstance(schema.get("required"), list) else []
  names = [*props, *(r for r in required if isinstance(r, str))]
  for branch in schema.get("allOf") if isinstance(schema.get("allOf"), list) else []:
    inner = _names(branch)
    if inner is None:
      return None
    names += inner
  return names


def close_objects(schema: Any, *, closed: bool = True) -> Any:
  """A copy of `schema` where every object schema without additionalProperties /
  patternProperties / unevaluatedProperties gets `additionalProperties: false` (its required
  names without a property schema become properties of any value).

  The branches of an `allOf` describe one object together, so they are not closed one by one
  (each would refuse the others' properties): the schema holding the `allOf` is closed instead,
  admitting the names its branches declare (`closed=False`: this level is such a branch)."""
  if isinstance(schema, list):
    return [close_objects(s) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = dict(schema)
  for key in _ONE + _LIST:
    if key in out:
      out[key] = close_objects(out[key])
  for key in _MAP:
    if isinstance(out.get(key), dict):
      out[key] = {k: close_objects(v) for k, v in out[key].items()}
  branches = schema.get("allOf") if isinstance(schema.get("allOf"), list) else []
  if branches:
    out["allOf"] = [close_objects(s, closed=False) for s in branches]
  merged = [_names(s) for s in branches]
  if None in merged or not closed or _OPENERS & out.keys():
    return out
  merged = [n for names in merged for n in names]
  if _is_object(out) or merged:
    out["additionalProperties"] = False
    # A required name without a property schema stays allowed, with any value.
    required = out.get("required") if isinstance(out.get("required"), list) else []
    props = out.get("properties") if isinstance(out.get("properties"), dict) else {}
    missing = {r: {} for r in [*required, *merged] if isinstance(r, str) and r not in props}
    if missing:
      out["properties"] = {**props, **missing}
  return out


def _grammar_text(schema: Any, field: str, closed: bool) -> str:
  if not isinstance(schema, dict):
    raise SchemaError(field, f"a JSON schema must be an object, got {type(schema).__name__}.")
  try:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema) if closed else schema,
                                                           defaults=JSON_OPTIONS)
  except (TypeError, ValueError) as e:
    raise SchemaError(field, f"not a usable JSON schema ({e}).") from None
  error = llguidance.LLMatcher.validate_grammar(grammar)
  if error:
    raise SchemaError(field, f"unsupported or invalid JSON schema: {error.strip()}")
  return grammar


@functools.lru_cache(maxsize=256)
def _checked(text: str, field: str, closed: bool) -> str:
  return _grammar_text(json.loads(text), field, closed)


def _key(schema: Any, field: str) -> str:
  try:
    return json.dumps(schema, sort_keys=False, allow_nan=False)
  except (TypeError, ValueError) as e:
    raise SchemaError(field, f"a JSON schema must be JSON ({e}).") from None


def check_schema(schema: Any, field: str, *, closed: bool = True) -> None:
  """Raises SchemaError (naming `field`) unless `schema` compiles; cached by schema text."""
  _checked(_key(schema, field), field, closed)


class _TokKey:
  """Hashes a tokenizer by its file fingerprint: reloading the same file reuses the bridge."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer

  def __hash__(self) -> int:
    return hash(self.tokenizer.fingerprint)

  def __eq__(self, other) -> bool:
    return isinstance(other, _TokKey) and other.tokenizer.fingerprint == self.tokenizer.fingerprint


@functools.lru_cache(maxsize=8)
def _lltokenizer(key: _TokKey) -> llguidance.LLTokenizer:
  tok = key.tokenizer
  eot = tok.special_id("end_of_turn")
  # training.tokenizer exposes no per-token bytes; its backends hold the HF / tiktoken objects.
  backend = tok._backend  # noqa: SLF001
  if tok.kind == "tiktoken":
    from llguidance.tiktoken import lltokenizer_from_encoding
    return lltokenizer_from_encoding(backend._enc, n_vocab=tok.vocab_size, eos_token=eot)  # noqa: SLF001
  return llguidance.LLTokenizer(backend._plain.to_str(), n_vocab=tok.vocab_size, eos_token=eot)  # noqa: SLF001


def lltokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
  """llguidance's view of `tokenizer` (EOS = <|end_of_turn|>), built once per fingerprint."""
  return _lltokenizer(_TokKey(tokenizer))


@dataclasses.dataclass(frozen=True)
class Grammar:
  """A compiled JSON-schema grammar bound to a tokenizer."""
  text: str
  tokenizer: Tokenizer


def compile_schema(tokenizer: Tokenizer, schema: Any, field: str, *, closed: bool = True) -> Grammar:
  """The grammar of the JSON documents valid under `schema` (closed: see the module docstring)."""
  return Grammar(_checked(_key(schema, field), field, closed), tokenizer)


class JsonMatcher:
  """One document being generated under a Grammar: masks, consumed tokens, completion.

  The mask allows <|end_of_turn|> exactly when the text so far is a complete document.
  """

  def __init__(self, grammar: Grammar):
    self._tok = grammar.tokenizer
    self._m = llguidance.LLMatcher(lltokenizer(self._tok), grammar.text, log_level=0)
    if self._m.is_error():
      raise RuntimeError(f"llguidance matcher failed to start: {self._m.get_error()}")
    self._bits = np.zeros((self._tok.vocab_size + 31) // 32, np.int32)
    self.ids: list[int] = []

  def mask(self) -> np.ndarray:
    """[V] bool: the tokens that keep the text a prefix of a valid document."""
    self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
    if self._m.is_error():
      raise RuntimeError(f"llguidance: {self._m.get_error()}")
    bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
    return bits[:self._tok.vocab_size].view(bool)

  def allows(self, token_id: int) -> bool:
    return 0 <= token_id < self._tok.vocab_size and self._m.validate_tokens([token_id]) == 1

  def consume(self, token_id: int) -> None:
    """Advances by one token; ValueError (state unchanged) if the grammar does not allow it."""
    if not self.allows(token_id) or not self._m.consume_token(token_id):
      raise ValueError(f"token {token_id} ({self._tok.decode([token_id])!r}) cannot continue "
                       f"{self.text!r} under the schema.")
    self.ids.append(token_id)

  @property
  def text(self) -> str:
    return self._tok.decode(self.ids)

  @property
  def complete(self) -> bool:
    """The document is complete and nothing but <|end_of_turn|> may follow."""
    return self._m.is_stopped() and not self._m.is_error()

  @property
  def accepting(self) -> bool:
    """The text so far is a complete document (it may still grow, e.g. a number)."""
    return self._m.is_accepting()

  def reset(self) -> None:
    self._m.reset()
    self.ids = []


# ---- validation of parsed values -------------------------------------------------------
def _path(parts) -> str:
  return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def validate_arguments(schema: Any, value: Any) -> list[str]:
  """The errors of `value` under JSON schema `schema` ([] = valid), each "PATH: why".

  Draft 2020-12 with formats checked (jsonschema). An invalid schema is one error.
  """
  if not isinstance(schema, dict):
    return [] if schema is not False else ["$: the schema `false` accepts nothing"]
  try:
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{_path(e.absolute_path)}: {e.message}" for e in errors]
  except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.UnknownType,
          referencing.exceptions.Unresolvable) as e:
    return [f"$: the schema is invalid ({str(e).splitlines()[0]})"]
