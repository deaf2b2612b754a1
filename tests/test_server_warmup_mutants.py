"""serving.warmup's control logic against a fake engine (no model, no compile): the phases and the
requests each one submits, /health in every state, a failed or disabled warm-up."""

import types

import numpy as np
import pytest

from serving import prepare, warmup
from serving.warmup import Warmup

BOS, FILLER = 1, 42
CHAT = [BOS, 5, 6, 7]  # the rendered "warm up" user turn


class _Handle:
  def __init__(self, reason):
    self.reason = reason

  def events(self):
    yield types.SimpleNamespace(finish_reason=None)
    yield types.SimpleNamespace(finish_reason=self.reason)


class _Engine:
  def __init__(self, running=True, reason="length"):
    self.running, self.reason = running, reason
    self.slots, self.decode_buckets, self.prefill_buckets = 8, [1, 2, 4, 8], [16, 4]
    self.prefill_chunk, self.max_context = 16, 40
    self.submitted = []

  def submit(self, request):
    self.submitted.append(request)
    return _Handle(self.reason)


class _Renderer:
  def render(self, messages):
    images = [p.pixels for m in messages for p in m.content if hasattr(p, "pixels")]
    return types.SimpleNamespace(ids=list(CHAT), images=images)


def _ctx(engine, vision=True):
  vis = types.SimpleNamespace(enabled=vision, image_size=3, num_channels=1)
  tok = types.SimpleNamespace(encode=lambda text: [BOS, FILLER] if text == " up" else pytest.fail(text))
  return types.SimpleNamespace(engine=engine, model_name="tiny", renderer=_Renderer(), tokenizer=tok,
                               model_cfg=types.SimpleNamespace(vision=vis))


@pytest.fixture
def processors(monkeypatch):
  calls = []
  monkeypatch.setattr(prepare, "make_processor", lambda ctx, **kw: calls.append(kw) or "PROCESSOR")
  return calls


def _prompt(n):  # BOS, filler up to n tokens, then the rest of the chat
  return [BOS] + [FILLER] * (n - len(CHAT)) + CHAT[1:]


def test_phases_submit_the_documented_requests(processors):
  engine = _Engine()
  w = Warmup(_ctx(engine)).start()
  assert w.wait(10) and w.state == "ready" and w.error is None
  got = [(len(r.prompt_ids), r.params.max_tokens, r.images is not None, r.processor)
         for r in engine.submitted]
  # prefill widths 16, 4: prompts of min(16 + w, 40 - 8) tokens; then image, tool, 2 / 4 / 8 rows, text
  want = ([(32, 4, False, None), (20, 4, False, None), (17, 4, True, None), (17, 6, False, "PROCESSOR")]
          + [(17, 2, False, None)] * (2 + 4 + 8) + [(32, 4, False, None), (20, 4, False, None)])
  assert got == want
  assert engine.submitted[0].prompt_ids == _prompt(32) and engine.submitted[2].prompt_ids == _prompt(17)
  assert all(r.params.temperature == 1.0 and r.params.seed == 0 for r in engine.submitted)
  np.testing.assert_array_equal(engine.submitted[2].images, np.full((1, 3, 3, 1), 0.5, np.float32))
  assert len(processors) == 1 and processors[0]["tools"] == [warmup._TOOL]
  assert processors[0]["tool_choice"].mode == "required" and processors[0]["thinking"] is False
  assert len(w.phase_seconds) == 7 and list(w.phase_seconds)[1].startswith("image request")
  assert [p for p in w.phase_seconds if "rows" in p] == ["2 requests at once: the decode program for 2 rows",
                                                          "4 requests at once: the decode program for 4 rows"]
  status, body = w.health()
  assert status == 200 and body["status"] == "ok" and body["model"] == "tiny"


def test_no_vision_phase_when_the_encoder_is_off(processors):
  engine = _Engine()
  w = Warmup(_ctx(engine, vision=False)).start()
  assert w.wait(10) and w.state == "ready"
  assert not any(r.images is not None for r in engine.submitted) and len(w.phase_seconds) == 6


@pytest.mark.parametrize("reason", ["error", "cancelled"])
def test_a_failed_request_fails_the_warm_up(processors, reason):
  engine = _Engine(reason=reason)
  w = Warmup(_ctx(engine)).start()
  assert w.wait(10) and w.state == "failed" and not w.ready
  assert len(engine.submitted) == 1  # the first phase stops at its first request
  status, body = w.health()
  assert status == 503 and body["status"] == "warm-up failed"
  assert f"ended with {reason!r}" in body["reason"] and "text request" in body["reason"]


def test_health_while_warming_and_with_the_engine_stopped(processors):
  engine = _Engine(running=False)
  w = Warmup(_ctx(engine)).start()
  status, body = w.health()
  assert status == 503 and body["status"] == "engine stopped"
  assert not w.wait(0.2) and engine.submitted == []  # waits for the engine's loop before submitting
  engine.running = True
  status, body = w.health()
  assert status == 503 and body["status"] == "warming" and "compiling" in body["reason"]
  assert w.wait(10) and w.health()[0] == 200
  engine.running = False  # the loop died after the warm-up: not healthy any more
  assert w.health()[0] == 503


def test_disabled_warm_up_is_ready_at_once_and_submits_nothing(processors):
  engine = _Engine()
  w = Warmup(_ctx(engine), enabled=False)
  assert w.ready and w.health()[0] == 200
  assert w.start() is w and w.wait(0) and w._thread is None
  assert engine.submitted == []


def test_prompts_leave_eight_tokens_of_the_context_free(processors):
  """max_context 24 < chunk 16 + width 16: the prompt stops at 24 - 8 = 16 tokens (room to generate)."""
  engine = _Engine()
  engine.max_context = 24
  w = Warmup(_ctx(engine, vision=False)).start()
  assert w.wait(10) and w.state == "ready"
  assert engine.submitted[0].prompt_ids == _prompt(16) and len(engine.submitted[1].prompt_ids) == 16
