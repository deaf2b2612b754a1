"""serving/prefix_cache.py through the engine: cache on == cache off, reuse, images, eviction.

Two engines on the same random `tiny` weights: one with the prefix cache (16-token
blocks, 32-token prefill chunks), one without. Greedy outputs must be token-identical,
and the cached engine must have reused prefixes where the prompts share them.
"""

import threading

import numpy as np
import pytest

from serving.chat import ChatRenderer
from serving.engine import Engine, Request
from serving.prefix_cache import PrefixCache, block_keys
from serving.types import Message, SamplingParams, TextPart, Tool, ToolCall

SLOTS, CONTEXT, CHUNK, BLOCK = 4, 640, 32, 16
BOS = 317  # tiny's <|bos|>


def _build(model, tokenizer, **kw):
  kw.setdefault("prefix_cache_block", BLOCK)
  return Engine(model, tokenizer, slots=SLOTS, max_context=CONTEXT, prefill_chunk=CHUNK, **kw)


@pytest.fixture(scope="module")
def engines():
  from configs import serve
  from serving.build import build_engine
  config = serve.get_config("tiny")
  config.model.max_seq_len = CONTEXT  # a tool conversation outgrows tiny's 256
  # Batch-invariant, as _build's engines (Engine's default): bits are compared across engines.
  config.serving.update(slots=SLOTS, max_context=CONTEXT, prefill_chunk=CHUNK, prefix_cache_mb=0,
                        batch_invariant=True)
  off = build_engine(config)
  assert off.tokenizer.special_id("bos") == BOS
  on = _build(off.model, off.tokenizer, prefix_cache_mb=64)
  yield on, off
  on.stop()
  off.stop()


def _prompt(n, seed):
  return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def _greedy(n):
  # Only <|bos|> stops (the random model would stop at an end of turn after a few tokens), so
  # every request generates n tokens.
  return SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=[BOS])


def _reused(engine):
  return engine.metrics.prefix_reused_tokens.value()


def test_repeated_and_extended_prompts_match_the_uncached_engine(engines):
  on, off = engines
  prompt = _prompt(100, 1)
  first, _, usage = on.generate(Request(prompt, _greedy(40)))
  assert usage.cached_tokens == 0  # a cold prompt
  off_ids, _, off_usage = off.generate(Request(prompt, _greedy(40)))
  assert first == off_ids and off_usage.cached_tokens == 0
  before = _reused(on)
  again, _, usage = on.generate(Request(prompt, _greedy(40)))
  assert again == first
  assert usage.prompt_tokens == 100
  assert _reused(on) - before == 96  # (100 - 1) // 16 blocks: one prompt token is always prefilled
  assert usage.cached_tokens == 96  # what the usage reports (OpenAI's cached_tokens)
  # The next turn: the prompt, the completion, a new message. Decode steps cached the completion.
  turn2 = prompt + first + _prompt(30, 2)
  before = _reused(on)
  got, _, usage = on.generate(Request(turn2, _greedy(40)))
  assert _reused(on) - before == 128 == usage.cached_tokens  # 100 prompt + 39 fed generated -> 8 blocks
  assert got == off.generate(Request(turn2, _greedy(40)))[0]


def test_multi_turn_tool_conversation(engines):
  on, off = engines
  renderer = ChatRenderer(on.tokenizer, on.cfg.vision.num_patches)
  tools = [Tool("shell", "Run a command.", {"type": "object", "properties": {"command": {"type": "string"}},
                                             "required": ["command"]})]
  messages = [Message("system", [TextPart("You work in a shell.")]),
              Message("user", [TextPart("List the files, then count the lines of notes.txt.")])]
  steps = [("ls", "notes.txt\nreport.md"), ("wc -l notes.txt", "12 notes.txt"), ("cat report.md", "# Done")]
  reused = []
  for turn, (command, result) in enumerate(steps):
    ids = renderer.render(messages, tools=tools, thinking=True, effort="high").ids
    assert len(ids) + 16 <= CONTEXT
    before = _reused(on)
    got = on.generate(Request(ids, _greedy(16)))[0]
    reused.append(_reused(on) - before)
    assert got == off.generate(Request(ids, _greedy(16)))[0], f"turn {turn}"
    call = ToolCall(f"call_{turn}", "shell", f'{{"command": "{command}"}}')
    messages += [Message("assistant", [], thinking=f"I run {command}.", tool_calls=[call]),
                 Message("tool", [TextPart(result)], tool_call_id=call.id, name="shell")]
  # Every later turn starts with the previous turn's prompt: all its whole blocks are reused.
  assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused


def test_images_are_part_of_the_key(engines):
  on, off = engines
  cfg = on.cfg
  n_patch = cfg.vision.num_patches
  prompt = _prompt(20, 3) + [cfg.image_token_id] * n_patch + _prompt(40, 4)
  rng = np.random.default_rng(5)
  image_a = rng.uniform(size=(1, 16, 16, 3)).astype(np.float32)
  image_b = rng.uniform(size=(1, 16, 16, 3)).astype(np.float32)
  got_a = on.generate(Request(prompt, _greedy(12), image_a))[0]
  assert got_a == off.generate(Request(prompt, _greedy(12), image_a))[0]
  # The same tokens with another image: nothing after the first placeholder (position 20) may
  # be reused, and there is no resume point before it (the first is the first chunk's end, 32).
  before = _reused(on)
  got_b = on.generate(Request(prompt, _greedy(12), image_b))[0]
  assert _reused(on) == before
  assert got_b == off.generate(Request(prompt, _greedy(12), image_b))[0]
  assert got_b != got_a  # the image matters (else this test could not fail)
  before = _reused(on)
  assert on.generate(Request(prompt, _greedy(12), image_a))[0] == got_a
  assert _reused(on) - before >= 32  # the same image: the blocks with its placeholders are reused


def test_every_image_and_their_order_are_part_of_the_key(engines):
  """Two images in one prompt: changing only the second, or swapping the two, reuses nothing past
  the first placeholder that shows another image; the same pair again reuses the whole prompt."""
  on, off = engines
  cfg = on.cfg
  n_patch, img = cfg.vision.num_patches, cfg.image_token_id
  prompt = _prompt(5, 21) + [img] * n_patch + _prompt(40, 22) + [img] * n_patch + _prompt(50, 23)
  second = 5 + n_patch + 40  # the second image's first placeholder
  rng = np.random.default_rng(9)
  a, b, c = (rng.uniform(size=(16, 16, 3)).astype(np.float32) for _ in range(3))
  outputs = {}
  for name, pair, most in (("ab", (a, b), 0), ("ac", (a, c), second), ("ba", (b, a), 0),
                           ("ab again", (a, b), len(prompt))):
    before = _reused(on)
    got = on.generate(Request(prompt, _greedy(12), np.stack(pair)))[0]
    reused = _reused(on) - before
    assert got == off.generate(Request(prompt, _greedy(12), np.stack(pair)))[0], name
    assert reused <= most, (name, reused)
    outputs[name] = got
  assert reused >= 64  # "ab again": its blocks, both images included, came from the first "ab"
  assert len({tuple(outputs[k]) for k in ("ab", "ac", "ba")}) == 3  # the images matter


def test_concurrent_requests_sharing_a_prefix(engines):
  on, off = engines
  shared = _prompt(70, 6)
  prompts = [shared + _prompt(10 + 7 * k, 10 + k) for k in range(6)]
  want = [off.generate(Request(p, _greedy(20)))[0] for p in prompts]
  on.start()
  try:
    results = [None] * len(prompts)

    def run(k):
      results[k] = on.generate(Request(prompts[k], _greedy(20)))[0]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=300)
  finally:
    on.stop()
  assert results == want
  # Six requests on four slots: the last two start after the first finished, sharing its blocks.
  assert _reused(on) >= 64


def test_exact_mode_is_bit_identical_and_resumes_on_chunk_multiples(engines):
  _, off = engines
  exact = _build(off.model, off.tokenizer, prefix_cache_mb=64, prefix_cache_exact=True)
  prompt = _prompt(150, 7)
  cold = exact.generate(Request(prompt, _greedy(30)))
  ref = off.generate(Request(prompt, _greedy(30)))
  assert cold[0] == ref[0]
  handle = exact.submit(Request(prompt + cold[0] + _prompt(20, 8), _greedy(30)))
  lps = [lp for ev in exact._drive(handle) for lp in ev.logprobs]
  base = off.submit(Request(prompt + cold[0] + _prompt(20, 8), _greedy(30)))
  lps_off = [lp for ev in off._drive(base) for lp in ev.logprobs]
  assert lps == lps_off  # bitwise: the resumed state is the one a cold prefill computes
  # Only prefill chunk ends (multiples of 32) are resume points; decode steps cached nothing.
  assert exact.metrics.prefix_reused_tokens.value() == 128
  assert all(b.state is None or (b.index + 1) * BLOCK % CHUNK == 0 for b in exact.prefix.blocks.values())
  # Only whole chunks are cached: [32, 48) of a 48-token prompt runs at width 16, and a later
  # request prefilling those tokens in a whole chunk must not resume on that narrower run's state.
  short = _prompt(48, 12)
  exact.generate(Request(short, _greedy(2)))
  keys = block_keys(b"", np.array(short, np.int32), BLOCK, 0, 3)
  assert exact.prefix.get(keys[1]) is not None and exact.prefix.get(keys[2]) is None
  longer = short + _prompt(40, 13)
  exact.generate(Request(longer, _greedy(2)))  # resumes at 32, caches [32, 64) from a whole chunk
  longest = longer + _prompt(10, 14)
  got, want = exact.submit(Request(longest, _greedy(8))), off.submit(Request(longest, _greedy(8)))
  assert [lp for ev in exact._drive(got) for lp in ev.logprobs] == [lp for ev in off._drive(want)
                                                                      for lp in ev.logprobs]


def test_routing_of_reused_tokens_is_returned(engines):
  _, off = engines
  exact = _build(off.model, off.tokenizer, prefix_cache_mb=64, prefix_cache_exact=True)
  prompt = _prompt(90, 9)

  def routing(engine, record=True):
    handle = engine.submit(Request(prompt, _greedy(8), record_routing=record))
    return [ev for ev in engine._drive(handle)][-1].routing

  exact.generate(Request(prompt, _greedy(8)))  # caches blocks without routing
  before = _reused(exact)
  first = routing(exact)
  assert _reused(exact) == before  # the cached blocks lack routing: not reused for this request
  second = routing(exact)
  assert _reused(exact) - before == 64  # now they carry it
  cold = routing(off)
  assert first.shape == second.shape == cold.shape == (90 + 7,) + cold.shape[1:]
  np.testing.assert_array_equal(second, cold)


def test_new_weights_empty_the_cache(engines):
  _, off = engines
  eng = _build(off.model, off.tokenizer, prefix_cache_mb=64)
  prompt = _prompt(60, 11)
  eng.generate(Request(prompt, _greedy(4)))
  assert len(eng.prefix) > 0
  eng.update_weights()
  assert len(eng.prefix) == 0 and eng.metrics.prefix_blocks.value() == 0
  before = _reused(eng)
  eng.generate(Request(prompt, _greedy(4)))
  assert _reused(eng) == before


def test_eviction_within_the_budget_and_metrics(engines):
  _, off = engines
  probe = _build(off.model, off.tokenizer, prefix_cache_mb=64)
  probe.generate(Request(_prompt(33, 12), _greedy(1)))  # two blocks, one snapshot
  per_block = probe.prefix.nbytes / 2
  # A budget of about five blocks: a stream of distinct prompts must evict.
  small = _build(off.model, off.tokenizer, prefix_cache_mb=5.5 * per_block / 2**20)
  for k in range(4):
    p = _prompt(64, 20 + k)
    assert small.generate(Request(p, _greedy(6)))[0] == off.generate(Request(p, _greedy(6)))[0]
    assert small.prefix.nbytes <= small.prefix.budget
  assert small.metrics.prefix_evictions.value() > 0
  text = small.metrics.render()
  for name in ("horizon_prefix_cache_reused_tokens_total", "horizon_prefix_cache_hit_rate",
               "horizon_prefix_cache_blocks", "horizon_prefix_cache_evictions_total",
               "horizon_prefix_cache_bytes", "horizon_prefix_cache_capacity_bytes"):
    assert name in text
  assert small.metrics.prefix_bytes.value() == small.prefix.nbytes
  # The hit rate: reused / prompt tokens.
  p = _prompt(64, 30)
  small.generate(Request(p, _greedy(2)))
  small.generate(Request(p, _greedy(2)))
  want = small.metrics.prefix_reused_tokens.value() / small.metrics.prompt_tokens.value()
  assert small.metrics.prefix_hit_rate.value() == pytest.approx(want) and want > 0


def test_lru_keeps_blocks_in_use_and_ancestors():
  pc = PrefixCache(block=2, budget_bytes=3 * 8)
  tok = lambda: [(np.zeros((2,), np.float32),)]  # 8 bytes  # noqa: E731
  a = pc.add(b"a", None, 0, tok(), None, None)
  b = pc.add(b"b", a, 1, tok(), None, None)
  c = pc.add(b"c", None, 0, tok(), None, None)
  b.refs += 1  # a running request holds b (and so its parent a)
  d = pc.add(b"d", None, 0, tok(), None, None)
  assert d is not None and pc.get(b"c") is None and pc.evictions == 1  # c: the only free leaf
  assert pc.add(b"e", None, 0, tok(), None, None) is not None and pc.get(b"d") is None
  b.refs -= 1
  assert pc.add(b"f", None, 0, tok(), None, None) is not None
  assert pc.get(b"b") is None and pc.get(b"a") is not None  # the leaf goes before its parent
  assert c is not None and pc.nbytes <= pc.budget


def test_routing_added_to_a_block_stays_within_the_budget():
  """It was accounted but never evicted for: requests recording routing took nbytes past the budget."""
  pc = PrefixCache(block=2, budget_bytes=3 * 8)
  tok = lambda: [(np.zeros((2,), np.float32),)]  # 8 bytes  # noqa: E731
  a, b, c = (pc.add(k, None, 0, tok(), None, None) for k in (b"a", b"b", b"c"))
  routing = np.arange(2, dtype=np.int32)  # 8 bytes
  assert pc.add_routing(c, routing) and pc.get(b"a") is None and pc.evictions == 1  # the LRU one goes
  assert c.routing is routing and c.nbytes == 16 and pc.nbytes == 24 == pc.budget
  c.refs += 1  # held by a request; b, free, is never evicted for its own routing
  assert not pc.add_routing(b, routing) and b.routing is None and b.nbytes == 8
  assert pc.nbytes == 24 and pc.get(b"b") is b and pc.get(b"c") is c and b.refs == 0
  c.refs -= 1
  assert pc.add_routing(b, routing) and pc.get(b"c") is None and pc.nbytes == 16 <= pc.budget


def test_bad_settings_name_the_field(engines):
  _, off = engines
  with pytest.raises(ValueError, match="prefix_cache_block"):
    _build(off.model, off.tokenizer, prefix_cache_mb=8, prefix_cache_block=12)
  with pytest.raises(ValueError, match="prefix_cache_mb"):
    _build(off.model, off.tokenizer, prefix_cache_mb=-1)
