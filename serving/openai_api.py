"""OpenAI-compatible routes: POST /v1/chat/completions and POST /v1/completions.

Shapes follow OpenAI's API reference so the official SDK (and middleware
written for it) works by changing only the base URL:
  * responses: `chat.completion` / `text_completion` with `choices`,
    `finish_reason` (stop / length / tool_calls) and `usage` including
    `completion_tokens_details.reasoning_tokens` (thinking counts against
    max_tokens, as OpenAI's reasoning models count it);
  * streaming: SSE `chat.completion.chunk`s -- a first chunk with the role, then
    `content`, `reasoning_content` + `reasoning` (both names of the
    thinking delta in use by OpenAI-compatible servers; clients read either),
    `tool_calls` deltas (index, id, type and name first, then argument
    fragments), a chunk with the finish_reason per choice, the usage chunk
    (`stream_options.include_usage`, empty choices) and `data: [DONE]`.
  * the thinking is generated inside the same turn (chat format in
    serving/chat.py) and returned as `reasoning_content`; a client sends it back
    on the assistant message and it is rendered back (history retention).

Length limits are checked before submitting, naming the field: the prompt must
leave room for at least one token (`messages` / `prompt`), and an explicit
max_(completion_)tokens must fit the rest of the context. Without one, the
answer may use `config.serving.default_max_tokens`, cut to what fits.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import fastapi
from starlette.concurrency import run_in_threadpool

from serving import prepare, run
from serving.api_common import effort_thinking, generation_failure
from serving.context import Context, Limits, ServerContext
from serving.errors import APIError
from serving.openai_request import (
  ChatRequest,
  CompletionRequest,
  ImageDecoder,
  convert_messages,
  convert_tools,
  refuse_unsupported,
  response_format,
  stop_strings,
)
from serving.run import EventStreamResponse, sse
from serving.types import SamplingParams, TextDelta, ThinkingDelta, ToolCallDelta, ToolChoice, Usage

router = fastapi.APIRouter()

ARG_FRAGMENT = 16  # characters of tool-call arguments per streamed delta


@dataclasses.dataclass
class _Reply:
  """What every chunk / response of one request repeats."""
  id: str
  object: str
  created: int
  model: str
  prompt_tokens: int

  def head(self) -> dict[str, Any]:
    return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
            "system_fingerprint": None}


def usage_json(prompt_tokens: int, usages: Sequence[Usage]) -> dict[str, Any]:
  """OpenAI usage over the choices: the prompt counted once, completions summed; cached tokens are
  the prompt tokens every choice loaded from the prefix cache (the fewest over the choices)."""
  completion = sum(u.completion_tokens for u in usages)
  reasoning = sum(u.thinking_tokens for u in usages)
  cached = min((u.cached_tokens for u in usages), default=0)
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
          "total_tokens": prompt_tokens + completion,
          "completion_tokens_details": {"reasoning_tokens": reasoning},
          "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(reason: str) -> str:
  """Engine reason -> OpenAI's (the same names); 'error'/'cancelled' never reach a client as a finish."""
  error = generation_failure(reason)
  if error is not None:
    raise error
  return reason


def max_tokens_for(limits: Limits, prompt_len: int, given: int | None, param: str, prompt_param: str) -> int:
  """The request's max_tokens, checked against the context (400s name the field)."""
  context = limits.max_context
  if prompt_len >= context:
    raise APIError(400, f"The prompt is {prompt_len} tokens, but this model's context is {context} tokens "
                   "(config.serving.max_context) and must leave room for at least one generated "
                   "token; shorten the input.", param=prompt_param, code="context_length_exceeded")
  room = context - prompt_len
  if given is None:
    return min(limits.default_max_tokens, room)
  if given > room:
    raise APIError(400, f"{param}={given} plus the prompt's {prompt_len} tokens exceeds this model's "
                   f"context of {context} tokens; ask for at most {room}.", param=param,
                   code="context_length_exceeded")
  return given


def sampling_params(body, max_tokens: int, i: int) -> SamplingParams:
  """Choice i's parameters: n > 1 gives n independent generations with seeds seed + i."""
  return SamplingParams(max_tokens=max_tokens,
                        temperature=1.0 if body.temperature is None else float(body.temperature),
                        top_p=1.0 if body.top_p is None else float(body.top_p), top_k=body.top_k or 0,
                        seed=None if body.seed is None else body.seed + i)


def _submit_all(ctx: ServerContext, prompt_ids, images, body, max_tokens: int, make_processor) -> list[Any]:
  handles = []
  try:
    for i in range(body.n):
      handles.append(run.submit(ctx, prompt_ids, images, make_processor(),
                                     sampling_params(body, max_tokens, i)))
  except BaseException:
    for h in handles:
      h.cancel()
    raise
  return handles


# ------------------------------------------------------------------ chat --


def _message_json(r: run.Result, thinking: bool) -> dict[str, Any]:
  msg: dict[str, Any] = {"role": "assistant", "content": r.text if (r.text or not r.tool_calls) else None,
                         "refusal": None}
  if thinking:
    msg["reasoning_content"] = msg["reasoning"] = r.thinking
  if r.tool_calls:
    msg["tool_calls"] = [{"id": c.id, "type": "function",
                          "function": {"name": c.name, "arguments": c.arguments}} for c in r.tool_calls]
  return msg


def _delta_json(d) -> list[dict[str, Any]]:
  """One Delta -> the chunk deltas carrying it (a tool call: its header, then argument fragments)."""
  if isinstance(d, ThinkingDelta):
    return [{"reasoning_content": d.text, "reasoning": d.text}]
  if isinstance(d, TextDelta):
    return [{"content": d.text}]
  if isinstance(d, ToolCallDelta):
    c = d.call
    out = [{"tool_calls": [{"index": d.index, "id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": ""}}]}]
    for k in range(0, len(c.arguments), ARG_FRAGMENT):
      fragment = c.arguments[k:k + ARG_FRAGMENT]
      out.append({"tool_calls": [{"index": d.index, "function": {"arguments": fragment}}]})
    return out
  raise TypeError(f"unknown delta {d!r}")


async def _chat_stream(handles, reply: _Reply, include_usage: bool) -> AsyncIterator[str]:
  extra = {"usage": None} if include_usage else {}

  def chunk(i: int, delta: dict[str, Any], finish: str | None = None) -> str:
    return sse({**reply.head(), "choices": [{"index": i, "delta": delta, "logprobs": None,
                                             "finish_reason": finish}], **extra})

  for i in range(len(handles)):
    yield chunk(i, {"role": "assistant", "content": ""})
  async for line in _choice_stream(handles, reply, include_usage, chunk, {},
                                   lambda ev: [x for d in ev.deltas for x in _delta_json(d)]):
    yield line


async def _choice_stream(handles, reply: _Reply, include_usage: bool, chunk, empty,
                         pieces) -> AsyncIterator[str]:
  """The per-event part of both streams: pieces(event) as chunks, a finish chunk per choice,
  the usage chunk, [DONE]; an engine failure ends the stream with an error event."""
  usages = []
  async for i, event in run.merge_streams(handles):
    for piece in pieces(event):
      yield chunk(i, piece)
    if event.finish_reason is not None:
      error = generation_failure(event.finish_reason)
      if error is not None:
        yield sse({"error": {"message": error.message, "type": "server_error", "param": None, "code": None}})
        return
      usages.append(event.usage)
      yield chunk(i, empty, event.finish_reason)
  if include_usage:
    yield sse({**reply.head(), "choices": [], "usage": usage_json(reply.prompt_tokens, usages)})
  yield sse("[DONE]")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: fastapi.Request, ctx: Context):
  """OpenAI Chat Completions (https://platform.openai.com/docs/api-reference/chat/create)."""
  limits = ctx.limits
  prepare.check_model(ctx, body.model)
  refuse_unsupported(body)
  stops = stop_strings(body.stop)
  thinking = effort_thinking(body.reasoning_effort, limits)
  tools, choice = convert_tools(body, limits.max_tools)
  fmt = response_format(body)
  decoder = ImageDecoder(ctx.model_cfg.vision, limits.max_images, limits.max_image_bytes,
                         limits.max_image_pixels)
  messages = await run_in_threadpool(convert_messages, body.messages, decoder)
  cont = body.continue_final_message
  if cont and thinking.on:
    raise APIError(400, "continue_final_message cannot be combined with reasoning_effort (thinking): the "
                   "continued answer would have no thinking.", param="continue_final_message")
  if cont and fmt is not None:
    raise APIError(400, "continue_final_message cannot be combined with a JSON response_format: the "
                   "document would start in the prefill, outside the constraint.", param="response_format")
  rendered = await run_in_threadpool(prepare.render, ctx, messages, tools=tools, thinking=thinking.on,
                                     effort=thinking.effort, continue_final=cont)
  prepare.check_images(ctx, len(rendered.images), "messages")
  if body.max_completion_tokens is not None:
    given, param = body.max_completion_tokens, "max_completion_tokens"
  else:
    given, param = body.max_tokens, "max_tokens"
  max_tokens = max_tokens_for(limits, len(rendered.ids), given, param, "messages")

  def processor():
    return prepare.make_processor(ctx, thinking=thinking.on, thinking_budget=thinking.budget, stop=stops,
                                   tools=tools, tool_choice=choice, call_id_prefix="call_",
                                   response_format=fmt)

  handles = _submit_all(ctx, rendered.ids, rendered.images, body, max_tokens, processor)
  reply = _Reply(f"chatcmpl-{secrets.token_hex(12)}", "chat.completion", int(time.time()),
                 ctx.model_name, len(rendered.ids))
  if body.stream:
    reply.object = "chat.completion.chunk"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventStreamResponse(_chat_stream(handles, reply, include_usage), handles)
  results = await run.collect_all(handles, request)
  choices = [{"index": i, "message": _message_json(r, thinking.on), "logprobs": None,
              "finish_reason": _finish_reason(r.finish_reason)} for i, r in enumerate(results)]
  return {**reply.head(), "choices": choices,
          "usage": usage_json(reply.prompt_tokens, [r.usage for r in results])}


# ----------------------------------------------------------- completions --


def _prompts(ctx: ServerContext, body: CompletionRequest) -> list[list[int]]:
  """`prompt` as token-id lists: strings get <|bos|> + their text ids; id lists are used as given.

  Tokenizes: called off the event loop; a string too long for the context by its length alone
  is refused before it is tokenized.
  """
  p = body.prompt
  if isinstance(p, str):
    p = [p]
  if not p:
    raise APIError(400, "prompt: must not be empty.", param="prompt")
  if all(isinstance(x, str) for x in p):
    for x in p:
      prepare.refuse_too_long(ctx, len(x), 1, "prompt")  # + <|bos|>
    return [ctx.renderer.render_completion_prompt(x) for x in p]
  if all(isinstance(x, int) for x in p):
    p = [p]
  vocab = ctx.tokenizer.vocab_size
  for j, ids in enumerate(p):
    if not ids or any(not 0 <= t < vocab for t in ids):
      raise APIError(400, f"prompt[{j}]: token ids must be a non-empty list of ints in [0, {vocab}).",
                     param="prompt")
  return [list(ids) for ids in p]


async def _completion_stream(handles, echoes: list[str], reply: _Reply,
                             include_usage: bool) -> AsyncIterator[str]:
  extra = {"usage": None} if include_usage else {}

  def chunk(i: int, text: str, finish: str | None = None) -> str:
    return sse({**reply.head(), "choices": [{"index": i, "text": text, "logprobs": None,
                                             "finish_reason": finish}], **extra})

  for i, text in enumerate(echoes):
    if text:
      yield chunk(i, text)

  def text_of(event) -> list[str]:
    text = "".join(d.text for d in event.deltas if isinstance(d, TextDelta))
    return [text] if text else []

  async for line in _choice_stream(handles, reply, include_usage, chunk, "", text_of):
    yield line


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: fastapi.Request, ctx: Context):
  """OpenAI (legacy) Completions: raw text continuation, no chat template, no thinking."""
  prepare.check_model(ctx, body.model)
  refuse_unsupported(body)
  stops = stop_strings(body.stop)
  prompts = await run_in_threadpool(_prompts, ctx, body)
  if len(prompts) * body.n > 64:
    raise APIError(400, f"{len(prompts)} prompts x n={body.n} = {len(prompts) * body.n} generations; at "
                   "most 64 per request.", param="prompt")

  def processor():
    return prepare.make_processor(ctx, thinking=False, thinking_budget=None, stop=stops,
                                   tool_choice=ToolChoice("none"))

  groups = []
  try:
    for ids in prompts:
      max_tokens = max_tokens_for(ctx.limits, len(ids), body.max_tokens, "max_tokens", "prompt")
      echo = ctx.tokenizer.decode(ids[1:] if ids[0] == ctx.tokenizer.bos_id else ids) if body.echo \
          else ""
      groups.append((_submit_all(ctx, ids, None, body, max_tokens, processor), echo))
  except BaseException:
    for hs, _ in groups:
      for h in hs:
        h.cancel()
    raise
  handles = [h for hs, _ in groups for h in hs]
  echoes = [t for hs, t in groups for _ in hs]
  reply = _Reply(f"cmpl-{secrets.token_hex(12)}", "text_completion", int(time.time()),
                 ctx.model_name, sum(len(ids) for ids in prompts))
  if body.stream:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventStreamResponse(_completion_stream(handles, echoes, reply, include_usage), handles)
  results = await run.collect_all(handles, request)
  choices = [{"index": i, "text": echoes[i] + r.text, "logprobs": None,
              "finish_reason": _finish_reason(r.finish_reason)} for i, r in enumerate(results)]
  return {**reply.head(), "choices": choices,
          "usage": usage_json(reply.prompt_tokens, [r.usage for r in results])}

