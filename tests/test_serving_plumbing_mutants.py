"""serving/handle.py, run.py, admission.py, prepare.py and batch.py at the points a mutation audit
found untested: a sync stream's timeout, how a non-streaming result sorts the deltas, the processor a
submitted request carries, the engine sizes and prefix budget at their edges, prompts and stop ids of
the wrong type, the prompt-size bound for tool calls, and the per-row sampling inputs and constraints.
Each test names the mistake it catches; the references are written out here."""

import asyncio
import queue
import threading
import types

import numpy as np
import pytest

from model.config import ConfigError
from serving import batch, prepare, run
from serving.admission import check_prefix_settings, validate_engine_args, validate_request
from serving.errors import APIError
from serving.handle import Event, Handle, Request, RequestError
from serving.types import (
  Message,
  SamplingParams,
  TextDelta,
  TextPart,
  ThinkingDelta,
  ToolCall,
  ToolCallDelta,
  Usage,
)


class _Engine:
  def _wake(self):
    pass


def _ev(deltas=(), finish=None):
  return Event(token_ids=[1], deltas=list(deltas), finish_reason=finish,
               usage=Usage(3, 2) if finish else None, time=0.0)


# ---- Handle and run ----------------------------------------------------------------------------
def test_a_sync_stream_gives_up_after_its_timeout():
  """The timeout was ignored: a consumer waiting on a stalled request blocked forever."""
  h, got = Handle(_Engine(), Request([1]), None), []

  def wait():
    try:
      next(h.events(timeout=0.05))
    except queue.Empty:
      got.append("empty")

  waiter = threading.Thread(target=wait, daemon=True)
  waiter.start()
  waiter.join(5)
  assert got == ["empty"]


def test_a_collected_result_keeps_thinking_text_and_tool_calls_apart():
  """Text went into the thinking, or tool calls were dropped, in non-streaming responses."""
  call = ToolCall("call_1", "get", '{"city": "Paris"}')

  async def main():
    h = Handle(_Engine(), Request([1]), asyncio.get_running_loop())
    h._deliver(_ev([ThinkingDelta("hm"), ThinkingDelta("m")]))
    h._deliver(_ev([TextDelta("It is "), ToolCallDelta(0, call)]))
    h._deliver(_ev([TextDelta("sunny.")], finish="stop"))
    return await run.collect_all([h])

  (r,) = asyncio.run(main())
  assert (r.thinking, r.text, r.tool_calls) == ("hmm", "It is sunny.", [call])
  assert (r.finish_reason, r.usage, r.stop_sequence) == ("stop", Usage(3, 2), None)


def test_collect_all_stops_its_disconnect_watcher_when_done():
  """The watcher went on waiting for the client's next message after the response was ready."""
  async def main():
    h = Handle(_Engine(), Request([1]), asyncio.get_running_loop())
    h._deliver(_ev([TextDelta("a")], finish="stop"))
    never = asyncio.Event()

    async def receive():
      await never.wait()

    await run.collect_all([h], request=types.SimpleNamespace(receive=receive))
    await asyncio.sleep(0)
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

  assert asyncio.run(main()) == []


def test_submit_passes_the_processor_and_params_on():
  """The request reached the engine without its output processor (no stop strings, no tool calls)."""
  ctx = types.SimpleNamespace(engine=types.SimpleNamespace(submit=lambda request, loop: request))
  proc, params = object(), SamplingParams(max_tokens=5)

  async def main():
    return run.submit(ctx, [4, 5], None, proc, params)

  req = asyncio.run(main())
  assert req.processor is proc and req.params is params and req.prompt_ids == [4, 5]


# ---- admission ---------------------------------------------------------------------------------
CFG = types.SimpleNamespace(image_token_id=7, max_seq_len=32,
                            vision=types.SimpleNamespace(num_patches=2, image_size=4, num_channels=3))


def _param(ids=(1, 2), **params) -> str:
  request = Request(ids if isinstance(ids, np.ndarray) else list(ids),
                    SamplingParams(**{"max_tokens": 4, **params}))
  with pytest.raises(RequestError) as e:
    validate_request(request, max_context=16, vocab_size=10, model_cfg=CFG, has_vision=False)
  return e.value.param


def test_prompts_that_are_not_integer_ids_are_refused():
  """An empty int array crashed in arr.min() (not a RequestError); float ids were truncated to ints."""
  assert _param(ids=np.array([], np.int64)) == "prompt"
  assert _param(ids=[1.5, 2]) == "prompt" and _param(ids=[1.0, 2.0]) == "prompt"
  assert _param(ids=np.array([1, 2], np.float32)) == "prompt"


def test_a_numpy_max_tokens_cannot_wrap_around_the_context():
  """2 + np.int8(127) is -127 in numpy (int32 and int64 near their max wrap the same way): a
  max_tokens far past the context was admitted."""
  validate_request(Request([1, 2], SamplingParams(max_tokens=np.int8(14))), max_context=16, vocab_size=10,
                   model_cfg=CFG, has_vision=False)  # 2 + 14 = the whole context
  for big in (np.int8(15), np.int8(127), np.int32(2**31 - 1), np.int64(2**63 - 1), np.uint64(2**64 - 1)):
    assert _param(max_tokens=big) == "max_tokens", big


def test_bytes_are_not_a_list_of_stop_ids():
  """b'\\x01' iterates as the id 1: a stop id the caller never asked for."""
  assert _param(stop_token_ids=b"\x01") == "stop_token_ids"


@pytest.mark.parametrize("field", ["slots", "max_context", "prefill_chunk", "max_queue", "decode_steps"])
def test_engine_sizes_refuse_bools_and_take_numpy_ints(field):
  """True passed as an int (one slot, a queue of one) instead of naming the mistake."""
  sizes = {"slots": 1, "max_context": 16, "prefill_chunk": 16, "max_queue": 1, "decode_steps": 1}
  with pytest.raises(ConfigError, match=f"{field}=True must be a positive int"):
    validate_engine_args(CFG, **{**sizes, field: True})
  validate_engine_args(CFG, **{**sizes, field: np.int64(sizes[field])})  # NumPy ints pass (were refused)


def test_the_prefix_budget_is_one_byte_at_least():
  """2**-20 MB is exactly one byte (the least PrefixCache takes); 2**-15 MB is 32 bytes."""
  check_prefix_settings(2**-20, 16, 32)
  check_prefix_settings(2**-15, 16, 32)
  check_prefix_settings(np.float32(1.5), np.int64(16), 32)  # NumPy numbers pass (they were refused)
  with pytest.raises(ConfigError, match="is under one byte"):
    check_prefix_settings(2**-21, 16, 32)


# ---- prepare -----------------------------------------------------------------------------------
def _ctx(max_context=100, max_token_bytes=1, num_image_tokens=0, max_images=2):
  return types.SimpleNamespace(
    limits=types.SimpleNamespace(max_context=max_context, max_images=max_images),
    max_token_bytes=max_token_bytes, renderer=types.SimpleNamespace(num_image_tokens=num_image_tokens),
    served_models=["m"])


def test_whitespace_in_tool_call_arguments_does_not_count_toward_the_bound():
  """The renderer re-serialises the arguments (`{"name": N, "arguments": A}` with ', ' and ': '), so
  padding inside them is never written: a conversation that fits was refused as too long."""
  call = ToolCall("c1", "get", '{"city":' + " " * 500 + '"Paris"}')
  rendered = '{"name": "get", "arguments": {"city": "Paris"}}'  # 47 characters
  messages = [Message("assistant", [], tool_calls=[call])]
  prepare.check_prompt_size(_ctx(max_context=48), messages, [])  # 47 < 48
  with pytest.raises(APIError, match="at least 48 tokens"):
    prepare.check_prompt_size(_ctx(max_context=48), [*messages, Message("user", [TextPart("x")])], [])
  assert len(rendered) == 47


class _Renderer:
  """Records render's arguments; raises `error` when set."""
  num_image_tokens = 0

  def __init__(self, error=None):
    self.error, self.kw = error, None

  def render(self, messages, **kw):
    self.kw = kw
    if self.error:
      raise ValueError(self.error)
    return "rendered"


def test_render_passes_the_prefill_and_the_effort_on():
  """continue_final was dropped: an assistant prefill got a new turn instead of being continued."""
  ctx, messages = _ctx(), [Message("user", [TextPart("hi")])]
  ctx.renderer = _Renderer()
  got = prepare.render(ctx, messages, tools=[], thinking=True, effort="high", continue_final=True)
  assert got == "rendered"
  assert ctx.renderer.kw == dict(tools=[], effort="high", thinking=True, add_generation_prompt=True,
                                 continue_final=True)
  prepare.render(ctx, messages, tools=[], thinking=False, effort="high")
  assert (ctx.renderer.kw["effort"], ctx.renderer.kw["continue_final"]) == (None, False)


@pytest.mark.parametrize("error, param", [
  ("messages[1].content: expected text", "messages[1].content"),
  ("tools[0].name: 'f' is listed twice", "tools[0].name"),
  ("messages[2] of role tool: answers no call", "messages[2]"),  # the field ends at the first space
  ("effort: 'huge' is not a level", None),  # only messages and tools name a field
])
def test_renderer_errors_name_the_field_at_fault(error, param):
  ctx = _ctx()
  ctx.renderer = _Renderer(error)
  with pytest.raises(APIError) as e:
    prepare.render(ctx, [Message("user", [TextPart("hi")])], tools=[], thinking=False, effort=None)
  assert (e.value.status, e.value.message, e.value.param) == (400, error, param)


def test_render_refuses_a_prompt_too_long_before_tokenizing_it():
  """The length bound was skipped: a body near the size limit was tokenized for seconds first."""
  ctx = _ctx(max_context=10)
  ctx.renderer = _Renderer()
  with pytest.raises(APIError) as e:
    prepare.render(ctx, [Message("user", [TextPart("x" * 10)])], tools=[], thinking=False, effort=None)
  assert (e.value.status, e.value.code, ctx.renderer.kw) == (400, "context_length_exceeded", None)


def test_an_unknown_model_is_a_404():
  prepare.check_model(_ctx(), "m")
  with pytest.raises(APIError) as e:
    prepare.check_model(_ctx(), "gpt-4")
  assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")


def test_make_processor_passes_every_setting_on(monkeypatch):
  """The call id prefix, the response format or the thinking budget was dropped (a tool call named
  call_..., free text instead of the schema, unbounded thinking); a SchemaError lost its field."""
  seen = {}

  def processor(tokenizer, **kw):
    seen.update(kw, tokenizer=tokenizer)
    if kw["stop"] == ["bad"]:
      error = ValueError("response_format.schema: not an object")
      error.field = "response_format.schema"
      raise error
    return "processor"

  monkeypatch.setattr(prepare, "OutputProcessor", processor)
  ctx, fmt = types.SimpleNamespace(tokenizer="tok"), object()
  got = prepare.make_processor(ctx, thinking=True, thinking_budget=12, stop=("##",), tools=["t"],
                               tool_choice="c", call_id_prefix="toolu_", response_format=fmt)
  assert got == "processor"
  assert seen == dict(tokenizer="tok", thinking=True, thinking_budget=12, stop=["##"], tools=["t"],
                      tool_choice="c", call_id_prefix="toolu_", response_format=fmt)
  with pytest.raises(APIError) as e:
    prepare.make_processor(ctx, thinking=False, thinking_budget=None, stop=["bad"])
  assert (e.value.status, e.value.param) == (400, "response_format.schema")


# ---- batch: a prefill chunk's inputs -----------------------------------------------------------
def test_chunk_inputs_pad_the_tokens_and_take_the_next_patches_in_order():
  """The last token of a chunk was dropped, or each image chunk took the request's first patches."""
  import jax.numpy as jnp
  cfg = types.SimpleNamespace(image_token_id=7, d_model=2, jnp_dtype=jnp.float32)
  slot = types.SimpleNamespace(patches=np.arange(8, dtype=np.float32).reshape(4, 2), images_fed=0)
  none = jnp.zeros((1, 4, 2))
  tokens, embeds = batch.chunk_inputs(slot, np.array([3, 4, 5]), 4, cfg, none)
  assert tokens.tolist() == [[3, 4, 5, 0]] and embeds is none and slot.images_fed == 0
  tokens, embeds = batch.chunk_inputs(slot, np.array([1, 7]), 4, cfg, none)
  assert tokens.tolist() == [[1, 7, 0, 0]] and slot.images_fed == 1
  assert np.asarray(embeds).tolist() == [[[0, 1], [0, 0], [0, 0], [0, 0]]]  # patches fill from slot 0
  tokens, embeds = batch.chunk_inputs(slot, np.array([7, 7, 2]), 4, cfg, none)
  assert slot.images_fed == 3
  assert np.asarray(embeds).tolist() == [[[2, 3], [4, 5], [0, 0], [0, 0]]]  # patches 1 and 2


# ---- batch: the per-row sampling inputs and constraints ----------------------------------------
def _slot(seed, n_generated, processor=None, **params):
  return types.SimpleNamespace(params=SamplingParams(**params), seed=seed, generated=[5] * n_generated,
                               processor=processor, handle=types.SimpleNamespace(id="r"))


def test_sampling_args_split_the_seed_and_leave_other_rows_greedy():
  """top_p was dropped, the seed's high word was cut at bit 31, or the key ignored the tokens
  generated so far (every step of a row sampled with the same key); rows not asked stay zero."""
  seed = (0x89ABCDEF << 32) | 0x01234567
  slots = [None, _slot(seed, 3, temperature=0.7, top_p=0.5, top_k=4), _slot(2**64 - 1, 0, temperature=1.0)]
  temp, top_k, top_p, lo, hi, n_gen = batch.sampling_args(slots, [1, 2])
  assert temp.tolist() == [0.0, np.float32(0.7), 1.0] and top_p.tolist() == [1.0, 0.5, 1.0]
  assert top_k.tolist() == [0, 4, 0] and n_gen.tolist() == [0, 3, 0]
  assert lo.tolist() == [0, 0x01234567, 0xFFFFFFFF] and hi.tolist() == [0, 0x89ABCDEF, 0xFFFFFFFF]
  temp, *_ = batch.sampling_args(slots, [1])
  assert temp.tolist() == [0.0, np.float32(0.7), 0.0]


class _Proc:
  def __init__(self, c):
    self.c = c

  def next_constraint(self):
    return self.c


def test_a_mask_that_allows_nothing_fails_its_row_only():
  """An all-False mask was accepted: the row sampled from no token at all."""
  ok = np.zeros(6, bool)
  ok[4] = True
  slots = [_slot(1, 0, _Proc(np.zeros(6, bool))), _slot(1, 0, _Proc(ok)), _slot(1, 0, _Proc(np.int64(3)))]
  forced, masks, failed = batch.constraints(slots, [0, 1, 2], 6)
  assert failed == [0] and forced.tolist() == [-1, -1, 3]
  assert masks.tolist() == [[True] * 6, [False] * 4 + [True, False], [True] * 6]


def test_every_masked_row_keeps_its_mask_and_free_rows_take_the_open_row():
  """The masks were rebuilt for each masked row (an earlier row's mask lost), or free rows were
  opened to every id, past the tokenizer's last one."""
  first, second, open_row = np.zeros(6, bool), np.zeros(6, bool), np.array([1, 1, 1, 1, 0, 0], bool)
  first[1], second[5] = True, True
  slots = [_slot(1, 0, _Proc(first)), _slot(1, 0), _slot(1, 0, _Proc(second))]
  forced, masks, failed = batch.constraints(slots, [0, 1, 2], 6, open_row)
  assert failed == [] and forced.tolist() == [-1, -1, -1]
  assert masks.tolist() == [[False, True] + [False] * 4, [True] * 4 + [False] * 2, [False] * 5 + [True]]



def test_programs_are_shared_by_hashable_graphdefs_and_built_afresh_otherwise():
  """batch.shared_by_graphdef: one build per (graphdef, args) when the graphdef hashes; one per call
  when it does not (metadata holding a dict), instead of a TypeError."""
  built = []
  build = batch.shared_by_graphdef(lambda graphdef, steps: built.append((graphdef, steps)) or object())
  assert build(("tiny",), 8) is build(("tiny",), 8) and build(("tiny",), 4) is not build(("tiny",), 8)
  assert build(["mxfp4"], 8) is not build(["mxfp4"], 8)
  assert built == [(("tiny",), 8), (("tiny",), 4), (["mxfp4"], 8), (["mxfp4"], 8)]


def test_engines_over_one_config_share_their_programs(engine):
  """A second engine over the session's model (other sizes) gets the session engine's jitted
  programs, so its first calls reuse what that one compiled; each engine has its own dict of them.
  A model of another config (bf16 compute) gets its own."""
  from serving.engine import Engine
  from tests.helpers import model_like
  other = Engine(engine.model, engine.tokenizer, slots=np.int64(2), max_context=np.int32(48),
                 prefill_chunk=np.int64(8), max_queue=np.int16(4), decode_steps=np.int64(engine.decode_steps))
  assert other.decode_steps == engine.decode_steps and other._fns is not engine._fns
  sizes = (other.slots, other.max_context, other.prefill_chunk, other.max_queue, other.decode_steps)
  assert [type(v) for v in sizes] == [int] * 5 and sizes[:4] == (2, 48, 8, 4)  # NumPy sizes kept as ints
  assert set(other._fns) == set(engine._fns) and all(other._fns[k] is engine._fns[k] for k in engine._fns)
  bf16 = Engine(model_like(engine.model, engine.cfg.replace(dtype="bfloat16")), engine.tokenizer, slots=2,
                max_context=48, prefill_chunk=8, compute_dtype_weights=False)
  assert not any(bf16._fns[k] is engine._fns[k] for k in engine._fns)
