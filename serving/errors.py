"""Errors as each vendor's SDK expects them: `APIError`, the two error bodies, validation messages.

Agent middleware branches on error bodies and status codes, so they follow
the vendors' documented shapes: Anthropic's `{"type": "error", "error":
{"type", "message"}}` (https://docs.anthropic.com/en/api/errors) on
`/v1/messages*`, OpenAI's `{"error": {"message", "type", "param", "code"}}`
everywhere else. A handler raises `APIError` naming the field at fault; the
server (serving/server.py) shapes it by the path of the request.

Request bodies of both APIs are pydantic models (serving/openai_request.py,
serving/anthropic_schema.py); `validation_message` turns the first pydantic
error into the message each vendor writes: `messages[0].role: ...` with the
field as `param` (OpenAI), `messages.0.role: ...` (Anthropic, whose own API
is pydantic-based and names fields this way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse

from serving.handle import OverloadedError, RequestError

# What `Engine.submit` raises for a request; the server maps them with `engine_error`.
ENGINE_ERRORS: tuple[type[Exception], ...] = (RequestError, OverloadedError)

# Anthropic error types by status (docs.anthropic.com "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                    529: "overloaded_error"}
# OpenAI (type, code) by status when the raiser gave none.
_OPENAI_TYPES = {400: ("invalid_request_error", None), 401: ("authentication_error", "invalid_api_key"),
                 403: ("permission_error", None), 404: ("not_found_error", "not_found"),
                 405: ("invalid_request_error", "method_not_allowed"),
                 413: ("invalid_request_error", "request_too_large"),
                 429: ("rate_limit_error", "overloaded"), 500: ("server_error", None),
                 503: ("server_error", "unavailable")}
# Pydantic names the union member it tried ("str", "list[...]", "function-after[...]"), and the tag
# of a discriminated union (serving/anthropic_schema.py tags content blocks "block[text]", ...) in
# an error's location; neither is a field of the request.
_MEMBER_NAMES = ("str", "int", "float", "list", "dict", "bool")


class APIError(Exception):
  """An error for the client; the server shapes it by path (OpenAI or Anthropic).

  Args:
    status: HTTP status.
    message: what went wrong and how to fix it.
    param: the request field at fault (OpenAI `param`; prefixed to the message for Anthropic).
    code: OpenAI `code` (e.g. "invalid_api_key"; "overloaded" also selects Anthropic's 529).
    type: OpenAI `type` override (default by status).
  """

  def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
               type: str | None = None):  # noqa: A002 (the field's name in both APIs)
    super().__init__(message)
    self.status = status
    self.message = message
    self.param = param
    self.code = code
    self.type = type


def engine_error(exc: Exception) -> APIError:
  """RequestError -> 400 naming its param; OverloadedError -> 429 (OpenAI) / 529 (Anthropic)."""
  if isinstance(exc, OverloadedError):
    return APIError(429, f"The server is overloaded: {exc}. Retry later.", code="overloaded")
  return APIError(400, str(getattr(exc, "message", None) or exc), param=getattr(exc, "param", None))


def is_anthropic_path(path: str) -> bool:
  """Routes that answer in Anthropic's shapes: the Messages API and its count_tokens."""
  return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_response(path: str, status: int, message: str, *, param: str | None = None,
                   code: str | None = None, type_: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
  """An error in the shape of the API `path` belongs to.

  Anthropic has no `param`, so it is folded into the message there. Overload is
  429 for OpenAI and 529 `overloaded_error` for Anthropic (each vendor's own).
  """
  if is_anthropic_path(path):
    if code == "overloaded":
      status = 529
    a_type = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    if param and param not in message:
      message = f"{param}: {message}"
    body = {"type": "error", "error": {"type": a_type, "message": message}}
  else:
    d_type, d_code = _OPENAI_TYPES.get(status, ("invalid_request_error" if status < 500 else "server_error",
                                               None))
    body = {"error": {"message": message, "type": type_ or d_type, "param": param, "code": code or d_code}}
  return JSONResponse(body, status_code=status, headers=headers)


def loc_to_param(loc: Sequence[Any], anthropic: bool) -> str | None:
  """('body', 'messages', 0, 'role') -> 'messages[0].role' (OpenAI) or 'messages.0.role' (Anthropic)."""
  parts = [p for p in loc if p != "body"]
  # Drop pydantic's union-member tags: "str", "function-after[...]", and model class names
  # (CamelCase; both APIs' JSON fields are snake_case): tool_choice.NamedToolChoice.type is
  # the client's tool_choice.type.
  tag = lambda p: isinstance(p, str) and ("[" in p or p in _MEMBER_NAMES or p[:1].isupper())  # noqa: E731
  parts = [p for p in parts if not tag(p)]
  if not parts:
    return None
  if anthropic:
    return ".".join(str(p) for p in parts)
  out = ""
  for p in parts:
    out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
  return out


def validation_message(errors: Sequence[dict[str, Any]], *, anthropic: bool) -> tuple[str, str | None]:
  """(message, param) for a pydantic validation failure of a request body, in the vendor's words.

  The first error names the field. OpenAI's message counts the others
  ("... (and 2 more errors)"); Anthropic's reports the first only and says
  "a valid dictionary" where pydantic names our model class. `param` is None
  when the body as a whole is wrong (not JSON, not an object).
  """
  if not errors:
    return "Invalid request body.", None
  first = errors[0]
  msg = first.get("msg", "invalid value")
  if first.get("type") == "json_invalid":
    return f"The request body is not valid JSON: {msg}.", None
  param = loc_to_param(tuple(first.get("loc", ())), anthropic)
  if anthropic:
    if first.get("type") == "model_type":
      msg = "Input should be a valid dictionary"
    return (f"{param}: {msg}" if param else msg), param
  if param is None:  # the body as a whole: not a JSON object (or no JSON content type)
    return (f"The request body must be a JSON object sent with Content-Type: application/json ({msg}).",
            None)
  more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
  return f"{param}: {msg}{more}", param
