"""Anthropic Messages API request -> Horizon's chat types (serving/types.py).

Parses and validates the JSON body of `POST /v1/messages` and
`/v1/messages/count_tokens` (https://docs.anthropic.com/en/api/messages) by
hand, so every error is a 400 `invalid_request_error` whose message names the
field the way Anthropic's API does (`"max_tokens: Field required"`,
`"messages.1.content.0: Invalid `signature` in `thinking` block"`): agent
middleware written against Anthropic reads them unchanged.

Translation (why each choice):
  * `system` (string or text blocks) -> one system Message (blocks joined by a
    blank line).
  * Consecutive turns of one role are merged into one turn (Anthropic does).
  * user `tool_result` blocks -> one `tool` Message each (content string or
    text blocks; `is_error` prefixes "Error: " since the chat format has no
    error flag); they must come first in their turn and answer the previous
    assistant turn's `tool_use` ids, as on Anthropic. Images inside a tool
    result are moved into a user message right after the results (the tool
    turn of the chat format holds JSON text only).
  * assistant `thinking` blocks must carry a valid HMAC signature
    (serving/signing.py) and `redacted_thinking` blocks our authenticated
    payload; both are rendered back to the model (history retention). Several
    thinking blocks of one turn are joined by a blank line.
  * Any `model` name is accepted (a client written for Anthropic must work by
    changing only the base URL); responses name the model that answered.
  * Anthropic requires budget_tokens >= 1024; not enforced here because the
    CPU variants think for tens of tokens (configs/serve.py).
  * `tool_choice` any/tool together with thinking is accepted (Anthropic
    rejects it): the constraint starts once thinking has ended.
  * `disable_parallel_tool_use` is accepted; any/tool always yield exactly one
    call, auto may yield several.
  * Thinking: `{type: enabled, budget_tokens: N}` -> budget N (< max_tokens,
    which counts thinking too); `{type: adaptive}` -> the budget of the effort
    tier; `{type: disabled}` -> off; absent -> config.serving.default_effort.
    `output_config.effort` low/medium/high/xhigh/max -> tier low/high/high/
    max/max (the tier line of the prompt). `display: omitted` is honoured
    (serving/signing.py); `between_tools` is refused (no such mode here).
  * A final assistant message is a prefill: the answer continues its text
    (`ChatRenderer.render(continue_final=True)`), and the response holds only
    the continuation, as Anthropic's does. It must be text only, must not end
    in whitespace, and cannot be combined with thinking (400s like Anthropic's).
    An empty final assistant message is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from serving import signing
from serving.api_common import EFFORT_TIERS, ThinkingSettings, effort_thinking, resolve_tool_choice
from serving.types import (
  EFFORTS,
  ImagePart,
  Message,
  Part,
  SamplingParams,
  TextPart,
  Tool,
  ToolCall,
  ToolChoice,
)

_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
_TOOL_ID = re.compile(r"^[a-zA-Z0-9_-]+$")
_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
THINKING_DOCS = "https://docs.claude.com/en/docs/build-with-claude/extended-thinking"

# Decodes base64 image data into the model's input, float32 [H, W, C] in [0, 1]; ValueError when
# it cannot (serving.images.decode_image with the model's image size).
ImageDecoder = Callable[[str], np.ndarray]


class InvalidRequest(Exception):
  """A request the API rejects: HTTP `status` with an Anthropic error of `error_type`."""

  def __init__(self, message: str, status: int = 400, error_type: str = "invalid_request_error"):
    super().__init__(message)
    self.message, self.status, self.error_type = message, status, error_type


@dataclasses.dataclass
class ParsedRequest:
  """Everything `start_generation` needs, plus the Anthropic-only switches."""
  model: str
  messages: list[Message]
  tools: list[Tool]
  tool_choice: ToolChoice
  thinking: bool
  thinking_budget: int | None
  effort: str | None
  params: SamplingParams
  stop: list[str]
  stream: bool
  # How thinking is returned: "summarized" (text + HMAC signature), "omitted" (empty text, the
  # sealed thinking as signature: thinking.display "omitted") or "redacted" (redacted_thinking
  # blocks: Anthropic's test trigger was sent; serving/signing.py).
  thinking_display: str
  # The last message is an assistant prefill the answer continues (not a new turn).
  prefill: bool = False


def _fail(path: str, message: str) -> None:
  raise InvalidRequest(f"{path}: {message}" if path else message)


def _join(path: str, key: str | int) -> str:
  return f"{path}.{key}" if path else str(key)


def _field(obj: dict, key: str, path: str, kind: type | tuple[type, ...], *, required: bool = False,
           default: Any = None) -> Any:
  """obj[key] checked against `kind` (bool is never an int here); `default` when absent or null."""
  where = _join(path, key)
  if obj.get(key) is None:
    if required:
      _fail(where, "Field required")
    return default
  value = obj[key]
  kinds = kind if isinstance(kind, tuple) else (kind,)
  if isinstance(value, bool) and bool not in kinds:
    _fail(where, f"Input should be a valid {_kind_name(kinds)}")
  if float in kinds and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if not isinstance(value, kinds):
    _fail(where, f"Input should be a valid {_kind_name(kinds)}")
  return value


def _kind_name(kinds: tuple[type, ...]) -> str:
  names = {str: "string", int: "integer", float: "number", bool: "boolean", list: "list", dict: "dictionary"}
  return " or ".join(names.get(k, k.__name__) for k in kinds)


# ---- content blocks ----------------------------------------------------------
def _blocks(content: Any, path: str) -> list[dict]:
  """A message's content as a list of block dicts (a string is one text block)."""
  if isinstance(content, str):
    return [{"type": "text", "text": content}]
  if not isinstance(content, list):
    _fail(path, "Input should be a valid string or a list of content blocks")
  for j, block in enumerate(content):
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
      _fail(_join(path, j), "Input should be a content block object with a `type`")
  return content


def _text(block: dict, path: str) -> str:
  text = _field(block, "text", path, str, required=True)
  if not text:
    _fail(_join(path, "text"), "text content blocks must be non-empty")
  return text


def _image(block: dict, path: str, decode: ImageDecoder) -> ImagePart:
  source = _field(block, "source", path, dict, required=True)
  where = _join(path, "source")
  kind = source.get("type")
  if kind in ("url", "file"):
    _fail(_join(where, "type"), f"image source type '{kind}' is not supported: this server has no "
          "network or Files API access. Send the image inline as {\"type\": \"base64\", \"media_type\": "
          "\"image/png\", \"data\": ...}.")
  if kind != "base64":
    _fail(_join(where, "type"), "Input should be 'base64'")
  media = _field(source, "media_type", where, str, required=True)
  if media not in _MEDIA_TYPES:
    _fail(_join(where, "media_type"), f"Input should be {', '.join(repr(m) for m in _MEDIA_TYPES)}")
  data = _field(source, "data", where, str, required=True)
  try:
    pixels = decode(data)
  except ValueError as e:  # serving.images names the problem (bad base64, undecodable, too large)
    _fail(_join(where, "data"), str(e))
  return ImagePart(pixels=pixels)


def _tool_result(block: dict, path: str, decode: ImageDecoder) -> tuple[str, str, list[ImagePart]]:
  """(tool_use_id, text, images) of a tool_result block."""
  call_id = _field(block, "tool_use_id", path, str, required=True)
  content = block.get("content")
  texts, images = [], []
  if content is not None:
    for j, sub in enumerate(_blocks(content, _join(path, "content"))):
      where = _join(_join(path, "content"), j)
      if sub["type"] == "text":
        texts.append(_field(sub, "text", where, str, required=True))
      elif sub["type"] == "image":
        images.append(_image(sub, where, decode))
      else:
        _fail(_join(where, "type"), f"'{sub['type']}' blocks are not supported inside tool_result "
              "(use text or image)")
  text = "\n\n".join(texts)
  if _field(block, "is_error", path, bool, default=False):
    text = "Error: " + text
  return call_id, text, images


def _thinking_block(block: dict, path: str, key: bytes) -> str:
  """The thinking text of a returned thinking / redacted_thinking block, authenticated."""
  if block["type"] == "thinking":
    text = _field(block, "thinking", path, str, default=None)
    if text is None:
      _fail(_join(path, "thinking"), "Field required")
    signature = _field(block, "signature", path, str, required=True)
    if signing.verify_thinking(key, text, signature):
      return text
    sealed = signing.unseal_thinking(key, signature) if text == "" else None
    if sealed is None:  # neither our signature of this text nor an omitted-display seal
      _fail(path, "Invalid `signature` in `thinking` block")
    return sealed
  data = _field(block, "data", path, str, required=True)
  text = signing.unseal_thinking(key, data)
  if text is None:
    _fail(path, "Invalid `data` in `redacted_thinking` block")
  return text


# ---- turns -------------------------------------------------------------------
@dataclasses.dataclass
class _Turn:
  role: str
  blocks: list[tuple[str, dict]]  # (error path, block)


def _turns(raw: Any) -> list[_Turn]:
  """Validated roles and blocks; consecutive turns of one role merged."""
  if not isinstance(raw, list):
    _fail("messages", "Input should be a valid list")
  if not raw:
    _fail("messages", "List should have at least 1 item after validation, not 0")
  turns: list[_Turn] = []
  for i, msg in enumerate(raw):
    path = f"messages.{i}"
    if not isinstance(msg, dict):
      _fail(path, "Input should be a valid dictionary")
    role = msg.get("role")
    if role not in ("user", "assistant"):
      _fail(_join(path, "role"), "Input should be 'user' or 'assistant'")
    if "content" not in msg:
      _fail(_join(path, "content"), "Field required")
    blocks = [(_join(_join(path, "content"), j), b)
              for j, b in enumerate(_blocks(msg["content"], _join(path, "content")))]
    if role == "assistant" and i == len(raw) - 1 and all(
        b.get("type") == "text" and not b.get("text") for _, b in blocks):
      continue  # an empty final assistant message: nothing to prefill
    if not blocks:
      _fail(path, "all messages must have non-empty content except for the optional final assistant "
            "message")
    if turns and turns[-1].role == role:
      turns[-1].blocks.extend(blocks)
    else:
      turns.append(_Turn(role, blocks))
  return turns


def _user_turn(turn: _Turn, pending: dict[str, str], decode: ImageDecoder) -> list[Message]:
  """Tool messages for the leading tool_result blocks, then one user message."""
  out: list[Message] = []
  parts: list[Part] = []
  moved_images: list[ImagePart] = []
  answered = set()
  for path, block in turn.blocks:
    kind = block["type"]
    if kind == "tool_result":
      if parts:
        _fail(path, "tool_result blocks must come first in a user message, before any text or image")
      call_id, text, images = _tool_result(block, path, decode)
      if call_id not in pending:
        _fail(path, f"unexpected `tool_use_id` found in `tool_result` blocks: {call_id}. Each "
              "`tool_result` block must have a corresponding `tool_use` block in the previous message.")
      answered.add(call_id)
      out.append(Message(role="tool", content=[TextPart(text)], tool_call_id=call_id, name=pending[call_id]))
      moved_images.extend(images)
    elif kind == "text":
      parts.append(TextPart(_text(block, path)))
    elif kind == "image":
      parts.append(_image(block, path, decode))
    elif kind in ("thinking", "redacted_thinking", "tool_use"):
      _fail(_join(path, "type"), f"`{kind}` blocks are only allowed in assistant messages")
    else:
      _fail(_join(path, "type"), f"content blocks of type '{kind}' are not supported by this server")
  missing = [c for c in pending if c not in answered]
  if missing:
    _fail(turn.blocks[0][0].rsplit(".content", 1)[0],
          f"`tool_use` ids were found without `tool_result` blocks immediately after: {', '.join(missing)}. "
          "Each `tool_use` block must have a corresponding `tool_result` block in the next message.")
  if moved_images or parts:
    out.append(Message(role="user", content=list(moved_images) + parts))
  return out


def _assistant_turn(turn: _Turn, key: bytes) -> tuple[Message, dict[str, str]]:
  """The assistant message and its {tool_use id: tool name}."""
  thinking: list[str] = []
  parts: list[Part] = []
  calls: list[ToolCall] = []
  for path, block in turn.blocks:
    kind = block["type"]
    if kind in ("thinking", "redacted_thinking"):
      thinking.append(_thinking_block(block, path, key))
    elif kind == "text":
      parts.append(TextPart(_field(block, "text", path, str, required=True)))
    elif kind == "tool_use":
      call_id = _field(block, "id", path, str, required=True)
      if not _TOOL_ID.match(call_id):
        _fail(_join(path, "id"), "String should match pattern '^[a-zA-Z0-9_-]+$'")
      name = _field(block, "name", path, str, required=True)
      args = _field(block, "input", path, dict, required=True)
      calls.append(ToolCall(id=call_id, name=name, arguments=json.dumps(args, ensure_ascii=False)))
    elif kind == "image":
      _fail(_join(path, "type"), "image blocks are only allowed in user messages")
    else:
      _fail(_join(path, "type"), f"content blocks of type '{kind}' are not supported by this server")
  message = Message(role="assistant", content=parts, tool_calls=calls,
                    thinking="\n\n".join(thinking) if thinking else None)
  return message, {c.id: c.name for c in calls}


def _check_final_thinking(turns: list[_Turn]) -> None:
  """With thinking on, the last assistant turn that calls tools must start with its thinking."""
  last = next((t for t in reversed(turns) if t.role == "assistant"), None)
  if last is None or not any(b["type"] == "tool_use" for _, b in last.blocks):
    return
  path, first = last.blocks[0]
  if first["type"] not in ("thinking", "redacted_thinking"):
    _fail(_join(path, "type"), f"Expected `thinking` or `redacted_thinking`, but found `{first['type']}`. "
          "When `thinking` is enabled, a final `assistant` message must start with a thinking block "
          "(preceding the lastmost set of `tool_use` and `tool_result` blocks). We recommend you include "
          "thinking blocks from previous turns. To avoid this requirement, disable `thinking`. Please "
          f"consult our documentation at {THINKING_DOCS}")


def _check_prefill(turn: _Turn, path: str, thinking: bool) -> None:
  """A final assistant message continues as text: text blocks only, no trailing whitespace."""
  if thinking:
    _fail(path, "a final `assistant` message (prefill) cannot be used with `thinking` enabled: the "
          "answer would continue without its thinking. Disable `thinking` or end with a user message")
  for block_path, block in turn.blocks:
    if block.get("type") != "text":
      _fail(_join(block_path, "type"), "a final `assistant` message (prefill) may only hold `text` "
            f"blocks, not '{block.get('type')}'")
  last = turn.blocks[-1][1].get("text")
  if isinstance(last, str) and last != last.rstrip():
    _fail(path, "final assistant content cannot end with trailing whitespace")


def convert_messages(raw: Any, *, key: bytes, decode_image: ImageDecoder,
                     thinking: bool) -> tuple[list[Message], bool]:
  """(messages, redacted-thinking trigger present) for a request's `messages`.

  A final assistant message (a prefill) is kept as the last message; see
  `ParsedRequest.prefill`.
  """
  turns = _turns(raw)
  if not turns:
    _fail("messages", "at least one message must have non-empty content")
  prefill = turns[-1].role == "assistant"
  if prefill:
    _check_prefill(turns[-1], f"messages.{len(raw) - 1}", thinking)
  elif thinking:
    _check_final_thinking(turns)
  out: list[Message] = []
  pending: dict[str, str] = {}
  for turn in turns:
    if turn.role == "user":
      out.extend(_user_turn(turn, pending, decode_image))
      pending = {}
    else:
      message, pending = _assistant_turn(turn, key)
      out.append(message)
  trigger = any(isinstance(p, TextPart) and signing.REDACTED_THINKING_TRIGGER in p.text
                for m in out if m.role == "user" for p in m.content)
  return out, trigger


def convert_system(raw: Any) -> Message | None:
  if raw is None:
    return None
  if isinstance(raw, str):
    return Message(role="system", content=[TextPart(raw)]) if raw else None
  if not isinstance(raw, list):
    _fail("system", "Input should be a valid string or a list of text blocks")
  texts = []
  for j, block in enumerate(raw):
    path = f"system.{j}"
    if not isinstance(block, dict) or block.get("type") != "text":
      _fail(_join(path, "type"), "Input should be 'text'")
    texts.append(_text(block, path))
  return Message(role="system", content=[TextPart("\n\n".join(texts))]) if texts else None


# ---- tools, thinking, sampling -------------------------------------------------
def convert_tools(raw: Any, max_tools: int) -> list[Tool]:
  if raw is None:
    return []
  if not isinstance(raw, list):
    _fail("tools", "Input should be a valid list")
  if len(raw) > max_tools:
    _fail("tools", f"at most {max_tools} tools per request (config.serving.max_tools), got {len(raw)}")
  tools = []
  for i, spec in enumerate(raw):
    path = f"tools.{i}"
    if not isinstance(spec, dict):
      _fail(path, "Input should be a valid dictionary")
    kind = spec.get("type", "custom")
    if kind not in ("custom", None):
      _fail(_join(path, "type"), f"server tool '{kind}' is not supported by this server; only custom "
            "tools (name, description, input_schema) are")
    name = _field(spec, "name", path, str, required=True)
    if not _TOOL_NAME.match(name):
      _fail(_join(path, "name"), "String should match pattern '^[a-zA-Z0-9_-]{1,128}$'")
    schema = _field(spec, "input_schema", path, dict, required=True)
    if schema.get("type") != "object":
      _fail(_join(_join(path, "input_schema"), "type"), "Input should be 'object'")
    tools.append(Tool(name=name, description=_field(spec, "description", path, str, default=""),
                      parameters=schema))
  if len({t.name for t in tools}) != len(tools):
    _fail("tools", "Tool names must be unique.")
  return tools


_TOOL_CHOICE_MODES = {"none": "none", "auto": "auto", "any": "required", "tool": "named"}


def convert_tool_choice(raw: Any, tools: list[Tool]) -> ToolChoice:
  if raw is None:
    return resolve_tool_choice(None, tools)
  if not isinstance(raw, dict):
    _fail("tool_choice", "Input should be a valid dictionary")
  kind = raw.get("type")
  _field(raw, "disable_parallel_tool_use", "tool_choice", bool)
  if kind not in _TOOL_CHOICE_MODES:
    _fail("tool_choice.type", "Input should be 'auto', 'any', 'tool' or 'none'")
  name = _field(raw, "name", "tool_choice", str, required=True) if kind == "tool" and tools else None
  try:
    return resolve_tool_choice(_TOOL_CHOICE_MODES[kind], tools, name)
  except ValueError as e:
    _fail("tool_choice.name" if name is not None else "tool_choice", str(e))


def _tier_for_budget(budget: int, serving: Any) -> str:
  """The prompt's effort line for an explicit budget: the smallest tier that covers it."""
  return next((t for t in EFFORTS if int(serving.thinking_budgets[t]) >= budget), EFFORTS[-1])


def _effort(body: dict) -> str | None:
  """output_config.effort: an effort name with a thinking tier (not none/minimal), or None."""
  output_config = _field(body, "output_config", "", dict, default={})
  effort = _field(output_config, "effort", "output_config", str)
  if effort is not None and EFFORT_TIERS.get(effort) is None:
    _fail("output_config.effort", "Input should be 'low', 'medium', 'high', 'xhigh' or 'max'")
  return effort


def _display(thinking: dict) -> str:
  display = _field(thinking, "display", "thinking", str, default="summarized")
  if display not in ("summarized", "omitted"):
    _fail("thinking.display", "Input should be 'summarized' or 'omitted'")
  return display


def convert_thinking(body: dict, serving: Any, max_tokens: int | None) -> ThinkingSettings:
  """Thinking settings from `thinking`, `output_config.effort` and the config default.

  enabled: budget = budget_tokens (< max_tokens); the tier line is the effort
  or the smallest tier whose budget covers it. adaptive: the effort's tier
  (default high) and its configured budget. Absent: config.serving.default_effort.
  """
  effort = _effort(body)
  thinking = _field(body, "thinking", "", dict)
  if thinking is None:  # the server default (configs/serve.py default_effort) turns thinking on or off
    default = effort_thinking(None, serving)
    return effort_thinking(effort, serving) if default.on and effort else default
  kind = thinking.get("type")
  if kind == "disabled":
    return ThinkingSettings(False)
  if kind == "adaptive":
    return dataclasses.replace(effort_thinking(effort or "high", serving), display=_display(thinking))
  if kind == "between_tools":
    _fail("thinking.type", "'between_tools' is not supported by this server; use 'enabled' "
          "(with budget_tokens), 'adaptive' or 'disabled'")
  if kind != "enabled":
    _fail("thinking.type", "Input should be 'enabled', 'disabled' or 'adaptive'")
  budget = _field(thinking, "budget_tokens", "thinking.enabled", int, required=True)
  if budget < 1:
    _fail("thinking.enabled.budget_tokens", "Input should be greater than or equal to 1")
  if max_tokens is not None and budget >= max_tokens:
    _fail("", "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our "
          f"documentation at {THINKING_DOCS}#max-tokens-and-context-window-size")
  tier = EFFORT_TIERS[effort] if effort else _tier_for_budget(budget, serving)
  return ThinkingSettings(True, budget, tier, _display(thinking))


def _sampling(body: dict, max_tokens: int) -> SamplingParams:
  temperature = _field(body, "temperature", "", float, default=1.0)
  if not 0.0 <= temperature <= 1.0:
    _fail("temperature", "Input should be between 0 and 1")
  top_p = _field(body, "top_p", "", float, default=1.0)
  if not 0.0 < top_p <= 1.0:
    _fail("top_p", "Input should be greater than 0 and at most 1")
  top_k = _field(body, "top_k", "", int, default=0)
  if top_k < 0:
    _fail("top_k", "Input should be greater than or equal to 0")
  return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)


def _stop_sequences(body: dict) -> list[str]:
  stop = _field(body, "stop_sequences", "", list, default=[])
  for i, s in enumerate(stop):
    if not isinstance(s, str) or not s.strip():
      _fail(f"stop_sequences.{i}", "each stop sequence must be a string with non-whitespace characters")
  return list(stop)


def parse_request(body: Any, *, serving: Any, key: bytes, decode_image: ImageDecoder,
                  count_only: bool = False) -> ParsedRequest:
  """Validates and translates a Messages request (count_only: the count_tokens body, no max_tokens).

  Args:
    body: the decoded JSON body.
    serving: `config.serving` (thinking_budgets, default_effort, max_tools, max_images).
    key: the thinking-signature key (serving.signing.signing_key).
    decode_image: raw image bytes -> float32 [H, W, C] in [0, 1].
    count_only: parse a /v1/messages/count_tokens body.
  Raises:
    InvalidRequest: naming the offending field.
    APIError: 500, config.serving.default_effort is not an effort name.
  """
  if not isinstance(body, dict):
    _fail("", "the request body must be a JSON object")
  model = _field(body, "model", "", str, required=True)
  max_tokens = None
  if not count_only:
    max_tokens = _field(body, "max_tokens", "", int, required=True)
    if max_tokens < 1:
      _fail("max_tokens", "Input should be greater than or equal to 1")
  thinking = convert_thinking(body, serving, max_tokens)
  messages, trigger = convert_messages(body.get("messages"), key=key, decode_image=decode_image,
                                       thinking=thinking.on)
  n_images = sum(isinstance(p, ImagePart) for m in messages for p in m.content)
  if n_images > serving.max_images:
    _fail("messages", f"too many images: {n_images} > {serving.max_images} per request "
          "(config.serving.max_images)")
  system = convert_system(body.get("system"))
  tools = convert_tools(body.get("tools"), serving.max_tools)
  tool_choice = convert_tool_choice(body.get("tool_choice"), tools)
  _field(body, "metadata", "", dict)  # accepted and ignored (user_id is for Anthropic's abuse detection)
  return ParsedRequest(
      model=model, messages=([system] if system else []) + messages, tools=tools, tool_choice=tool_choice,
      thinking=thinking.on, thinking_budget=thinking.budget, effort=thinking.effort,
      params=_sampling(body, max_tokens or 1), stop=_stop_sequences(body),
      stream=bool(_field(body, "stream", "", bool, default=False)),
      thinking_display="redacted" if trigger and thinking.on else thinking.display,
      prefill=bool(messages) and messages[-1].role == "assistant")
