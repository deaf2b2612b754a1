"""A scripted stand-in for serving.engine.Engine behind the real app (create_app), for the HTTP tests
(tests/test_server_http_mutants.py, tests/test_server_routes_mutants.py): no model, no compile.

The fake engine ignores the prompt: the request's seed picks a script of events (`script`); a handle
cancelled while its generation runs gets the engine's final 'cancelled' event at the next `_wake`,
and its seed is recorded in `engine.freed`.
"""

import copy
import threading

from serving.handle import Event, Handle, OverloadedError, RequestError
from serving.metrics import EngineMetrics
from serving.server import BackgroundServer, create_app
from serving.types import TextDelta, ThinkingDelta, Usage

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "horizon-tiny"
LIMIT = 4000  # max_body_bytes of this server
CONTEXT = 256  # configs/serve.py:tiny max_context
HANG, FAIL, SHUTDOWN, FULL, BAD, CRASH = 20, 30, 31, 40, 41, 70


def ev(*deltas, finish=None, usage=None):
  return Event(token_ids=[1] * len(deltas), deltas=list(deltas), finish_reason=finish, usage=usage, time=0.0)


def script(seed):
  """The events of a generation with this seed (HANG, FULL - 1: no final event; it runs until cancelled)."""
  if seed in (HANG, FULL - 1):
    return [ev(TextDelta("x"))]
  if seed in (FAIL, SHUTDOWN):
    return [
      ev(TextDelta("x")),
      ev(finish="error" if seed == FAIL else "cancelled", usage=Usage(9, 1)),
    ]
  if seed == 10:  # thinking, then text (two deltas in one event), cut by max_tokens
    return [
      ev(ThinkingDelta("hm"), TextDelta("o")),
      ev(TextDelta("k")),
      ev(finish="length", usage=Usage(9, 3, 1, 4)),
    ]
  return [
    ev(TextDelta(f"A{seed}")),
    ev(TextDelta("b")),
    ev(finish="stop", usage=Usage(9, 2, 0, seed)),
  ]


class FakeEngine:
  """What create_app and the routes use of serving.engine.Engine."""

  def __init__(self, cfg):
    self.cfg, self.running = cfg, True
    self.metrics = EngineMetrics(slots=2, max_context=64)
    self.handles, self.freed = [], []
    self.lock = threading.Lock()

  def submit(self, request, loop=None):
    seed = request.params.seed
    if seed == FULL:
      raise OverloadedError("4 requests wait")
    if seed == BAD:
      raise RequestError("top_k is too big", "top_k")
    if seed == CRASH:
      raise KeyError("boom")
    h = Handle(self, request, loop)
    events = script(seed)
    with self.lock:
      self.handles.append(h)
    for ev in events:
      h._deliver(ev)
    return h

  def _wake(self):
    with self.lock:
      for h in self.handles:
        if h.cancelled and not h.done:
          self.freed.append(h.request.params.seed)
          h._deliver(ev(finish="cancelled", usage=Usage(9, 1)))

  def running_handles(self):
    with self.lock:
      return [h for h in self.handles if not h.done]


def start(serve_config, model_cfg):
  """(server, engine): the app over a FakeEngine (key KEY, body limit LIMIT, no warm-up) in a thread."""
  from training.tokenizer import default_tokenizer_path, load_tokenizer

  config = copy.deepcopy(serve_config)
  config.serving.update(api_key=KEY, warmup=False, max_body_bytes=LIMIT, default_max_tokens=100)
  tok = load_tokenizer(
    default_tokenizer_path("tiny"),
    model_vocab_size=model_cfg.vocab_size,
    image_token_id=model_cfg.image_token_id,
  )
  engine = FakeEngine(model_cfg)
  return BackgroundServer(create_app(engine, tok, config)).start(), engine


def chat(seed, **kw):
  return {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 5,
    "seed": seed,
    **kw,
  }
