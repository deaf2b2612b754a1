"""Anthropic Messages API request -> Horizon's chat types (serving/types.py).

Validates the JSON body of `POST /v1/messages` and `/v1/messages/count_tokens`
(https://docs.anthropic.com/en/api/messages) against the pydantic models of
serving/anthropic_schema.py, then translates it. Every error is a 400
`invalid_request_error` whose message names the field the way Anthropic's API
does (`"max_tokens: Field required"`, `"messages.1.content.0: Invalid
`signature` in `thinking` block"`): agent middleware written against
Anthropic reads them unchanged. The checks here are those that need the rest
of the request or the server (turn order, tool_result ids, signatures,
limits).

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
  * `model` is required (400 "model: Field required", as on Anthropic and as
    the OpenAI routes answer); a model the server does not serve is a 404
    `not_found_error` naming the served ones (serving/prepare.py check_model,
    called by the route).
  * Anthropic requires budget_tokens >= 1024; not enforced here because the
    CPU variants think for tens of tokens (configs/serve.py).
  * `tool_choice` any/tool together with thinking is accepted (Anthropic
    rejects it): the constraint starts once thinking has ended.
  * `disable_parallel_tool_use`: under auto, at most one call (the turn ends when
    it closes); any/tool always yield exactly one call.
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
  * Structured outputs: `tools[].strict` constrains every call's `input` to its
    `input_schema` (tool_choice any/tool constrain the forced call as before), and
    `output_config.format` ({type: json_schema, schema}) the answer text to one JSON
    document (serving/constrained.py); schemas llguidance cannot compile are 400s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pydantic

from serving import signing
from serving.anthropic_schema import (
  Block,
  CountTokensRequest,
  ImageBlock,
  InputMessage,
  MessagesRequest,
  RedactedThinkingBlock,
  SystemText,
  TextBlock,
  ThinkingAdaptive,
  ThinkingBlock,
  ThinkingDisabled,
  ToolChoiceSpec,
  ToolResultBlock,
  ToolSpec,
  ToolUseBlock,
)
from serving.api_common import EFFORT_TIERS, ThinkingSettings, effort_thinking, resolve_tool_choice
from serving.errors import validation_message
from serving.images import sniff_media_type
from serving.types import (
  EFFORTS,
  ImagePart,
  Message,
  Part,
  ResponseFormat,
  SamplingParams,
  TextPart,
  Tool,
  ToolCall,
  ToolChoice,
)

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
  # output_config.format: the answer is one JSON document (None: free text).
  response_format: ResponseFormat | None = None


def _fail(path: str, message: str) -> None:
  raise InvalidRequest(f"{path}: {message}" if path else message)


def _join(path: str, key: str | int) -> str:
  return f"{path}.{key}" if path else str(key)


# ---- content blocks ----------------------------------------------------------
def _text(block: TextBlock, path: str) -> str:
  """The text of a user text block (Anthropic refuses empty ones)."""
  if not block.text:
    _fail(_join(path, "text"), "text content blocks must be non-empty")
  return block.text


def _image(block: ImageBlock, path: str, decode: ImageDecoder) -> ImagePart:
  found = sniff_media_type(block.source.data)  # Anthropic refuses data that is not its media_type
  if found is not None and found != block.source.media_type:
    _fail(_join(path, "source.media_type"), f"the image data is {found}, not {block.source.media_type}; "
          f"set media_type to {found!r}.")
  try:
    return ImagePart(pixels=decode(block.source.data))
  except ValueError as e:  # serving.images names the problem (bad base64, undecodable, too large)
    _fail(_join(path, "source.data"), str(e))


def _tool_result(block: ToolResultBlock, path: str, decode: ImageDecoder) -> tuple[str, list[ImagePart]]:
  """(text, images) of a tool_result block."""
  texts, images = [], []
  for j, sub in enumerate(block.content or ()):
    if isinstance(sub, TextBlock):
      texts.append(sub.text)
    elif isinstance(sub, ImageBlock):
      images.append(_image(sub, _join(path, f"content.{j}"), decode))
    else:
      _fail(_join(path, f"content.{j}.type"), f"'{sub.type}' blocks are not supported inside tool_result "
            "(use text or image)")
  text = "\n\n".join(texts)
  return ("Error: " + text if block.is_error else text), images


def _thinking_block(block: ThinkingBlock | RedactedThinkingBlock, path: str, key: bytes) -> str:
  """The thinking text of a returned thinking / redacted_thinking block, authenticated."""
  if isinstance(block, ThinkingBlock):
    if signing.verify_thinking(key, block.thinking, block.signature):
      return block.thinking
    sealed = signing.unseal_thinking(key, block.signature) if block.thinking == "" else None
    if sealed is None:  # neither our signature of this text nor an omitted-display seal
      _fail(path, "Invalid `signature` in `thinking` block")
    return sealed
  text = signing.unseal_thinking(key, block.data)
  if text is None:
    _fail(path, "Invalid `data` in `redacted_thinking` block")
  return text


def _unsupported(block: Block, path: str) -> None:
  _fail(_join(path, "type"), f"content blocks of type '{block.type}' are not supported by this server")


# ---- turns -------------------------------------------------------------------
@dataclasses.dataclass
class _Turn:
  role: str
  blocks: list[tuple[str, Block]]  # (error path, block)


def _turns(messages: list[InputMessage]) -> list[_Turn]:
  """Consecutive turns of one role merged; an empty final assistant message dropped."""
  turns: list[_Turn] = []
  for i, msg in enumerate(messages):
    path = f"messages.{i}"
    blocks = [(f"{path}.content.{j}", b) for j, b in enumerate(msg.content)]
    if msg.role == "assistant" and i == len(messages) - 1 and all(
        isinstance(b, TextBlock) and not b.text for _, b in blocks):
      continue  # an empty final assistant message: nothing to prefill
    if not blocks:
      _fail(path, "all messages must have non-empty content except for the optional final assistant "
            "message")
    if turns and turns[-1].role == msg.role:
      turns[-1].blocks.extend(blocks)
    else:
      turns.append(_Turn(msg.role, blocks))
  return turns


def _user_turn(turn: _Turn, pending: dict[str, str], decode: ImageDecoder) -> list[Message]:
  """Tool messages for the leading tool_result blocks, then one user message."""
  out: list[Message] = []
  parts: list[Part] = []
  moved_images: list[ImagePart] = []
  answered = set()
  for path, block in turn.blocks:
    if isinstance(block, ToolResultBlock):
      if parts:
        _fail(path, "tool_result blocks must come first in a user message, before any text or image")
      text, images = _tool_result(block, path, decode)
      call_id = block.tool_use_id
      if call_id not in pending:
        _fail(path, f"unexpected `tool_use_id` found in `tool_result` blocks: {call_id}. Each "
              "`tool_result` block must have a corresponding `tool_use` block in the previous message.")
      if call_id in answered:
        _fail(_join(path, "tool_use_id"), f"`tool_use` id {call_id} is answered by an earlier `tool_result` "
              "block of this message; send one `tool_result` per `tool_use` (merge the results' content)")
      answered.add(call_id)
      out.append(Message(role="tool", content=[TextPart(text)], tool_call_id=call_id, name=pending[call_id]))
      moved_images.extend(images)
    elif isinstance(block, TextBlock):
      parts.append(TextPart(_text(block, path)))
    elif isinstance(block, ImageBlock):
      parts.append(_image(block, path, decode))
    elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock, ToolUseBlock)):
      _fail(_join(path, "type"), f"`{block.type}` blocks are only allowed in assistant messages")
    else:
      _unsupported(block, path)
  missing = [c for c in pending if c not in answered]
  if missing:
    _fail(turn.blocks[0][0].rsplit(".content", 1)[0],
          f"`tool_use` ids were found without `tool_result` blocks immediately after: {', '.join(missing)}. "
          "Each `tool_use` block must have a corresponding `tool_result` block in the next message.")
  if moved_images or parts:
    out.append(Message(role="user", content=list(moved_images) + parts))
  return out


def _assistant_turn(turn: _Turn, key: bytes, used: set[str]) -> tuple[Message, dict[str, str]]:
  """The assistant message and its {tool_use id: tool name}; `used` collects the conversation's
  tool_use ids (a repeated one is refused here, by its Anthropic path: the renderer's own check
  would name the chat format's messages[i].tool_calls[j] instead)."""
  thinking: list[str] = []
  parts: list[Part] = []
  calls: list[ToolCall] = []
  for path, block in turn.blocks:
    if isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
      thinking.append(_thinking_block(block, path, key))
    elif isinstance(block, TextBlock):
      parts.append(TextPart(block.text))
    elif isinstance(block, ToolUseBlock):
      if block.id in used:
        _fail(_join(path, "id"), f"tool_use id {block.id!r} is used by an earlier tool_use block; give each "
              "tool_use its own id")
      used.add(block.id)
      try:
        arguments = json.dumps(block.input, ensure_ascii=False)
      except RecursionError:
        _fail(_join(path, "input"), "nested too deeply to encode as JSON; nest it at most a few hundred "
              "levels deep")
      calls.append(ToolCall(id=block.id, name=block.name, arguments=arguments))
    elif isinstance(block, ImageBlock):
      _fail(_join(path, "type"), "image blocks are only allowed in user messages")
    else:
      _unsupported(block, path)
  message = Message(role="assistant", content=parts, tool_calls=calls,
                    thinking="\n\n".join(thinking) if thinking else None)
  return message, {c.id: c.name for c in calls}


def _check_final_thinking(turns: list[_Turn]) -> None:
  """With thinking on, the last assistant turn that calls tools must start with its thinking."""
  last = next((t for t in reversed(turns) if t.role == "assistant"), None)
  if last is None or not any(isinstance(b, ToolUseBlock) for _, b in last.blocks):
    return
  path, first = last.blocks[0]
  if not isinstance(first, (ThinkingBlock, RedactedThinkingBlock)):
    _fail(_join(path, "type"), f"Expected `thinking` or `redacted_thinking`, but found `{first.type}`. "
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
    if not isinstance(block, TextBlock):
      _fail(_join(block_path, "type"), "a final `assistant` message (prefill) may only hold `text` "
            f"blocks, not '{block.type}'")
  last = turn.blocks[-1][1].text
  if last != last.rstrip():
    _fail(path, "final assistant content cannot end with trailing whitespace")


def convert_messages(messages: list[InputMessage], *, key: bytes, decode_image: ImageDecoder,
                     thinking: bool) -> tuple[list[Message], bool]:
  """(messages, redacted-thinking trigger present) for a request's validated `messages`.

  A final assistant message (a prefill) is kept as the last message; see
  `ParsedRequest.prefill`.
  """
  turns = _turns(messages)
  if not turns:
    _fail("messages", "at least one message must have non-empty content")
  prefill = turns[-1].role == "assistant"
  if prefill:
    _check_prefill(turns[-1], f"messages.{len(messages) - 1}", thinking)
  elif thinking:
    _check_final_thinking(turns)
  out: list[Message] = []
  pending: dict[str, str] = {}
  used: set[str] = set()
  for turn in turns:
    if turn.role == "user":
      out.extend(_user_turn(turn, pending, decode_image))
      pending = {}
    else:
      message, pending = _assistant_turn(turn, key, used)
      out.append(message)
  trigger = any(isinstance(p, TextPart) and signing.REDACTED_THINKING_TRIGGER in p.text
                for m in out if m.role == "user" for p in m.content)
  return out, trigger


def convert_system(blocks: list[SystemText] | None) -> Message | None:
  """One system message, its text blocks joined by a blank line (None without text)."""
  texts = [b.text for b in blocks or ()]
  return Message(role="system", content=[TextPart("\n\n".join(texts))]) if texts else None


# ---- tools, thinking ------------------------------------------------------------
def convert_tools(specs: list[ToolSpec] | None, max_tools: int) -> list[Tool]:
  specs = specs or []
  if len(specs) > max_tools:
    _fail("tools", f"at most {max_tools} tools per request (config.serving.max_tools), got {len(specs)}")
  for i, spec in enumerate(specs):
    if spec.input_schema.get("type") != "object":
      _fail(f"tools.{i}.input_schema.type", "Input should be 'object'")
  return [Tool(name=s.name, description=s.description, parameters=s.input_schema, strict=s.strict)
          for s in specs]


_TOOL_CHOICE_MODES = {"none": "none", "auto": "auto", "any": "required", "tool": "named"}


def convert_tool_choice(choice: ToolChoiceSpec | None, tools: list[Tool]) -> ToolChoice:
  if choice is None:
    return resolve_tool_choice(None, tools)
  single = bool(choice.disable_parallel_tool_use)
  if choice.type == "tool" and tools and choice.name is None:
    _fail("tool_choice.name", "Field required")
  name = choice.name if choice.type == "tool" and tools else None
  try:
    return resolve_tool_choice(_TOOL_CHOICE_MODES[choice.type], tools, name, parallel=not single)
  except ValueError as e:
    _fail("tool_choice.name" if name is not None else "tool_choice", str(e))


def convert_structured(req: CountTokensRequest, tools: list[Tool], choice: ToolChoice, *,
                       prefill: bool) -> ResponseFormat | None:
  """Structured outputs: checks the schemas constrained decoding compiles (strict tools, the
  tools tool_choice any/tool forces, `output_config.format.schema`) and returns the format."""
  from serving.constrained import check_parameters  # llguidance: loaded when a schema is used
  from serving.grammar import check_schema

  for i, tool in enumerate(tools):
    forced = choice.mode == "required" or (choice.mode == "named" and choice.name == tool.name)
    if tool.strict or forced:
      try:
        check_parameters(tool, f"tools.{i}.input_schema")
      except ValueError as e:
        _fail("", str(e))
  fmt = req.output_config.format if req.output_config else None
  if fmt is None:
    return None
  if prefill:
    _fail("output_config.format", "structured outputs cannot be combined with a prefilled final "
          "`assistant` message: the document would start outside the constraint")
  try:
    check_schema(fmt.schema_, "output_config.format.schema")
  except ValueError as e:
    _fail("", str(e))
  return ResponseFormat(fmt.schema_)


def _tier_for_budget(budget: int, serving: Any) -> str:
  """The prompt's effort line for an explicit budget: the smallest tier that covers it."""
  return next((t for t in EFFORTS if int(serving.thinking_budgets[t]) >= budget), EFFORTS[-1])


def convert_thinking(req: CountTokensRequest, serving: Any, max_tokens: int | None) -> ThinkingSettings:
  """Thinking settings from `thinking`, `output_config.effort` and the config default.

  enabled: budget = budget_tokens (< max_tokens); the tier line is the effort
  or the smallest tier whose budget covers it. adaptive: the effort's tier
  (default high) and its configured budget. Absent: config.serving.default_effort.
  """
  effort = req.output_config.effort if req.output_config else None
  thinking = req.thinking
  if thinking is None:  # the server default (configs/serve.py default_effort) turns thinking on or off
    default = effort_thinking(None, serving)
    return effort_thinking(effort, serving) if default.on and effort else default
  if isinstance(thinking, ThinkingDisabled):
    return ThinkingSettings(False)
  if isinstance(thinking, ThinkingAdaptive):
    return dataclasses.replace(effort_thinking(effort or "high", serving), display=thinking.display)
  budget = thinking.budget_tokens
  if max_tokens is not None and budget >= max_tokens:
    _fail("", "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our "
          f"documentation at {THINKING_DOCS}#max-tokens-and-context-window-size")
  tier = EFFORT_TIERS[effort] if effort else _tier_for_budget(budget, serving)
  return ThinkingSettings(True, budget, tier, thinking.display)


def _image_blocks(messages: list[InputMessage]) -> int:
  """Image blocks in the messages, tool results' included: counted against max_images before any
  is decoded (a 16 MB body holds dozens of large images, seconds of decoding each)."""
  n = 0
  for m in messages:
    for b in m.content:
      inner = (b.content or ()) if isinstance(b, ToolResultBlock) else (b,)
      n += sum(isinstance(x, ImageBlock) for x in inner)
  return n


def parse_request(body: Any, *, serving: Any, key: bytes, decode_image: ImageDecoder,
                  count_only: bool = False) -> ParsedRequest:
  """Validates and translates a Messages request (count_only: the count_tokens body, no max_tokens).

  Args:
    body: the decoded JSON body.
    serving: `config.serving` or the server's `Limits` (thinking_budgets, default_effort, max_tools,
      max_images).
    key: the thinking-signature key (serving.signing.signing_key).
    decode_image: raw image bytes -> float32 [H, W, C] in [0, 1].
    count_only: parse a /v1/messages/count_tokens body.
  Raises:
    InvalidRequest: naming the offending field.
    APIError: 500, config.serving.default_effort is not an effort name.
  """
  if not isinstance(body, dict):
    _fail("", "the request body must be a JSON object")
  try:
    req = (CountTokensRequest if count_only else MessagesRequest).model_validate(body)
  except pydantic.ValidationError as e:
    raise InvalidRequest(validation_message(e.errors(include_url=False), anthropic=True)[0]) from None
  max_tokens = None if count_only else req.max_tokens
  thinking = convert_thinking(req, serving, max_tokens)
  n_images = _image_blocks(req.messages)
  if n_images > serving.max_images:
    _fail("messages", f"too many images: {n_images} > {serving.max_images} per request "
          "(config.serving.max_images)")
  messages, trigger = convert_messages(req.messages, key=key, decode_image=decode_image, thinking=thinking.on)
  system = convert_system(req.system)
  tools = convert_tools(req.tools, serving.max_tools)
  choice = convert_tool_choice(req.tool_choice, tools)
  fmt = convert_structured(req, tools, choice, prefill=bool(messages) and messages[-1].role == "assistant")
  return ParsedRequest(
      model=req.model, messages=([system] if system else []) + messages, tools=tools,
      tool_choice=choice, response_format=fmt, thinking=thinking.on,
      thinking_budget=thinking.budget, effort=thinking.effort,
      params=SamplingParams(max_tokens=max_tokens or 1, temperature=req.temperature, top_p=req.top_p,
                            top_k=req.top_k),
      stop=list(req.stop_sequences), stream=req.stream,
      thinking_display="redacted" if trigger and thinking.on else thinking.display,
      prefill=bool(messages) and messages[-1].role == "assistant")
