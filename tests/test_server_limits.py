"""No request can stall the server (issue 15 §2): body limit, context bound before tokenizing, images.

A server of its own (the session engine, limits lowered so the test bodies
cross them) runs uvicorn in a thread, as tests/conftest.py's does. One client
streams completions back to back while another posts 10 MB bodies and
prompts just under the body limit but far over the context; the stream's
largest gap between chunks must stay under a second, every big request gets
its 4xx in its API's shape, and no prompt text longer than the context could
hold is ever handed to the tokenizer.
"""

import base64
import copy
import io
import re
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from serving import images

KEY = "test-key"
MODEL = "horizon-tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
MB = 1024 * 1024


@pytest.fixture(scope="module")
def limited(engine, serve_config):
  """The server with an 8 MB body limit and small image limits."""
  from serving.server import BackgroundServer, create_app
  config = copy.deepcopy(serve_config)
  config.serving.max_body_bytes = 8 * MB
  config.serving.max_image_bytes = 1000
  config.serving.max_image_pixels = 100
  server = BackgroundServer(create_app(engine, engine.tokenizer, config)).start().wait_ready()
  yield server
  server.stop()


def _png(size: int, solid: bool = False) -> str:
  rng = np.random.default_rng(size)
  pixels = np.full((size, size, 3), 90, np.uint8) if solid else rng.integers(0, 256, (size, size, 3),
                                                                            dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, format="PNG")
  return base64.b64encode(buf.getvalue()).decode()


class _Streamer(threading.Thread):
  """Streams chat completions back to back until stopped; records every gap between chunks
  (monotonic (start, end)), the first one from the request's start."""

  def __init__(self, url: str):
    super().__init__(daemon=True)
    self.url, self.gaps, self.windows, self.chunks = url, [], [], 0
    self.stop = threading.Event()

  def run(self):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 120,
            "temperature": 1.0, "seed": 0, "stream": True}
    with httpx.Client(timeout=60, headers=AUTH) as client:
      while not self.stop.is_set():
        body["seed"] += 1
        start = last = time.monotonic()
        with client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
          assert r.status_code == 200
          for _ in r.iter_lines():
            now = time.monotonic()
            self.gaps.append((last, now))
            self.chunks += 1
            last = now
        self.windows.append((start, last))


def _post(url, path, headers=None, **kw):
  t0 = time.monotonic()
  r = httpx.post(url + path, headers={**AUTH, **(headers or {})}, timeout=60, **kw)
  return r, time.monotonic() - t0


def _big_requests(url: str) -> list[tuple[str, httpx.Response, float]]:
  """10 MB bodies (declared and chunked) and ~7 MB prompts under the limit, on every route."""
  text = "lorem ipsum " * (7 * MB // 12)
  out = []
  ten = b'{"model": "horizon-tiny", "prompt": "' + b"a" * (10 * MB) + b'"}'
  as_json = {"Content-Type": "application/json"}
  for path in ("/v1/chat/completions", "/v1/messages"):
    out.append((f"10 MB {path}", *_post(url, path, content=ten, headers=as_json)))

    def chunks():
      for i in range(0, len(ten), 256 * 1024):
        yield ten[i:i + 256 * 1024]

    out.append((f"10 MB chunked {path}", *_post(url, path, content=chunks(), headers=as_json)))
  user = [{"role": "user", "content": text}]
  out.append(("7 MB chat", *_post(url, "/v1/chat/completions", json={"model": MODEL, "messages": user})))
  out.append(("7 MB completion", *_post(url, "/v1/completions", json={"model": MODEL, "prompt": text})))
  out.append(("7 MB messages", *_post(url, "/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                                                  "messages": user})))
  out.append(("7 MB count_tokens", *_post(url, "/v1/messages/count_tokens",
                                          json={"model": MODEL, "messages": user})))
  return out


def test_big_requests_do_not_stall_a_stream(limited, engine, monkeypatch):
  longest = []
  encode = engine.tokenizer.encode

  def recording_encode(text, **kw):
    longest.append(len(text))
    return encode(text, **kw)

  monkeypatch.setattr(engine.tokenizer, "encode", recording_encode)
  streamer = _Streamer(limited.url)
  streamer.start()
  while streamer.chunks < 5:  # the stream is flowing
    time.sleep(0.01)
  t0 = time.monotonic()
  results = _big_requests(limited.url)
  t1 = time.monotonic()
  streamer.stop.set()
  streamer.join(timeout=60)
  assert any(a <= t1 and b >= t0 for a, b in streamer.windows), "no stream overlapped the big requests"
  during = [b - a for a, b in streamer.gaps if b >= t0 and a <= t1]  # gaps the big requests could cause
  assert len(during) > 10, "the stream did not run while the big requests were handled"
  print(f"largest stream gap {max(during):.3f} s over {len(during)} chunks in {t1 - t0:.2f} s; refused in "
        + ", ".join(f"{name} {seconds:.2f} s" for name, _, seconds in results))
  assert max(during) < 1.0, f"a stream stalled for {max(during):.2f} s while the big requests were handled"
  for name, r, seconds in results:
    body = r.json()
    if name.startswith("10 MB"):
      assert r.status_code == 413, (name, body)
      message = body["error"]["message"]
      assert "max_body_bytes" in message and "8388608 bytes" in message
    else:
      assert r.status_code == 400, (name, body)
      message = body["error"]["message"]
      assert "context is 256 tokens" in message and "config.serving.max_context" in message
      assert seconds < 2.0, f"{name} took {seconds:.1f} s to be refused"
    if "messages" in name or "count_tokens" in name:
      assert body["type"] == "error" and body["error"]["type"] == ("request_too_large" if r.status_code == 413
                                                                   else "invalid_request_error")
    else:
      assert set(body["error"]) == {"message", "type", "param", "code"}
      if r.status_code == 400:
        assert body["error"]["code"] == "context_length_exceeded"
        assert body["error"]["param"] in ("messages", "prompt")
  # Nothing longer than the context could hold (256 tokens x the longest token) was tokenized.
  ctx = limited.app.state.context
  assert max(longest, default=0) < 256 * ctx.max_token_bytes, max(longest)


def test_prompt_bound_only_refuses_what_cannot_fit(limited):
  """Just under the bound the prompt is tokenized and refused on its real token count."""
  ctx = limited.app.state.context
  # Too long by its tokens, not provably by its length.
  text = ("lorem ipsum " * (256 * ctx.max_token_bytes))[:256 * ctx.max_token_bytes - 40]
  r, _ = _post(limited.url, "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
  assert r.status_code == 400 and "The prompt is" in r.json()["error"]["message"]
  ok, _ = _post(limited.url, "/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 1})
  assert ok.status_code == 200


def _image_chat(url, b64):
  content = [{"type": "text", "text": "What?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}]
  return _post(url, "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": content}]})[0]


def _image_message(url, b64):
  content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
             {"type": "text", "text": "What?"}]
  return _post(url, "/v1/messages", json={"model": MODEL, "max_tokens": 1,
                                          "messages": [{"role": "user", "content": content}]})[0]


@pytest.mark.parametrize("size, solid, limit", [(40, False, "max_image_bytes"),
                                               (12, True, "max_image_pixels")])
def test_images_are_size_bounded(limited, size, solid, limit):
  b64 = _png(size, solid)
  assert (len(base64.b64decode(b64)) > 1000) == (limit == "max_image_bytes")
  r = _image_chat(limited.url, b64)
  err = r.json()["error"]
  assert r.status_code == 400 and limit in err["message"]
  assert err["param"] == "messages[0].content[1].image_url.url"
  r = _image_message(limited.url, b64)
  assert r.status_code == 400 and limit in r.json()["error"]["message"]
  assert r.json()["error"]["message"].startswith("messages.0.content.0.source.data: ")


def test_images_are_decoded_off_the_event_loop(limited, monkeypatch):
  threads = []
  decode = images.decode_image

  def recording_decode(*args, **kw):
    threads.append(threading.current_thread().name)
    return decode(*args, **kw)

  monkeypatch.setattr(images, "decode_image", recording_decode)
  b64 = _png(4)
  assert _image_chat(limited.url, b64).status_code == 200
  assert _image_message(limited.url, b64).status_code == 200
  assert len(threads) == 2 and "horizon-server" not in threads, threads  # the loop's thread


def test_bad_limits_stop_the_server_at_start_up_naming_the_field():
  """default_effort, default_max_tokens and thinking_budgets used to be checked per request only
  (every request then failed, with a 500 or a 400 that blamed the client)."""
  from configs import serve
  from serving.context import Limits
  for field, value, message in (
      ("default_effort", "bogus", "config.serving.default_effort='bogus': choose one of"),
      ("default_max_tokens", 0, "config.serving.default_max_tokens=0: must be a positive int"),
      ("max_tools", -1, "config.serving.max_tools=-1: must be an int >= 0"),
  ):
    config = serve.get_config("tiny")
    config.serving[field] = value
    with pytest.raises(ValueError, match=re.escape(message)):
      Limits.from_config(config.serving)
  config = serve.get_config("tiny")
  config.serving.thinking_budgets.low = -5
  message = "config.serving.thinking_budgets: {'low': -5} must be ints >= 0"
  with pytest.raises(ValueError, match=re.escape(message)):
    Limits.from_config(config.serving)
  assert Limits.from_config(serve.get_config("tiny").serving).default_effort == "none"
