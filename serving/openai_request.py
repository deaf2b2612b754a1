"""OpenAI Chat Completions / Completions request bodies -> Horizon's chat types.

The bodies are pydantic models (FastAPI validates them; the server reshapes a
validation error into OpenAI's `{"error": {..., "param": "messages[0].role"}}`
with status 400, as OpenAI answers; serving/errors.py words the first error,
for this API and the Anthropic one alike). Unknown fields are accepted and ignored
(clients send `user`, `metadata`, `store`, ...); features this server does
not have (logprobs, `suffix`, `best_of` > n, logit_bias, penalties, `functions`)
are refused with a 400 naming the field rather than silently ignored, and so are
combinations OpenAI refuses (`best_of` < n, `stream_options` without `stream`, a
conversation ending in tool calls no tool message answers).
`parallel_tool_calls=false` is honoured: at most one call per turn.

Types are strict, as in the Anthropic schema (serving/anthropic_schema.py):
nothing is coerced, so `"stream": "yes"`, `"max_tokens": "5"` or
`"n": true` are 400s naming the field. A boolean is no integer, and an
integer field takes only a JSON integer: `5.0` is refused (JavaScript
clients serialise 5.0 as 5 anyway; a Python client sending a float there
has a bug worth hearing about). Number fields take integers. `model` is
required, as on OpenAI (400 "model: Field required", the same as the
Anthropic API); a model this server does not serve is a 404
`model_not_found` naming the served ones (serving/prepare.py check_model).

Translation (https://platform.openai.com/docs/api-reference/chat/create):
  * system and developer messages -> `system` Messages (the first one becomes
    the chat format's system part; later ones render in place);
  * user content: a string or parts `text` / `image_url` (a base64 data URL;
    http(s) URLs are refused -- the server has no network);
  * assistant: content (string / text or refusal parts), `reasoning_content`
    or `reasoning` (both spellings in use by OpenAI-compatible servers; the
    thinking is rendered back, history retention), `tool_calls`;
  * tool: content + `tool_call_id` (the renderer names the tool from the call); as on OpenAI,
    the tool messages right after an assistant message answer each of its calls exactly once.
  * structured outputs (serving/constrained.py): `response_format` json_object /
    json_schema constrains the answer to one JSON document, `function.strict` every
    call to that tool; schemas that cannot compile are 400s naming the field.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic

from model.config import is_int
from serving import images as images_lib
from serving.admission import TOP_K_MAX
from serving.api_common import resolve_tool_choice
from serving.errors import APIError
from serving.types import ImagePart, Message, Part, ResponseFormat, TextPart, Tool, ToolCall, ToolChoice

_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # fullmatch: `$` would let a trailing "\n" through
MAX_N = 16  # choices per request (each is a separate generation in its own slot)
MAX_STOP = 4  # stop strings (OpenAI's limit)


class _Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow", strict=True)


class FunctionCall(_Body):
  name: str
  arguments: str


class ToolCallIn(_Body):
  id: str
  type: Literal["function"] = "function"
  function: FunctionCall


class ChatMessage(_Body):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[dict[str, Any]] | None = None
  name: str | None = None
  tool_calls: list[ToolCallIn] | None = None
  tool_call_id: str | None = None
  reasoning_content: str | None = None
  reasoning: str | None = None


class FunctionDef(_Body):
  name: str
  description: str | None = None
  parameters: dict[str, Any] | None = None
  strict: bool | None = None  # every call to it follows `parameters` (serving/constrained.py)


class ToolDef(_Body):
  type: Literal["function"]
  function: FunctionDef


class NamedFunction(_Body):
  name: str


class NamedToolChoice(_Body):
  type: Literal["function"]
  function: NamedFunction


class StreamOptions(_Body):
  include_usage: bool = False


class _Sampling(_Body):
  """Fields shared by both endpoints."""
  model: str
  temperature: float | None = pydantic.Field(None, ge=0.0, le=2.0)
  top_p: float | None = pydantic.Field(None, gt=0.0, le=1.0)
  top_k: int | None = pydantic.Field(None, ge=0, le=TOP_K_MAX)  # an extension (vLLM, SGLang accept it too)
  seed: int | None = None
  stop: str | list[str] | None = None
  n: int = pydantic.Field(1, ge=1, le=MAX_N)
  stream: bool = False
  stream_options: StreamOptions | None = None
  max_tokens: int | None = pydantic.Field(None, ge=1)
  logprobs: bool | int | None = None  # bool for chat, an int (top-n) for completions; refused when set


class ChatRequest(_Sampling):
  messages: list[ChatMessage] = pydantic.Field(min_length=1)
  tools: list[ToolDef] | None = None
  tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
  parallel_tool_calls: bool | None = None
  reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
  max_completion_tokens: int | None = pydantic.Field(None, ge=1)
  response_format: dict[str, Any] | None = None
  top_logprobs: int | None = None
  # vLLM's extension: continue the final assistant message instead of opening a new turn.
  continue_final_message: bool = False


class CompletionRequest(_Sampling):
  prompt: str | list[str] | list[int] | list[list[int]]
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None


def stop_strings(stop: str | list[str] | None) -> list[str]:
  """`stop` as a list (at most 4 non-empty strings)."""
  stops = [stop] if isinstance(stop, str) else list(stop or [])
  if len(stops) > MAX_STOP:
    raise APIError(400, f"stop: at most {MAX_STOP} stop sequences are allowed, got {len(stops)}.",
                   param="stop")
  if any(not s for s in stops):
    raise APIError(400, "stop: stop sequences must be non-empty strings.", param="stop")
  return stops


# (field, is it a use of something this server lacks or a combination it refuses (value, body), the 400's
# message)
_UNSUPPORTED = (
    ("logprobs", lambda v, b: v not in (None, False, 0),
     "logprobs are not supported by this server; leave `logprobs` unset."),
    ("top_logprobs", lambda v, b: v not in (None, 0),
     "top_logprobs needs logprobs, which this server does not support; leave it unset."),
    ("logit_bias", lambda v, b: bool(v), "logit_bias is not supported by this server; leave it unset."),
    ("frequency_penalty", lambda v, b: v not in (None, 0),
     "frequency_penalty is not supported by this server; leave it unset or 0."),
    ("presence_penalty", lambda v, b: v not in (None, 0),
     "presence_penalty is not supported by this server; leave it unset or 0."),
    ("functions", lambda v, b: v is not None, "functions is not supported; use `tools` and `tool_choice`."),
    ("function_call", lambda v, b: v is not None,
     "function_call is not supported; use `tools` and `tool_choice`."),
    ("suffix", lambda v, b: bool(v), "suffix (insertion) is not supported by this server."),
    ("best_of", lambda v, b: v is not None and not (is_int(v) and v <= b.n),
     "best_of > n is not supported (it needs logprobs to rank candidates); use n."),
    ("best_of", lambda v, b: is_int(v) and v < b.n,
     "best_of must be at least n (each returned choice is the best of best_of candidates); leave it "
     "unset."),
    ("stream_options", lambda v, b: v is not None and not b.stream,
     "stream_options is only allowed when stream is true; leave it unset or set stream."),
)


def refuse_unsupported(body: _Sampling) -> None:
  """400 for features the server does not implement (never silently ignored), declared or not:
  unknown fields are accepted, so `logit_bias` or the penalties would otherwise do nothing."""
  fields = {**(body.model_extra or {}), **{k: getattr(body, k) for k in type(body).model_fields}}
  for name, unsupported, message in _UNSUPPORTED:
    if name in fields and unsupported(fields[name], body):
      raise APIError(400, message, param=name)


# ------------------------------------------------------------------- tools --

def convert_tools(body: ChatRequest, max_tools: int) -> tuple[list[Tool], ToolChoice]:
  """OpenAI `tools` / `tool_choice` -> Tool list and ToolChoice (validated, naming the field)."""
  defs = body.tools or []
  if len(defs) > max_tools:
    raise APIError(400, f"tools: {len(defs)} tools given; this server accepts at most {max_tools} "
                   "(config.serving.max_tools).", param="tools")
  tools, seen = [], set()
  for j, t in enumerate(defs):
    f = t.function
    if not _TOOL_NAME.fullmatch(f.name):
      raise APIError(400, f"tools[{j}].function.name: {f.name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$.",
                     param=f"tools[{j}].function.name")
    if f.name in seen:
      raise APIError(400, f"tools[{j}].function.name: {f.name!r} is defined twice.",
                     param=f"tools[{j}].function.name")
    seen.add(f.name)
    params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
    if params.get("type", "object") != "object":  # as OpenAI: a call's arguments are one JSON object
      raise APIError(400, f"tools[{j}].function.parameters: must be a JSON Schema of type 'object', got "
                     f"type {params['type']!r}.", param=f"tools[{j}].function.parameters")
    tools.append(Tool(name=f.name, description=f.description or "", parameters=params, strict=bool(f.strict)))
  choice = body.tool_choice
  mode, name = ("named", choice.function.name) if isinstance(choice, NamedToolChoice) else (choice, None)
  try:
    resolved = resolve_tool_choice(mode, tools, name, parallel=body.parallel_tool_calls is not False)
  except ValueError as e:
    raise APIError(400, str(e), param="tool_choice") from None
  _check_constrained_tools(tools, resolved)
  return tools, resolved


def _check_constrained_tools(tools: list[Tool], choice: ToolChoice) -> None:
  """400 naming `tools[j].function.parameters` for a schema constrained decoding cannot compile
  (strict tools, and the tools tool_choice required/named forces)."""
  from serving.constrained import check_parameters  # llguidance: loaded when a schema is used

  for j, tool in enumerate(tools):
    forced = choice.mode == "required" or (choice.mode == "named" and choice.name == tool.name)
    if tool.strict or forced:
      field = f"tools[{j}].function.parameters"
      try:
        check_parameters(tool, field)
      except ValueError as e:
        raise APIError(400, str(e), param=field) from None


def response_format(body: ChatRequest) -> ResponseFormat | None:
  """`response_format` -> None (text) or the JSON document the answer must be; 400s name the field.

  {"type": "text"}; {"type": "json_object"}: any JSON object; {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}: a document valid under
  `schema` (constrained whether `strict` is true or false; no schema: any object).
  """
  fmt = body.response_format
  if fmt is None:
    return None
  kind = fmt.get("type")
  if kind == "text":
    return None
  if kind == "json_object":
    return ResponseFormat()
  if kind != "json_schema":
    raise APIError(400, f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'.",
                   param="response_format.type")
  spec = fmt.get("json_schema")
  if not isinstance(spec, dict):
    raise APIError(400, "response_format.json_schema: required for type 'json_schema' (an object with "
                   "`name` and `schema`).", param="response_format.json_schema")
  if not isinstance(spec.get("name"), str) or not _TOOL_NAME.fullmatch(spec["name"]):
    raise APIError(400, "response_format.json_schema.name: required, matching ^[a-zA-Z0-9_-]{1,64}$.",
                   param="response_format.json_schema.name")
  if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
    raise APIError(400, "response_format.json_schema.strict: expected a boolean.",
                   param="response_format.json_schema.strict")
  schema = spec.get("schema")
  if schema is None:
    return ResponseFormat()
  from serving.grammar import check_schema  # llguidance: loaded when a schema is used

  field = "response_format.json_schema.schema"
  try:
    check_schema(schema, field)
  except ValueError as e:
    raise APIError(400, str(e), param=field) from None
  return ResponseFormat(schema)


# ---------------------------------------------------------------- messages --

def _string(part: dict[str, Any], key: str, where: str) -> str:
  """part[key], which must be a string (a 400 naming `where.key` otherwise)."""
  value = part.get(key)
  if not isinstance(value, str):
    got = "nothing" if value is None else type(value).__name__
    raise APIError(400, f"{where}.{key}: expected a string, got {got}.", param=f"{where}.{key}")
  return value


def _text_parts(content, where: str, *, refusal_ok: bool = False) -> list[Part]:
  if content is None:
    return []
  if isinstance(content, str):
    return [TextPart(content)] if content else []
  out: list[Part] = []
  for j, part in enumerate(content):
    kind = part.get("type")
    if kind == "text" or (kind == "refusal" and refusal_ok):
      out.append(TextPart(_string(part, kind, f"{where}.content[{j}]")))
    else:
      raise APIError(400, f"{where}.content[{j}]: expected a text part {{\"type\": \"text\", \"text\": "
                     f"...}} here, got type {kind!r}.", param=f"{where}.content[{j}]")
  return out


class ImageDecoder:
  """Decodes `image_url` parts with the model's image size; counts images against the limit."""

  def __init__(self, vision, max_images: int, max_bytes: int | None = None,
               max_pixels: int = images_lib.MAX_PIXELS):
    self.vision, self.max_images, self.count = vision, max_images, 0
    self.max_bytes, self.max_pixels = max_bytes, max_pixels

  def __call__(self, part: dict[str, Any], where: str) -> ImagePart:
    self.count += 1
    if self.count > self.max_images:
      raise APIError(400, f"{where}: more than {self.max_images} images in one request "
                     "(config.serving.max_images).", param=where)
    if self.vision is None or not self.vision.enabled:
      raise APIError(400, f"{where}: this model has no vision encoder; send text only.", param=where)
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
      raise APIError(400, f"{where}.image_url.url: expected a data URL string "
                     "(data:image/png;base64,...).", param=f"{where}.image_url.url")
    try:
      pixels = images_lib.decode_image(url, self.vision.image_size, self.vision.num_channels,
                                       max_bytes=self.max_bytes, max_pixels=self.max_pixels)
    except ValueError as e:
      raise APIError(400, f"{where}.image_url.url: {e}", param=f"{where}.image_url.url") from None
    return ImagePart(pixels)


def _user_parts(content, where: str, decode: ImageDecoder) -> list[Part]:
  if content is None or isinstance(content, str):
    return _text_parts(content, where)
  out: list[Part] = []
  for j, part in enumerate(content):
    kind = part.get("type")
    if kind == "text":
      out.append(TextPart(_string(part, "text", f"{where}.content[{j}]")))
    elif kind == "image_url":
      out.append(decode(part, f"{where}.content[{j}]"))
    else:
      raise APIError(400, f"{where}.content[{j}]: unsupported content part type {kind!r}; this server "
                     "accepts 'text' and 'image_url' (data URLs).", param=f"{where}.content[{j}].type")
  return out


def _check_answered(msgs: list[ChatMessage]) -> None:
  """As OpenAI: an assistant message's tool calls are answered by the tool messages right after it,
  each call exactly once (unknown ids are the renderer's 400)."""
  unanswered: list[str] = []
  answered: set[str] = set()
  for i, m in enumerate(msgs):
    if m.role == "tool":
      if m.tool_call_id and m.tool_call_id in answered:
        raise APIError(400, f"messages[{i}].tool_call_id: {m.tool_call_id!r} was already answered by an "
                       "earlier tool message; send one tool message per tool call.",
                       param=f"messages[{i}].tool_call_id")
      answered.add(m.tool_call_id)
      unanswered = [c for c in unanswered if c != m.tool_call_id]
      continue
    if unanswered:
      raise APIError(400, f"messages[{i}]: an assistant message with 'tool_calls' must be followed by tool "
                     "messages responding to each 'tool_call_id'. The following tool_call_ids did not "
                     f"have response messages: {', '.join(unanswered)}.", param=f"messages[{i}]")
    unanswered = [c.id for c in m.tool_calls or []] if m.role == "assistant" else []
  if unanswered:
    raise APIError(400, f"messages[{len(msgs) - 1}]: the conversation ends with tool calls that no tool "
                   f"message answers ({', '.join(unanswered)}); append a tool message for each before "
                   "asking for the next turn.", param=f"messages[{len(msgs) - 1}]")


def convert_messages(msgs: list[ChatMessage], decode: ImageDecoder) -> list[Message]:
  """OpenAI messages -> serving.types.Message, one to one (indices match for error params)."""
  _check_answered(msgs)
  out = []
  for i, m in enumerate(msgs):
    where = f"messages[{i}]"
    if m.role in ("system", "developer"):
      out.append(Message("system", _text_parts(m.content, where)))
    elif m.role == "user":
      out.append(Message("user", _user_parts(m.content, where, decode)))
    elif m.role == "assistant":
      thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
      calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
               for c in m.tool_calls or []]
      out.append(Message("assistant", _text_parts(m.content, where, refusal_ok=True), thinking=thinking,
                         tool_calls=calls))
    else:
      if not m.tool_call_id:
        raise APIError(400, f"{where}.tool_call_id: a tool message must answer a tool call by its id.",
                       param=f"{where}.tool_call_id")
      out.append(Message("tool", _text_parts(m.content, where), tool_call_id=m.tool_call_id))
  return out
