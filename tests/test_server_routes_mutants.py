"""The routes around generation (serving/server.py): API-key forms, the body limit at its boundary,
/v1/models, /health, 404/405 and validation errors in the OpenAI shape, and start-up on a taken port;
served over the scripted fake engine of tests/server_fake.py. Mutation testing found these unchecked.
"""

import socket
import time

import httpx
import pytest

from serving.server import BackgroundServer
from tests.server_fake import AUTH, CONTEXT, LIMIT, MODEL, start
from tests.server_fake import chat as _chat


@pytest.fixture(scope="module")
def fake(serve_config, tiny_cfg):
  server, engine = start(serve_config, tiny_cfg)
  yield server, engine
  server.stop()


def test_api_key_forms(fake):
  server, _ = fake
  url = server.url + "/v1/models"

  def status(**headers):
    return httpx.get(url, headers=headers).status_code

  assert status(authorization="bearer k") == 200 and status(authorization="Bearer   k") == 200
  assert status(**{"x-api-key": "k"}) == 200 and status(authorization="Bearer k", **{"x-api-key": ""}) == 200
  assert status(authorization="Bearer k", **{"x-api-key": "wrong"}) == 401  # x-api-key is read first
  assert status(authorization="k") == 401 and status(authorization="Basic k") == 401
  assert status(authorization="Bearer kk") == 401
  missing = httpx.get(url).json()["error"]
  assert missing == {
    "message": "No API key provided: send `Authorization: Bearer KEY` or `x-api-key: KEY`.",
    "type": "authentication_error",
    "param": None,
    "code": "invalid_api_key",
  }
  for wrong in ({"x-api-key": "no"}, {"authorization": "Bearer no"}):
    assert httpx.get(url, headers=wrong).json()["error"]["message"] == "Incorrect API key provided."
  assert httpx.get(server.url + "/health").status_code == 200  # open, and only it
  assert httpx.get(server.url + "/healthz").status_code == 401
  assert httpx.get(server.url + "/metrics").status_code == 401
  a = httpx.post(server.url + "/v1/messages/count_tokens", json={})
  assert (
    a.status_code == 401
    and a.json()["error"]["type"] == "authentication_error"
    and a.json()["type"] == "error"
  )


@pytest.mark.parametrize("chunked", [False, True])
def test_body_limit_is_inclusive(fake, chunked):
  server, _ = fake

  def post(n):
    body = b"{" + b" " * (n - 2) + b"}"
    content = iter([body[: n // 2], body[n // 2 :]]) if chunked else body
    return httpx.post(
      server.url + "/v1/chat/completions",
      content=content,
      headers={**AUTH, "Content-Type": "application/json"},
    )

  at = post(LIMIT)
  assert (
    at.status_code == 400 and at.json()["error"]["param"] == "model"
  )  # parsed: the limit itself is allowed
  over = post(LIMIT + 1)
  assert over.status_code == 413 and over.json()["error"] == {
    "message": f"Request body exceeds the server's limit of {LIMIT} bytes (config.serving.max_body_bytes).",
    "type": "invalid_request_error",
    "param": None,
    "code": "request_too_large",
  }


def test_models_and_model_card(fake):
  server, _ = fake
  listed = httpx.get(server.url + "/v1/models", headers=AUTH).json()
  (card,) = listed["data"]
  assert (listed["object"], listed["has_more"], listed["first_id"], listed["last_id"]) == (
    "list",
    False,
    MODEL,
    MODEL,
  )
  assert {k: card[k] for k in ("id", "object", "type", "display_name", "max_input_tokens", "max_tokens")} == {
    "id": MODEL,
    "object": "model",
    "type": "model",
    "display_name": MODEL,
    "max_input_tokens": CONTEXT,
    "max_tokens": CONTEXT,
  }
  assert card["created_at"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(card["created"]))
  assert abs(card["created"] - time.time()) < 600
  assert httpx.get(server.url + f"/v1/models/{MODEL}", headers=AUTH).json() == card
  gone = httpx.get(server.url + "/v1/models/org/horizon-tiny", headers=AUTH)
  assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
  assert gone.json()["error"]["param"] == "model" and "'org/horizon-tiny'" in gone.json()["error"]["message"]
  assert httpx.get(server.url + "/v1/models/horizon", headers=AUTH).status_code == 404  # a part is not it


def test_health_follows_the_engine(fake):
  server, engine = fake
  ok = httpx.get(server.url + "/health")
  assert ok.status_code == 200 and ok.json()["status"] == "ok" and "retry-after" not in ok.headers
  engine.running = False
  try:
    down = httpx.get(server.url + "/health")
  finally:
    engine.running = True
  assert down.status_code == 503 and down.headers["retry-after"] == "5"
  assert down.json()["status"] == "engine stopped"
  head = httpx.head(server.url + "/health")  # load balancers probing with HEAD got 405
  assert head.status_code == 200 and head.content == b""


def _openai_error(message, type_, code):
  return {"message": message, "type": type_, "param": None, "code": code}


def test_unknown_routes_and_methods(fake):
  server, _ = fake
  nope = httpx.post(server.url + "/v1/nope", json={}, headers=AUTH)
  assert nope.status_code == 404 and nope.json()["error"] == _openai_error(
    "Invalid URL (POST /v1/nope): no such route.", "not_found_error", "not_found")
  a = httpx.get(server.url + "/v1/messages/nope", headers=AUTH)
  assert a.status_code == 404 and a.json() == {
    "type": "error",
    "error": {"type": "not_found_error", "message": "Invalid URL (GET /v1/messages/nope): no such route."},
  }
  wrong = httpx.get(server.url + "/v1/completions", headers=AUTH)
  assert wrong.status_code == 405 and wrong.json()["error"] == _openai_error(
    "Method GET is not allowed on /v1/completions.", "invalid_request_error", "method_not_allowed")
  a405 = httpx.get(server.url + "/v1/messages", headers=AUTH)
  assert a405.status_code == 405 and a405.json()["error"]["type"] == "invalid_request_error"


def test_validation_errors_are_400_naming_the_first_field(fake):
  server, _ = fake
  r = httpx.post(
    server.url + "/v1/chat/completions",
    json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": "two", "seed": "one"},
    headers=AUTH,
  )
  err = r.json()["error"]
  assert r.status_code == 400 and err["type"] == "invalid_request_error"
  assert err["param"] == "seed" and err["message"].endswith(" (and 1 more errors)"), err
  c = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [5, 10**9]}, headers=AUTH)
  assert c.status_code == 400 and c.json()["error"]["param"] == "prompt"
  # An unknown model is a 404 whose type is the raiser's (OpenAI's): invalid_request_error.
  m = httpx.post(server.url + "/v1/chat/completions", json={**_chat(1), "model": "gpt-4o"}, headers=AUTH)
  assert m.status_code == 404 and m.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("n, status", [(64, 200), (65, 400)])
def test_at_most_64_completions_per_request(fake, n, status):
  server, _ = fake
  r = httpx.post(
    server.url + "/v1/completions",
    json={"model": MODEL, "prompt": [[5]] * n, "seed": 1, "max_tokens": 1},
    headers=AUTH,
  )
  assert r.status_code == status, r.text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn's SystemExit
def test_start_fails_clearly_on_a_taken_port(fake):
  server, _ = fake
  port = int(server.url.rsplit(":", 1)[1])
  other = BackgroundServer(server.app, port=port)
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match="did not start"):
    other.start(timeout=60)
  assert time.monotonic() - t0 < 10  # at once, not at the deadline
  with socket.socket() as s:  # the first server still serves
    s.connect(("127.0.0.1", port))
