"""The Anthropic Messages API request body as pydantic models (https://docs.anthropic.com/en/api/messages).

The fields, their types and constraints follow Anthropic's API reference; what
they mean for generation is serving/anthropic_request.py. Validation reads
JSON the way Anthropic's own (pydantic-based) API does, so its error messages
read the same (`"max_tokens: Field required"`, `"messages.0.role: Input
should be 'user' or 'assistant'"`; serving.errors.validation_message names
the field):

  * types are strict: a boolean is no integer, a number no string;
  * `null` is the same as leaving a field out (its default, or "Field
    required");
  * unknown fields are ignored (clients send ones this server has no use for);
  * content blocks are a union discriminated by `type`, each kind its own
    model; a `type` this server does not know validates as `OtherBlock`, and
    the translation refuses it with a message that depends on where it was
    sent. The union's tags are spelled `block[KIND]` so that error locations
    drop them, as they drop pydantic's other union member names;
  * `thinking` is a union discriminated the same way; its `enabled` member
    keeps its tag in error locations (`thinking.enabled.budget_tokens`, as
    Anthropic names the field);
  * a string `content` (or `system`) is one text block.

Checks that depend on the rest of the request or on the server (tool_result
ids against the previous turn, signatures, limits from config.serving, the
thinking budget against max_tokens) are made by the translation.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, Union

import pydantic
from pydantic import AfterValidator, Discriminator, StringConstraints, Tag
from pydantic_core import PydanticCustomError

from serving.admission import TOP_K_MAX


def _check(ok, message: str) -> AfterValidator:
  """A validator that refuses values for which `ok(value)` is false with `message`."""

  def check(value):
    if not ok(value):
      raise PydanticCustomError("value_error", message)
    return value

  return AfterValidator(check)


class _Body(pydantic.BaseModel):
  """Strict types, null = absent, unknown fields ignored (see the module docstring)."""
  model_config = pydantic.ConfigDict(strict=True, extra="ignore")

  @pydantic.model_validator(mode="before")
  @classmethod
  def _null_is_absent(cls, data: Any) -> Any:
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# ---- content blocks ----------------------------------------------------------
class TextBlock(_Body):
  type: Literal["text"]
  text: str


class ImageSource(_Body):
  """Only inline images: the server has no network and no Files API."""
  type: str
  media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
  data: str

  @pydantic.field_validator("type")
  @classmethod
  def _inline_only(cls, kind: str) -> str:
    if kind in ("url", "file"):
      raise PydanticCustomError(
          "value_error", "image source type '{kind}' is not supported: this server has no network or Files "
          "API access. Send the image inline as {\"type\": \"base64\", \"media_type\": \"image/png\", "
          "\"data\": ...}.", {"kind": kind})
    if kind != "base64":
      raise PydanticCustomError("literal_error", "Input should be 'base64'")
    return kind


class ImageBlock(_Body):
  type: Literal["image"]
  source: ImageSource


class ToolUseBlock(_Body):
  type: Literal["tool_use"]
  id: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]+$")]
  name: str
  input: dict[str, Any]


class ThinkingBlock(_Body):
  """A thinking block sent back: its text (empty when its display was omitted) and signature."""
  type: Literal["thinking"]
  thinking: str
  signature: str


class RedactedThinkingBlock(_Body):
  type: Literal["redacted_thinking"]
  data: str


class OtherBlock(_Body):
  """A block of a type this server does not take (the translation says so, naming the place)."""
  type: str


def _blocks_of(*models: type[_Body]) -> Any:
  """A list item that is one of `models`, chosen by the item's `type`; other types -> OtherBlock."""
  kinds = {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in models}

  def tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
      return None
    return f"block[{kind if kind in kinds else 'other'}]"

  members = tuple(Annotated[m, Tag(f"block[{k}]")] for k, m in {**kinds, "other": OtherBlock}.items())
  return Annotated[Union[members], Discriminator(
      tag, custom_error_type="content_block",
      custom_error_message="Input should be a content block object with a `type`")]


ResultPart = _blocks_of(TextBlock, ImageBlock)  # what a tool_result may hold


def _as_blocks(value: Any, what: str, *, empty_is_none: bool = False) -> Any:
  """A string is one text block (no block when it is empty and `empty_is_none`); else a list of `what`."""
  if isinstance(value, str):
    return [] if empty_is_none and not value else [{"type": "text", "text": value}]
  if not isinstance(value, list):
    raise PydanticCustomError("value_error", "Input should be a valid string or a list of {what}",
                              {"what": what})
  return value


class ToolResultBlock(_Body):
  type: Literal["tool_result"]
  tool_use_id: str
  content: list[ResultPart] | None = None
  is_error: bool = False

  @pydantic.field_validator("content", mode="before")
  @classmethod
  def _string_is_text(cls, value: Any) -> Any:
    return _as_blocks(value, "content blocks")


Block = _blocks_of(TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock)


class InputMessage(_Body):
  role: Literal["user", "assistant"]
  content: list[Block]

  @pydantic.field_validator("content", mode="before")
  @classmethod
  def _string_is_text(cls, value: Any) -> Any:
    return _as_blocks(value, "content blocks")


class SystemText(_Body):
  type: Literal["text"]
  text: Annotated[str, _check(bool, "text content blocks must be non-empty")]


# ---- tools, thinking, sampling -------------------------------------------------
class ToolSpec(_Body):
  """A custom tool; its input_schema must be an object schema (checked by the translation)."""
  type: str = "custom"
  name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
  input_schema: dict[str, Any]
  description: str = ""
  strict: bool = False  # structured outputs: every call's input follows input_schema

  @pydantic.field_validator("type")
  @classmethod
  def _custom_only(cls, kind: str) -> str:
    if kind != "custom":
      raise PydanticCustomError("value_error", "server tool '{kind}' is not supported by this server; only "
                                "custom tools (name, description, input_schema) are", {"kind": kind})
    return kind


class ToolChoiceSpec(_Body):
  type: Literal["auto", "any", "tool", "none"]
  name: str | None = None
  disable_parallel_tool_use: bool | None = None  # auto: at most one call; any/tool always make one


Display = Literal["summarized", "omitted"]


class ThinkingEnabled(_Body):
  type: Literal["enabled"]
  budget_tokens: int = pydantic.Field(ge=1)
  display: Display = "summarized"


class ThinkingDisabled(_Body):
  type: Literal["disabled"]


class ThinkingAdaptive(_Body):
  type: Literal["adaptive"]
  display: Display = "summarized"


class _ThinkingTypeError(_Body):
  """Any other `type` (or none): refused, naming the field `thinking.type`."""
  type: Any = pydantic.Field(None, validate_default=True)

  @pydantic.field_validator("type", mode="before")
  @classmethod
  def _refuse(cls, kind: Any) -> Any:
    if kind == "between_tools":
      raise PydanticCustomError("value_error", "'between_tools' is not supported by this server; use "
                                "'enabled' (with budget_tokens), 'adaptive' or 'disabled'")
    raise PydanticCustomError("literal_error", "Input should be 'enabled', 'disabled' or 'adaptive'")


_THINKING_TAGS = {"enabled": "enabled", "disabled": "thinking[disabled]", "adaptive": "thinking[adaptive]"}


def _thinking_tag(value: Any) -> str:
  kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
  return _THINKING_TAGS.get(kind, "thinking[other]") if isinstance(kind, str) else "thinking[other]"


# Tagged as Anthropic's API tags it: `thinking.enabled.budget_tokens` names the enabled member's
# field; the other members' tags are dropped from error paths (`thinking.display`, `thinking.type`).
Thinking = Annotated[
    Annotated[ThinkingEnabled, Tag("enabled")] | Annotated[ThinkingDisabled, Tag("thinking[disabled]")]
    | Annotated[ThinkingAdaptive, Tag("thinking[adaptive]")]
    | Annotated[_ThinkingTypeError, Tag("thinking[other]")],
    Discriminator(_thinking_tag)]


class OutputFormat(_Body):
  """Structured outputs: the answer text is one JSON document valid under `schema`."""
  type: Literal["json_schema"]
  schema_: dict[str, Any] = pydantic.Field(alias="schema")


class OutputConfig(_Body):
  effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
  format: OutputFormat | None = None


Temperature = Annotated[float, _check(lambda t: 0.0 <= t <= 1.0, "Input should be between 0 and 1")]
TopP = Annotated[float, _check(lambda p: 0.0 < p <= 1.0, "Input should be greater than 0 and at most 1")]
# Every running row scans its stop sequences at each token (on the engine thread): both are capped.
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256


def _stop_sequence(value: Any) -> Any:
  if not isinstance(value, str) or not value.strip():
    raise PydanticCustomError("value_error",
                              "each stop sequence must be a string with non-whitespace characters")
  if len(value) > MAX_STOP_SEQUENCE_CHARS:
    raise PydanticCustomError("value_error", f"each stop sequence must be at most {MAX_STOP_SEQUENCE_CHARS} "
                              f"characters, got {len(value)}.")
  return value


StopSequence = Annotated[Any, AfterValidator(_stop_sequence)]


class CountTokensRequest(_Body):
  """The body of `POST /v1/messages/count_tokens` (no max_tokens, no sampling needed).

  Fields are declared in the order their errors are reported (the first is).
  """
  model: str
  max_tokens: Any = None  # not read by count_tokens
  output_config: OutputConfig | None = None
  thinking: Thinking | None = None
  messages: list[InputMessage] = pydantic.Field(min_length=1)
  system: list[SystemText] | None = None
  tools: list[ToolSpec] | None = None
  tool_choice: ToolChoiceSpec | None = None
  metadata: dict[str, Any] | None = None  # accepted and ignored (user_id is for Anthropic's abuse detection)
  temperature: Temperature = 1.0
  top_p: TopP = 1.0
  top_k: int = pydantic.Field(0, ge=0, le=TOP_K_MAX)
  stop_sequences: list[StopSequence] = []
  stream: bool = False

  @pydantic.field_validator("system", mode="before")
  @classmethod
  def _string_is_text(cls, value: Any) -> Any:
    return _as_blocks(value, "text blocks", empty_is_none=True)

  @pydantic.field_validator("stop_sequences", mode="before")
  @classmethod
  def _few_stop_sequences(cls, value: Any) -> Any:
    # Before the items are validated: a million of them is refused at once.
    if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
      raise PydanticCustomError("value_error", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, "
                                f"got {len(value)}.")
    return value

  @pydantic.field_validator("tools")
  @classmethod
  def _unique_names(cls, tools: list[ToolSpec] | None) -> list[ToolSpec] | None:
    if tools and len({t.name for t in tools}) != len(tools):
      raise PydanticCustomError("value_error", "Tool names must be unique.")
    return tools


class MessagesRequest(CountTokensRequest):
  """The body of `POST /v1/messages`."""
  max_tokens: int = pydantic.Field(ge=1)
