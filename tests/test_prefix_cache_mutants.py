"""serving.prefix_cache edge cases that mutation testing found unchecked (references written out).

Keys, image digests and the block store are checked against hand-written hashes and byte counts;
the tests of `Prefixer` (tests/test_prefix_cache_units.py) run on a small synthetic decode state.
"""

import hashlib

import numpy as np
import pytest

from serving.prefix_cache import PrefixCache, block_keys, image_extra_fn


def _h(prev, tokens, extra=b""):
  h = hashlib.blake2b(prev, digest_size=16)
  h.update(np.asarray(tokens, np.int32).tobytes())
  h.update(extra)
  return h.digest()


def _tok(n=2):
  return [(np.zeros((n,), np.float32),)]  # 4 * n bytes


def test_block_keys_chain_each_block_on_the_previous_one():
  tokens = np.arange(10, 20, dtype=np.int64)  # int64 ids hash as int32
  k0 = _h(b"", [10, 11, 12])
  k1 = _h(k0, [13, 14, 15])
  k2 = _h(k1, [16, 17, 18])
  assert block_keys(b"", tokens, 3, 0, 3) == [k0, k1, k2]
  assert block_keys(k0, tokens, 3, 1, 2) == [k1, k2]  # resumed from block 1
  assert block_keys(b"", tokens, 3, 0, 0) == []
  with pytest.raises(ValueError, match="block 3 needs tokens up to 12, have 10"):
    block_keys(b"", tokens, 3, 0, 4)


def test_block_keys_pass_each_blocks_span_to_image_extra():
  seen = []

  def extra(start, end):
    seen.append((start, end))
    return b"x" if start == 4 else b""

  tokens = np.arange(12, dtype=np.int32)
  keys = block_keys(b"", tokens, 4, 0, 3, extra)
  assert seen == [(0, 4), (4, 8), (8, 12)]
  k0 = _h(b"", [0, 1, 2, 3])
  k1 = _h(k0, [4, 5, 6, 7], b"x")
  assert keys == [k0, k1, _h(k1, [8, 9, 10, 11])]


def _digest(img):
  img = np.asarray(img, np.float32)
  return hashlib.blake2b(img.tobytes() + str(img.shape).encode(), digest_size=16).digest()


def test_image_extra_names_the_placeholders_and_the_images_they_show():
  I = 5  # noqa: E741
  prompt = np.array([1, I, I, 2, I, I, 3])  # two images of two placeholders each
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(2, 2, 2, 3)).astype(np.float32)
  d0, d1 = _digest(images[0]), _digest(images[1])
  extra = image_extra_fn(prompt, images, I)

  def nums(a, b):
    return a.to_bytes(8, "little") + b.to_bytes(8, "little")

  assert extra(0, 3) == nums(0, 2) + d0
  assert extra(3, 7) == nums(2, 4) + d1
  assert extra(2, 5) == nums(1, 3) + d0 + d1  # the last of image 0 and the first of image 1
  assert extra(1, 2) == nums(0, 1) + d0
  assert extra(4, 5) == nums(2, 3) + d1
  assert extra(3, 4) == b"" and extra(6, 7) == b""  # no placeholder there
  assert extra(6, 12) == b""  # past the prompt (decoded tokens)
  assert image_extra_fn(prompt, None, I) is None
  assert image_extra_fn(prompt, np.zeros((0, 2, 2, 3), np.float32), I) is None


def test_image_digest_sees_every_value_and_the_shape():
  prompt = np.array([7, 7])
  img = np.zeros((2, 2, 3), np.float32)
  other = img.copy()
  other[1, 1, 2] = 1.0  # the last value only
  a, b = (image_extra_fn(prompt, im[None], 7)(0, 2) for im in (img, other))
  assert a != b
  flat = image_extra_fn(prompt, np.zeros((1, 3, 2, 2), np.float32), 7)(0, 2)  # same bytes, other shape
  assert flat != a


def test_longest_resumes_at_the_last_block_with_a_snapshot():
  pc = PrefixCache(block=2, budget_bytes=1000)
  a = pc.add(b"a", None, 0, _tok(), [np.zeros(1, np.float32)], None)
  b = pc.add(b"b", a, 1, _tok(), None, None)
  c = pc.add(b"c", b, 2, _tok(), [np.zeros(1, np.float32)], None)
  d = pc.add(b"d", c, 3, _tok(), None, None)
  assert pc.longest([b"a", b"b", b"c", b"d"]) == [a, b, c]  # d has no snapshot
  assert pc.longest([b"a", b"b", b"c", b"zz"]) == [a, b, c]
  assert pc.longest([b"a", b"b"]) == [a]
  assert pc.longest([b"zz", b"b"]) == []  # b has no snapshot: nothing to resume from
  assert pc.longest([]) == []
  assert (a.children, b.children, c.children, d.children) == (1, 1, 1, 0)
  # Routing replay: only chains whose every block recorded its experts.
  assert pc.longest([b"a", b"b", b"c"], need_routing=True) == []
  for blk in (a, b, c):
    blk.routing = np.zeros((2, 1, 1), np.int32)
  assert pc.longest([b"a", b"b", b"c"], need_routing=True) == [a, b, c]
  b.routing = None
  assert pc.longest([b"a", b"b", b"c"], need_routing=True) == [a]  # falls back to a shorter chain
  a.routing = None
  assert pc.longest([b"a", b"b", b"c"], need_routing=True) == []
  assert pc.longest([b"a", b"b", b"c"]) == [a, b, c]


def test_sizes_count_tokens_snapshot_and_routing():
  pc = PrefixCache(block=2, budget_bytes=100)
  blk = pc.add(b"a", None, 0, [(np.zeros(2, np.float32), np.zeros(3, np.float16)), None],
               [None, (np.zeros(1, np.float32), np.zeros(2, np.float32))], np.zeros((2, 1), np.int32))
  assert blk.nbytes == 14 + 12 + 8 == pc.nbytes
  assert pc.add_state(pc.add(b"b", blk, 1, _tok(), None, None), [np.zeros(4, np.int8)])
  assert pc.nbytes == 34 + 8 + 4 and pc.get(b"b").nbytes == 12
  pc.clear()
  assert len(pc) == 0 and pc.nbytes == 0 and pc.epoch == 1 and pc.get(b"a") is None


def test_a_block_filling_the_budget_exactly_fits():
  pc = PrefixCache(block=2, budget_bytes=24)
  for k in (b"a", b"b", b"c"):
    assert pc.add(k, None, 0, _tok(), None, None) is not None
  assert pc.nbytes == 24 == pc.budget and pc.evictions == 0 and len(pc) == 3
  assert pc.add(b"big", None, 0, _tok(7), None, None) is None  # 28 > budget: nothing evicted for it
  assert len(pc) == 3 and pc.evictions == 0
  assert pc.add(b"odd", None, 0, [(np.zeros(25, np.int8),)], None, None) is None  # one byte too many
  assert len(pc) == 3 and pc.evictions == 0
  assert pc.add(b"d", None, 0, _tok(4), None, None) is not None  # 16 bytes: two blocks go
  assert [k for k in pc.blocks] == [b"c", b"d"] and pc.evictions == 2 and pc.nbytes == 24


def test_eviction_takes_the_least_recently_used_leaf():
  pc = PrefixCache(block=2, budget_bytes=24)
  a, b, c = (pc.add(k, None, 0, _tok(), None, None) for k in (b"a", b"b", b"c"))
  pc.touch([a])  # now b is the least recently used
  pc.add(b"d", None, 0, _tok(), None, None)
  assert pc.get(b"b") is None and pc.get(b"a") is a and pc.get(b"c") is c
  pc.touch([c, a])  # order d, c, a
  pc.add(b"e", None, 0, _tok(), None, None)
  assert list(pc.blocks) == [b"c", b"a", b"e"]


def test_dropping_a_leaf_frees_its_parent():
  pc = PrefixCache(block=2, budget_bytes=24)
  a = pc.add(b"a", None, 0, _tok(), None, None)
  b = pc.add(b"b", a, 1, _tok(), None, None)
  c = pc.add(b"c", b, 2, _tok(), None, None)
  assert (a.children, b.children) == (1, 1)
  pc.add(b"d", None, 0, _tok(12), None, None)  # 48 bytes > budget
  assert len(pc) == 3
  # 16 bytes: the chain goes leaf first (c, then b), a stays.
  assert pc.add(b"e", None, 0, _tok(4), None, None) is not None
  assert list(pc.blocks) == [b"a", b"e"] and a.children == 0 and pc.evictions == 2
  pc.add(b"f", None, 0, _tok(2), None, None)  # a, now a leaf and the least recent, goes
  assert list(pc.blocks) == [b"e", b"f"] and c.parent is b


def test_a_held_block_keeps_its_snapshot_slot():
  pc = PrefixCache(block=2, budget_bytes=24)
  a = pc.add(b"a", None, 0, _tok(), None, None)
  pc.add(b"b", None, 0, _tok(), None, None)
  assert pc.add_state(a, [np.zeros(4, np.float32)])  # a, the LRU one, is not evicted for itself
  assert pc.get(b"a") is a and pc.get(b"b") is None and a.nbytes == 24 == pc.nbytes
  assert a.refs == 0
  b = pc.add(b"b", None, 0, _tok(), None, None)
  assert b is not None and pc.get(b"a") is None  # a is free again
  assert not pc.add_state(b, [np.zeros(5, np.float32)]) and b.state is None and pc.nbytes == 8


def test_bad_sizes_raise():
  for block, budget in ((0, 10), (2, 0)):
    with pytest.raises(ValueError, match="must be >= 1"):
      PrefixCache(block, budget)
  assert PrefixCache(1, 1).budget == 1
