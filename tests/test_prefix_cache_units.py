"""serving.prefix_cache.Prefixer on a small synthetic decode state (one DSA and one delta layer, two
rows): what a row caches, what a new row loads, refcounts, exact mode; references written out."""

import hashlib
import types

import jax.numpy as jnp
import numpy as np
import pytest

from model.attention.delta import DeltaCache
from model.attention.dsa import DSACache
from model.config import ConfigError
from serving.batch import Slot
from serving.engine import Engine
from serving.prefix_cache import PrefixCache, Prefixer, build_prefixer

B, CHUNK, L, IMG = 4, 8, 24, 9


def _h(prev, tokens, extra=b""):
  h = hashlib.blake2b(prev, digest_size=16)
  h.update(np.asarray(tokens, np.int32).tobytes())
  h.update(extra)
  return h.digest()


def _state(row0, delta0=0.0, row1=None, delta1=0.0):
  """Row 0's DSA slots hold row0 (latent = value, k_rope = value + 100, index_k = value + 200)."""
  lat = np.zeros((2, L, 2), np.float32)
  lat[0, :len(row0)] = np.asarray(row0, np.float32)[:, None]
  if row1 is not None:
    lat[1, :len(row1)] = np.asarray(row1, np.float32)[:, None]
  dsa = DSACache(jnp.asarray(lat), jnp.asarray(lat[..., :1] + 100), jnp.asarray(lat[..., :1] + 200),
                 jnp.zeros((2,), jnp.int32))
  st = np.zeros((2, 1, 2, 2), np.float32)
  st[0], st[1] = delta0, delta1
  conv = np.zeros((2, 2, 3), np.float32)
  conv[0], conv[1] = delta0 + 0.5, delta1 + 0.5
  return [dsa, DeltaCache(jnp.asarray(st), jnp.asarray(conv))]


def _slot(prompt, images=None, routing=None):
  handle = types.SimpleNamespace(request=types.SimpleNamespace(images=images))
  s = Slot(handle, np.asarray(prompt, np.int32), frozenset(), 0)
  s.routing = routing
  return s


def _prefixer(budget=10**6, exact=False):
  return Prefixer(PrefixCache(B, budget), prefill_chunk=CHUNK, exact=exact, image_token_id=IMG)


def _feed(px, cache, s, upto, decoded=False):
  s.cache_len = upto
  px.add_blocks(cache, 0, s, decoded)


PROMPT = list(range(20, 30))  # 10 tokens


def _warm(px, delta=3.0):
  """Row 0 prefills PROMPT (chunks of 8 and 2), then decodes 60, 61: blocks 0, 1 (snapshot), 2 (snapshot)."""
  s = _slot(PROMPT)
  cache, reused = px.load(_state([]), 0, s)
  assert reused == 0 and len(s.keys) == 2 and s.cache_epoch == 0
  cache = _state(PROMPT[:8], delta)
  _feed(px, cache, s, 8)
  cache = _state(PROMPT, delta + 1)
  _feed(px, cache, s, 10)
  s.generated = [60]
  cache = _state(PROMPT + [60], delta + 2)
  _feed(px, cache, s, 11, decoded=True)
  s.generated = [60, 61]
  cache = _state(PROMPT + [60, 61], delta + 3)
  _feed(px, cache, s, 12, decoded=True)
  return s


def test_a_row_caches_its_whole_blocks_with_snapshots_at_its_ends():
  px = _prefixer()
  s = _warm(px)
  k0 = _h(b"", PROMPT[:4])
  k1 = _h(k0, PROMPT[4:8])
  k2 = _h(k1, PROMPT[8:] + [60, 61])
  assert s.keys == [k0, k1, k2] and list(px.store.blocks) == [k0, k1, k2]
  b0, b1, b2 = s.chain
  assert [b.key for b in s.chain] == [k0, k1, k2] and [b.index for b in s.chain] == [0, 1, 2]
  assert b0.parent is None and b1.parent is b0 and b2.parent is b1
  assert [b.refs for b in s.chain] == [1, 1, 1]  # the row holds what it wrote
  np.testing.assert_array_equal(np.asarray(b1.tokens[0][0])[:, 0], [24, 25, 26, 27])
  np.testing.assert_array_equal(np.asarray(b2.tokens[0][1])[:, 0], [128, 129, 160, 161])
  np.testing.assert_array_equal(np.asarray(b2.tokens[0][2])[:, 0], [228, 229, 260, 261])
  assert b2.tokens[1] is None
  assert b0.state is None  # row 0 never stood at 4
  assert float(np.asarray(b1.state[1][0]).max()) == 3.0  # the state after the first chunk
  assert float(np.asarray(b2.state[1][0]).max()) == 6.0 and float(np.asarray(b2.state[1][1]).max()) == 6.5
  assert b1.state[0] is None


def test_a_new_row_loads_the_longest_prefix_and_prefills_the_last_token():
  px = _prefixer()
  _warm(px)
  s = _slot(PROMPT + [60, 61, 70], images=None)
  cache, reused = px.load(_state([], row1=[], delta1=0.0), 1, s)
  assert reused == 12 and s.fed == s.cache_len == s.cached == 12 and s.images_fed == 0
  dsa, delta = cache
  np.testing.assert_array_equal(np.asarray(dsa.latent)[1, :13, 0], PROMPT + [60, 61, 0])
  np.testing.assert_array_equal(np.asarray(dsa.k_rope)[1, :12, 0], np.add(PROMPT + [60, 61], 100))
  np.testing.assert_array_equal(np.asarray(dsa.index_k)[1, :12, 0], np.add(PROMPT + [60, 61], 200))
  np.testing.assert_array_equal(np.asarray(dsa.lengths), [0, 12])
  assert np.all(np.asarray(delta.state)[1] == 6.0) and np.all(np.asarray(delta.conv)[1] == 6.5)
  assert np.all(np.asarray(delta.state)[0] == 0.0)  # the other row is untouched
  assert [b.refs for b in s.chain] == [2, 2, 2]
  # The prompt of exactly 12 tokens: its last token is prefilled, so the resume is at 8.
  t = _slot(PROMPT + [60, 61])
  cache, reused = px.load(_state([]), 1, t)
  assert reused == 8 and len(t.keys) == 2 and [b.refs for b in t.chain] == [3, 3]
  assert np.all(np.asarray(cache[1].state)[1] == 3.0)
  assert int(np.asarray(cache[0].lengths)[1]) == 8
  # Another token in block 2: only blocks 0 and 1 match.
  u = _slot(PROMPT + [60, 62, 70])
  assert px.load(_state([]), 1, u)[1] == 8


def test_loading_makes_the_chain_most_recent():
  px = _prefixer()
  _warm(px)
  other = _slot(list(range(40, 50)))
  px.load(_state([]), 1, other)
  _feed(px, _state(list(range(40, 48))), other, 8)
  first = list(px.store.blocks)[:3]
  px.load(_state([]), 1, _slot(PROMPT + [60, 61, 70]))
  assert list(px.store.blocks)[-3:] == first


def test_finishing_a_row_releases_its_blocks():
  px = _prefixer()
  s = _warm(px)
  t = _slot(PROMPT + [60, 61, 70])
  px.load(_state([]), 1, t)
  done = []
  fake = types.SimpleNamespace(_rows=[s, t], _finish_handle=lambda *a: done.append(a))
  Engine._finish(fake, 0, "stop")
  assert [b.refs for b in t.chain] == [1, 1, 1] and fake._rows == [None, t] and len(done) == 1
  Engine._finish(fake, 1, "stop")
  assert [b.refs for b in t.chain] == [0, 0, 0]


def test_a_device_call_failing_mid_load_leaves_no_block_held():
  """The engine ends a row whose load failed (its step's error path); the blocks it had taken were
  held for ever when the chain was recorded only after the device calls."""
  px = _prefixer()
  s = _warm(px)
  t = _slot(PROMPT + [60, 61, 70])
  calls = []

  def put_tokens(cache, row, start, tokens):
    calls.append(int(start))
    if len(calls) == 2:
      raise RuntimeError("device call failed")
    return cache

  px.fns = {**px.fns, "put_tokens": put_tokens}
  with pytest.raises(RuntimeError, match="device call failed"):
    px.load(_state([]), 1, t)
  assert calls == [0, 4]
  fake = types.SimpleNamespace(_rows=[s, t], _finish_handle=lambda *a: None)
  Engine._finish(fake, 1, "error")
  Engine._finish(fake, 0, "stop")
  assert [b.refs for b in px.store.blocks.values()] == [0, 0, 0]


def test_an_existing_block_gets_the_snapshot_it_lacked():
  px = _prefixer()
  s = _slot(PROMPT)
  px.load(_state([]), 0, s)
  _feed(px, _state(PROMPT[:8], 3.0), s, 8)
  b0 = s.chain[0]
  assert b0.state is None
  v = _slot(PROMPT[:4] + [1, 2, 3, 4, 5, 6])  # passes block 0 without standing at its end
  assert px.load(_state([]), 1, v)[1] == 0
  v.cache_len = 8
  px.add_blocks(_state([], row1=PROMPT[:4] + [1, 2, 3, 4], delta1=5.0), 1, v)
  assert v.chain[0] is b0 and b0.state is None and v.chain[1].state is not None
  t = _slot(PROMPT[:4] + [1, 2])  # a row standing at 4 with the same first block
  px.load(_state([]), 1, t)
  t.cache_len = 4
  px.add_blocks(_state([], row1=PROMPT[:4], delta1=7.0), 1, t)
  assert t.chain == [b0] and b0.refs == 3
  assert np.all(np.asarray(b0.state[1][0]) == 7.0)
  assert list(px.store.blocks)[-1] == b0.key  # touched
  u = _slot(PROMPT[:4] + [1, 2])
  assert px.load(_state([]), 1, u)[1] == 4


def test_exact_mode_caches_whole_prefill_chunks_only():
  px = _prefixer(exact=True)
  s = _slot(list(range(20, 40)))
  px.load(_state([]), 0, s)
  _feed(px, _state(list(range(20, 26))), s, 6)
  assert len(px.store) == 0  # mid-chunk (a prompt's short last chunk)
  _feed(px, _state(list(range(20, 28))), s, 8)
  assert len(px.store) == 2 and s.chain[1].state is not None
  _feed(px, _state(list(range(20, 36))), s, 16, decoded=True)
  assert len(px.store) == 2  # decode steps cache nothing
  _feed(px, _state(list(range(20, 36))), s, 16)
  assert len(px.store) == 4 and s.chain[2].state is None and s.chain[3].state is not None
  loose = _prefixer(exact=False)
  t = _slot(list(range(20, 40)))
  loose.load(_state([]), 0, t)
  _feed(loose, _state(list(range(20, 32))), t, 12, decoded=True)
  assert len(loose.store) == 3 and t.chain[2].state is not None


def test_a_row_adds_nothing_after_a_clear_or_a_full_store():
  px = _prefixer()
  s = _slot(PROMPT)
  px.load(_state([]), 0, s)
  px.store.clear()
  _feed(px, _state(PROMPT[:8]), s, 8)
  assert len(px.store) == 0 and s.chain == []
  # 100 bytes: a block's tokens (4 x (2 + 1 + 1) float32: 64 bytes) fit, not with a snapshot (40 more).
  small = _prefixer(budget=100)
  t = _slot(PROMPT)
  small.load(_state([]), 0, t)
  _feed(small, _state(PROMPT[:4]), t, 4)
  assert len(small.store) == 0 and t.cache_epoch == -1 and t.chain == []
  _feed(small, _state(PROMPT[:8]), t, 8)  # block 0 would now fit without its snapshot: the row stopped
  assert len(small.store) == 0
  u = _slot(PROMPT)
  small.load(_state([]), 0, u)
  _feed(small, _state(PROMPT[:8]), u, 8)  # block 0 without a snapshot fits, block 1 with one does not
  assert len(small.store) == 1 and u.cache_epoch == -1 and len(u.chain) == 1 and small.store.nbytes == 64


def test_routing_is_cached_and_returned_with_the_blocks():
  px = _prefixer(exact=True)
  s = _slot(PROMPT, routing=[])
  px.load(_state([]), 0, s)
  s.routing = [np.arange(8, dtype=np.int32).reshape(8, 1, 1)]
  _feed(px, _state(PROMPT[:8]), s, 8)
  b0, b1 = s.chain
  np.testing.assert_array_equal(b0.routing[:, 0, 0], [0, 1, 2, 3])
  np.testing.assert_array_equal(b1.routing[:, 0, 0], [4, 5, 6, 7])
  t = _slot(PROMPT, routing=[])
  assert px.load(_state([]), 1, t)[1] == 8
  assert len(t.routing) == 2 and t.routing[0] is b0.routing and t.routing[1] is b1.routing
  plain = _prefixer(exact=True)
  u = _slot(PROMPT)
  plain.load(_state([]), 0, u)
  _feed(plain, _state(PROMPT[:8]), u, 8)
  assert all(b.routing is None for b in u.chain)
  v = _slot(PROMPT, routing=[])
  assert plain.load(_state([]), 1, v)[1] == 0  # no experts recorded
  v.routing = [np.arange(10, 18, dtype=np.int32).reshape(8, 1, 1)]
  v.cache_len = 8
  plain.add_blocks(_state([], row1=PROMPT[:8]), 1, v)  # the same blocks, now with their experts
  assert v.chain == u.chain
  np.testing.assert_array_equal(u.chain[1].routing[:, 0, 0], [14, 15, 16, 17])
  assert plain.load(_state([]), 1, _slot(PROMPT, routing=[]))[1] == 8


def test_images_key_the_blocks_and_count_the_placeholders_loaded():
  px = _prefixer()
  prompt = [20, 21, 22, 23, 24, 25, IMG, IMG, 26, 27]  # the placeholders end the loaded prefix
  rng = np.random.default_rng(3)
  img_a, img_b = (rng.uniform(size=(1, 2, 2, 3)).astype(np.float32) for _ in range(2))
  s = _slot(prompt, images=img_a)
  px.load(_state([]), 0, s)
  _feed(px, _state(prompt[:8]), s, 8)
  digest = hashlib.blake2b(img_a[0].tobytes() + b"(2, 2, 3)", digest_size=16).digest()
  k0 = _h(b"", prompt[:4])
  assert s.keys == [k0, _h(k0, prompt[4:8], (0).to_bytes(8, "little") + (2).to_bytes(8, "little") + digest)]
  same = _slot(prompt, images=img_a.copy())
  assert px.load(_state([]), 1, same)[1] == 8 and same.images_fed == 2
  other = _slot(prompt, images=img_b)
  assert px.load(_state([]), 1, other)[1] == 0 and other.images_fed == 0
  plain = _slot(prompt)  # the placeholder ids without an image
  assert px.load(_state([]), 1, plain)[1] == 0


def test_build_prefixer_sizes_and_errors():
  cache = _state([])
  assert build_prefixer(0, 4, 8, False, IMG, cache) is None
  px = build_prefixer(1.5, 4, 8, True, IMG, cache)
  assert px.store.budget == 1572864 and px.store.block == 4 and px.exact and px.prefill_chunk == 8
  with pytest.raises(ValueError, match="no DSA layer"):
    build_prefixer(1, 4, 8, False, IMG, [cache[1]])
  with pytest.raises(ValueError, match="unsupported decode-state kinds"):
    build_prefixer(1, 4, 8, False, IMG, [cache[0], object()])
  with pytest.raises(ConfigError, match="prefix_cache_mb"):  # under one byte: was a bare budget_bytes=0 error
    build_prefixer(1e-7, 4, 8, False, IMG, cache)
