"""OpenAI Chat Completions / Completions request bodies -> Horizon's chat types.

The bodies are pydantic models (FastAPI validates them; the server reshapes a
validation error into OpenAI's `{"error": {..., "param": "messages[0].role"}}`
with status 400, as OpenAI answers; serving/errors.py words the first error,
for this API and the Anthropic one alike). Unknown fields are accepted and ignored
(clients send `user`, `metadata`, `store`, ...); features this server does
not have (logprobs, non-text response formats, `suffix`, `best_of` > n)
are refused with a 400 naming the field rather than silently ignored.

Translation (https://platform.openai.com/docs/api-reference/chat/create):
  * system and developer messages -> `system` Messages (the first one becomes
    the chat format's system part; later ones render in place);
  * user content: a string or parts `text` / `image_url` (a base64 data URL;
    http(s) URLs are refused -- the server has no network);
  * assistant: content (string / text or refusal parts), `reasoning_content`
    or `reasoning` (both spellings in use by OpenAI-compatible servers; the
    thinking is rendered back, history retention), `tool_calls`;
  * tool: content + `tool_call_id` (the renderer names the tool from the call).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic

from serving import images as images_lib
from serving.api_common import resolve_tool_choice
from serving.errors import APIError
from serving.types import ImagePart, Message, Part, TextPart, Tool, ToolCall, ToolChoice

_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_N = 16  # choices per request (each is a separate generation in its own slot)
MAX_STOP = 4  # stop strings (OpenAI's limit)


class _Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow")


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
  model: str = ""
  temperature: float | None = pydantic.Field(None, ge=0.0, le=2.0)
  top_p: float | None = pydantic.Field(None, gt=0.0, le=1.0)
  top_k: int | None = pydantic.Field(None, ge=0)  # an extension (vLLM, SGLang accept it too)
  seed: int | None = None
  stop: str | list[str] | None = None
  n: int = pydantic.Field(1, ge=1, le=MAX_N)
  stream: bool = False
  stream_options: StreamOptions | None = None
  max_tokens: int | None = pydantic.Field(None, ge=1)
  logprobs: Any = None


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


def refuse_unsupported(body: _Sampling) -> None:
  """400 for features the server does not implement (never silently ignored)."""
  if body.logprobs not in (None, False, 0):
    raise APIError(400, "logprobs are not supported by this server; leave `logprobs` unset.",
                   param="logprobs")
  if isinstance(body, ChatRequest):
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
      raise APIError(400, f"response_format type {fmt!r} is not supported (only 'text'); use tools with "
                     "tool_choice to get schema-constrained JSON.", param="response_format")
  if isinstance(body, CompletionRequest):
    if body.suffix:
      raise APIError(400, "suffix (insertion) is not supported by this server.", param="suffix")
    if body.best_of not in (None, 1, body.n):
      raise APIError(400, "best_of > n is not supported (it needs logprobs to rank candidates); "
                     "use n.", param="best_of")


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
    if not _TOOL_NAME.match(f.name):
      raise APIError(400, f"tools[{j}].function.name: {f.name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$.",
                     param=f"tools[{j}].function.name")
    if f.name in seen:
      raise APIError(400, f"tools[{j}].function.name: {f.name!r} is defined twice.",
                     param=f"tools[{j}].function.name")
    seen.add(f.name)
    params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
    tools.append(Tool(name=f.name, description=f.description or "", parameters=params))
  choice = body.tool_choice
  mode, name = ("named", choice.function.name) if isinstance(choice, NamedToolChoice) else (choice, None)
  try:
    return tools, resolve_tool_choice(mode, tools, name)
  except ValueError as e:
    raise APIError(400, str(e), param="tool_choice") from None


# ---------------------------------------------------------------- messages --

def _text_parts(content, where: str, *, refusal_ok: bool = False) -> list[Part]:
  if content is None:
    return []
  if isinstance(content, str):
    return [TextPart(content)] if content else []
  out: list[Part] = []
  for j, part in enumerate(content):
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
      out.append(TextPart(part["text"]))
    elif kind == "refusal" and refusal_ok and isinstance(part.get("refusal"), str):
      out.append(TextPart(part["refusal"]))
    else:
      raise APIError(400, f"{where}.content[{j}]: expected a text part {{\"type\": \"text\", \"text\": "
                     f"...}} here, got type {kind!r}.", param=f"{where}.content[{j}]")
  return out


class ImageDecoder:
  """Decodes `image_url` parts with the model's image size; counts images against the limit."""

  def __init__(self, vision, max_images: int):
    self.vision, self.max_images, self.count = vision, max_images, 0

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
      pixels = images_lib.decode_image(url, self.vision.image_size, self.vision.num_channels)
    except ValueError as e:
      raise APIError(400, f"{where}.image_url.url: {e}", param=f"{where}.image_url.url") from None
    return ImagePart(pixels)


def _user_parts(content, where: str, decode: ImageDecoder) -> list[Part]:
  if content is None or isinstance(content, str):
    return _text_parts(content, where)
  out: list[Part] = []
  for j, part in enumerate(content):
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
      out.append(TextPart(part["text"]))
    elif kind == "image_url":
      out.append(decode(part, f"{where}.content[{j}]"))
    else:
      raise APIError(400, f"{where}.content[{j}]: unsupported content part type {kind!r}; this server "
                     "accepts 'text' and 'image_url' (data URLs).", param=f"{where}.content[{j}].type")
  return out


def convert_messages(msgs: list[ChatMessage], decode: ImageDecoder) -> list[Message]:
  """OpenAI messages -> serving.types.Message, one to one (indices match for error params)."""
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
