"""The HTTP layer (serving/server.py, openai_api.py, run.py) against a scripted fake engine
(tests/server_fake.py): no model, no compile, so the exact SSE framing, status codes and the engine's
handles after a disconnect or a failed submission are pinned in a few seconds. Mutation testing found
these unchecked.
"""

import json
import time

import httpx
import pytest

from tests.server_fake import AUTH, BAD, CONTEXT, CRASH, FAIL, FULL, HANG, MODEL, SHUTDOWN, start
from tests.server_fake import chat as _chat


@pytest.fixture(scope="module")
def fake(serve_config, tiny_cfg):
  server, engine = start(serve_config, tiny_cfg)
  yield server, engine
  server.stop()


def _sse(url, path, body):
  """The data lines of a streamed response, JSON-decoded ("[DONE]" kept as text)."""
  with httpx.stream("POST", url + path, json=body, headers=AUTH, timeout=10) as r:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    text = r.read().decode()
  events = text.split("\n\n")
  assert events[-1] == "" and all(e.startswith("data: ") and "\n" not in e for e in events[:-1]), text
  return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events[:-1]]


def _choice(chunk):
  (c,) = chunk["choices"]
  return c["index"], c.get("delta", c.get("text")), c["finish_reason"]


def test_chat_stream_frames_usage_and_done(fake):
  server, _ = fake
  lines = _sse(
    server.url,
    "/v1/chat/completions",
    _chat(10, stream=True, stream_options={"include_usage": True}, reasoning_effort="low"),
  )
  assert lines[-1] == "[DONE]"
  *chunks, usage = lines[:-1]
  assert [_choice(c) for c in chunks] == [
    (0, {"role": "assistant", "content": ""}, None),
    (0, {"reasoning_content": "hm", "reasoning": "hm"}, None),
    (0, {"content": "o"}, None),
    (0, {"content": "k"}, None),
    (0, {}, "length"),
  ]
  assert all(c["usage"] is None and c["object"] == "chat.completion.chunk" for c in chunks)
  assert {c["id"] for c in lines[:-1]} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
  assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
  p = usage["usage"]["prompt_tokens"]
  assert p > 0 and usage["usage"] == {
    "prompt_tokens": p,
    "completion_tokens": 3,
    "total_tokens": p + 3,
    "completion_tokens_details": {"reasoning_tokens": 1},
    "prompt_tokens_details": {"cached_tokens": 4},
  }


def test_chat_stream_of_two_choices(fake):
  server, _ = fake
  off = _sse(
    server.url, "/v1/chat/completions", _chat(1, stream=True, stream_options={"include_usage": False})
  )
  assert [c["choices"][0]["finish_reason"] for c in off[:-1]] == [None, None, None, "stop"]
  assert off[-1] == "[DONE]" and all("usage" not in c for c in off[:-1])
  lines = _sse(server.url, "/v1/chat/completions", _chat(1, n=2, stream=True))
  assert lines[-1] == "[DONE]" and all("usage" not in c for c in lines[:-1])
  got = [_choice(c) for c in lines[:-1]]
  assert got[:2] == [
    (0, {"role": "assistant", "content": ""}, None),
    (1, {"role": "assistant", "content": ""}, None),
  ]
  for i in (0, 1):  # each choice's own deltas in order, then its one finish chunk last
    assert [g[1:] for g in got[2:] if g[0] == i] == [
      ({"content": f"A{1 + i}"}, None),
      ({"content": "b"}, None),
      ({}, "stop"),
    ]


def test_completion_stream_with_echo_and_usage(fake):
  server, _ = fake
  body = {
    "model": MODEL,
    "prompt": "Say",
    "max_tokens": 4,
    "seed": 3,
    "echo": True,
    "stream": True,
    "stream_options": {"include_usage": True},
  }
  lines = _sse(server.url, "/v1/completions", body)
  assert lines[-1] == "[DONE]"
  assert [_choice(c) for c in lines[:-2]] == [
    (0, "Say", None),
    (0, "A3", None),
    (0, "b", None),
    (0, "", "stop"),
  ]
  assert lines[0]["object"] == "text_completion" and lines[0]["usage"] is None
  usage = lines[-2]["usage"]
  assert lines[-2]["choices"] == [] and usage["completion_tokens"] == 2
  assert (
    usage["total_tokens"] == usage["prompt_tokens"] + 2
    and usage["prompt_tokens_details"]["cached_tokens"] == 3
  )
  plain = _sse(server.url, "/v1/completions", {**body, "echo": False, "stream_options": None})
  assert [_choice(c) for c in plain[:-1]] == [(0, "A3", None), (0, "b", None), (0, "", "stop")]


def test_non_streaming_bodies(fake):
  server, _ = fake
  r = httpx.post(server.url + "/v1/chat/completions", json=_chat(5, n=2), headers=AUTH).json()
  assert [c["message"]["content"] for c in r["choices"]] == ["A5b", "A6b"]
  assert [c["finish_reason"] for c in r["choices"]] == ["stop", "stop"]
  u = r["usage"]
  assert (u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]) == (4, 5)  # summed; fewest
  c = httpx.post(
    server.url + "/v1/completions",
    json={"model": MODEL, "prompt": ["p", "q"], "n": 2, "seed": 7, "max_tokens": 3},
    headers=AUTH,
  ).json()
  assert [x["text"] for x in c["choices"]] == ["A7b", "A8b", "A7b", "A8b"] and [
    x["index"] for x in c["choices"]
  ] == [0, 1, 2, 3]
  assert c["usage"]["completion_tokens"] == 8


def _stream_body(path, seed):
  """A streamed request to `path` whose generation the fake engine scripts by `seed`."""
  if "chat" in path:
    return _chat(seed, stream=True)
  return {"model": MODEL, "prompt": "x", "seed": seed, "stream": True, "max_tokens": 2}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_failed_generation_ends_the_stream_with_an_error_event(fake, path):
  server, _ = fake
  body = _stream_body(path, FAIL)
  lines = _sse(server.url, path, body)
  assert "[DONE]" not in lines and lines[-1] == {
    "error": {
      "message": "Generation failed inside the engine (see the server log); retry the request.",
      "type": "server_error",
      "param": None,
      "code": None,
    }
  }
  assert all(c["choices"][0]["finish_reason"] is None for c in lines[:-1])


@pytest.mark.parametrize(
  "seed, status, etype, code",
  [
    (FAIL, 500, "server_error", None),
    (SHUTDOWN, 503, "server_error", "unavailable"),
    (FULL, 429, "rate_limit_error", "overloaded"),
    (BAD, 400, "invalid_request_error", None),
    (CRASH, 500, "server_error", None),
  ],
)
def test_status_of_each_failure(fake, seed, status, etype, code):
  server, _ = fake
  for path, body in (
    ("/v1/chat/completions", _chat(seed)),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": seed, "max_tokens": 2}),
  ):
    r = httpx.post(server.url + path, json=body, headers=AUTH)
    err = r.json()["error"]
    assert (r.status_code, err["type"], err["code"]) == (status, etype, code), (path, r.text)
    assert err["param"] == ("top_k" if seed == BAD else None)
  if seed == BAD:
    assert err["message"] == "top_k is too big"
  if seed == CRASH:
    assert err["message"] == "Internal server error (KeyError)."


def test_a_failed_second_submission_cancels_the_first(fake):
  """n=2 whose second choice is refused (seed FULL = 39 + 1): the first choice's slot is given back."""
  server, engine = fake
  r = httpx.post(server.url + "/v1/chat/completions", json=_chat(FULL - 1, n=2), headers=AUTH)
  assert r.status_code == 429
  assert engine.handles[-1].request.params.seed == FULL - 1 and engine.handles[-1].cancelled
  too_long = [5] * CONTEXT  # the second prompt leaves no room: 400, after the first was submitted
  r = httpx.post(
    server.url + "/v1/completions",
    json={"model": MODEL, "prompt": [[5], too_long], "seed": FULL - 1, "max_tokens": 2},
    headers=AUTH,
  )
  assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
  assert engine.handles[-1].request.prompt_ids == [5] and engine.handles[-1].cancelled


def _wait_freed(engine, before):
  deadline = time.monotonic() + 10
  while len(engine.freed) == before or engine.running_handles():
    assert time.monotonic() < deadline, "the engine slot was not freed after the client left"
    time.sleep(0.02)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_that_leaves_frees_the_engine_slot(fake, path):
  server, engine = fake
  body = _stream_body(path, HANG)
  before = len(engine.freed)
  with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=10) as r:
    next(r.iter_lines())
  _wait_freed(engine, before)
  before = len(engine.freed)
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(
      server.url + path, json={**body, "stream": False}, headers=AUTH, timeout=httpx.Timeout(5, read=0.3)
    )
  _wait_freed(engine, before)
  assert engine.freed[-1] == HANG


def test_completion_prompts_as_token_ids(fake):
  server, _ = fake
  vocab = server.app.state.context.tokenizer.vocab_size

  def post(prompt, n=1, **kw):
    body = {"model": MODEL, "prompt": prompt, "n": n, "seed": 1, "max_tokens": 1, **kw}
    return httpx.post(server.url + "/v1/completions", json=body, headers=AUTH)

  assert post([[vocab - 1]]).status_code == 200
  for bad in ([[vocab]], [[]], [[5], [-1]]):
    r = post(bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", bad
    assert f"token ids must be a non-empty list of ints in [0, {vocab})" in r.json()["error"]["message"]
  # generations are prompts x n: 4 x 16 is the most
  assert post([[5]] * 4, n=16).status_code == 200 and post([[5]] * 5, n=13).status_code == 400
  assert post([[5, 6], [7]]).json()["usage"]["prompt_tokens"] == 3  # every prompt's tokens
  # echo gives back the prompt's text; only a leading <|bos|> is left out
  assert post([1, 2], echo=True).json()["choices"][0]["text"] == '"#A1b'
