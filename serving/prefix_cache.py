"""Prefix caching for the hybrid model: per-block DSA state plus delta-state snapshots at boundaries.

Agents resend their whole history every turn and the chat format is append-only, so a
turn's prompt starts with the previous turn's prompt and completion. The engine keeps
what it computed for such prefixes and prefills only the rest.

The two layer kinds keep different decode state (model/attention):
  - a Gated DSA layer keeps per-token state (`DSACache`: MLA latent, RoPE key, indexer key
    at position i), which can be cut anywhere;
  - a delta layer keeps a fixed-size recurrent state and conv history (`DeltaCache`),
    which is the state after *all* tokens so far and cannot be cut at an arbitrary token.

So the cache works in blocks of `block` tokens (block j holds tokens [j*B, (j+1)*B)):
every block stores the DSA layers' per-token state of its B tokens, and a block may also
hold a *snapshot* of every delta layer's state (and each DSA layer's length) taken when
a row's decode state ended exactly at the block's end. A request resumes from the end of
the longest chain of cached blocks whose last block has a snapshot. Snapshots are taken
wherever a row's state stands on a boundary: at the end of each prefill chunk (chunks
start on a boundary and `prefill_chunk` is a multiple of B, so every full chunk ends on
one) and whenever decoding crosses one (so a completion is cached for the next turn).

Keys: block j's key is a hash of block j-1's key, its B token ids and, for image
placeholders among them, the digests of the images they show and the placeholder
numbers; so a key names all tokens (and images) up to its block's end, as in vLLM's
hashed blocks. Blocks form a tree through their parent; eviction is LRU among blocks
with no cached child and no running request holding them (a running request holds the
chain it loaded and the blocks it wrote until it finishes), so a cached block's
ancestors are always cached. New weights (`Engine.update_weights`) empty the cache.

Numerics: a resumed request computes its suffix from a state that the original request
computed with another split into prefill chunks and decode steps, so its logits may
differ from a cold run in the last bits (as in every engine that caches prefixes); greedy
outputs are token-identical with the cache on and off in our tests (tests/test_prefix_cache.py).
The engine's exact mode (`prefix_cache_exact`) caches only what whole prefill chunks computed
and resumes only at multiples of the chunk, where a cold run's chunks end too: a resumed
request is then bit-identical to a cold one (RL rollouts use it).

Memory: the budget (bytes) bounds the blocks' device arrays; a block that would not fit
after evicting every evictable block is not cached (the request runs on, uncached).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.attention.delta import DeltaCache
from model.attention.dsa import DSACache
from serving.admission import check_prefix_settings

__all__ = ["Block", "PrefixCache", "Prefixer", "block_keys", "build_prefixer", "cache_programs",
           "check_cacheable", "image_extra_fn"]

_DIGEST = 16


@dataclasses.dataclass(eq=False)
class Block:
  """One cached block of `block` tokens (see the module docstring)."""
  key: bytes
  parent: Block | None
  index: int  # covers tokens [index * B, (index + 1) * B)
  tokens: Any  # per layer: (latent, k_rope, index_k) [B, .] for DSA layers, None for delta layers
  nbytes: int
  state: Any | None = None  # the snapshot at the block's end, or None
  routing: np.ndarray | None = None  # int32 [B, moe_layers, k]: the experts of its tokens, if recorded
  refs: int = 0  # running requests holding it
  children: int = 0  # cached blocks whose parent it is



def _nbytes(tree: Any) -> int:
  return sum(int(a.nbytes) for a in jax.tree.leaves(tree))


def block_keys(prev: bytes, tokens: np.ndarray, block: int, first: int, count: int,
               image_extra: Callable[[int, int], bytes] | None = None) -> list[bytes]:
  """Keys of blocks first .. first+count-1 of `tokens` (all tokens from position 0), chained from
  `prev` (the key of block first-1, b"" for the first block).

  image_extra(start, end) -> bytes: what the images shown at placeholders in [start, end) add
  to the key (b"" when none).
  """
  keys = []
  for j in range(first, first + count):
    h = hashlib.blake2b(prev, digest_size=_DIGEST)
    span = np.ascontiguousarray(tokens[j * block:(j + 1) * block], np.int32)
    if len(span) != block:
      raise ValueError(f"block {j} needs tokens up to {(j + 1) * block}, have {len(tokens)}")
    h.update(span.tobytes())
    if image_extra is not None:
      h.update(image_extra(j * block, (j + 1) * block))
    prev = h.digest()
    keys.append(prev)
  return keys


def image_extra_fn(prompt: np.ndarray, images: np.ndarray | None,
                   image_token_id: int) -> Callable[[int, int], bytes] | None:
  """image_extra for `block_keys`: digests of the images whose patches fill [start, end)'s
  placeholders, with the placeholders' numbers; None when the request has no images."""
  if images is None or len(images) == 0:
    return None
  marks = np.concatenate([[0], np.cumsum(prompt == image_token_id)])
  per_image = max(1, int(marks[-1]) // len(images))
  digests = [hashlib.blake2b(np.ascontiguousarray(img, np.float32).tobytes()
                             + str(img.shape).encode(), digest_size=_DIGEST).digest() for img in images]

  def extra(start: int, end: int) -> bytes:
    a, b = int(marks[min(start, len(prompt))]), int(marks[min(end, len(prompt))])
    if a == b:
      return b""
    out = [a.to_bytes(8, "little"), b.to_bytes(8, "little")]
    out += [digests[k] for k in range(a // per_image, (b - 1) // per_image + 1)]
    return b"".join(out)

  return extra


@functools.lru_cache(maxsize=16)  # shared by the caches of one block size (batch.compile_programs)
def cache_programs(block: int) -> dict[str, Callable]:
  """Jitted copies between a batch decode state (`Horizon.init_cache`) and blocks.

  take_tokens(cache, row, start) -> per layer (latent, k_rope, index_k) [B, .] | None;
  take_state(cache, row) -> per layer (state, conv) | None (delta layers);
  put_tokens(cache, row, start, tokens) and put_state(cache, row, state, length) write them
  back (the cache is donated); put_state also sets every DSA layer's length of the row.
  """

  def take_tokens(cache, row, start):
    def one(c):
      if not isinstance(c, DSACache):
        return None
      return tuple(jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(a, row, 0, keepdims=False),
                                                start, block, axis=0)
                   for a in (c.latent, c.k_rope, c.index_k))
    return [one(c) for c in cache]

  def take_state(cache, row):
    return [(jax.lax.dynamic_index_in_dim(c.state, row, 0, keepdims=False),
             jax.lax.dynamic_index_in_dim(c.conv, row, 0, keepdims=False))
            if isinstance(c, DeltaCache) else None for c in cache]

  def put_tokens(cache, row, start, tokens):
    out = []
    for c, t in zip(cache, tokens, strict=True):
      if isinstance(c, DSACache):
        zero = jnp.zeros((), jnp.int32)
        lat, rope, idx = (jax.lax.dynamic_update_slice(a, v[None].astype(a.dtype), (row, start, zero))
                          for a, v in zip((c.latent, c.k_rope, c.index_k), t, strict=True))
        c = c.replace(latent=lat, k_rope=rope, index_k=idx)
      out.append(c)
    return out

  def put_state(cache, row, state, length):
    out = []
    for c, s in zip(cache, state, strict=True):
      if isinstance(c, DeltaCache):
        zero = jnp.zeros((), jnp.int32)
        c = c.replace(state=jax.lax.dynamic_update_slice(c.state, s[0][None], (row, zero, zero, zero)),
                      conv=jax.lax.dynamic_update_slice(c.conv, s[1][None].astype(c.conv.dtype),
                                                        (row, zero, zero)))
      elif isinstance(c, DSACache):
        c = c.replace(lengths=c.lengths.at[row].set(length))
      out.append(c)
    return out

  return {"take_tokens": jax.jit(take_tokens), "take_state": jax.jit(take_state),
          "put_tokens": jax.jit(put_tokens, donate_argnums=(0,)),
          "put_state": jax.jit(put_state, donate_argnums=(0,))}


def check_cacheable(cache: Sequence[Any]) -> None:
  """The decode state must hold only DSA and delta layers (the kinds the blocks know)."""
  kinds = {type(c).__name__ for c in cache}
  if not kinds <= {"DSACache", "DeltaCache"}:
    raise ValueError(f"prefix cache: unsupported decode-state kinds {sorted(kinds)}; set "
                     "config.serving.prefix_cache_mb=0.")
  if "DSACache" not in kinds:
    raise ValueError("prefix cache: the model has no DSA layer, so blocks have no per-token state to "
                     "key; set config.serving.prefix_cache_mb=0.")


class PrefixCache:
  """The blocks, their LRU order and the accounting (thread: the engine's loop only).

  Args:
    block: tokens per block (B).
    budget_bytes: memory for the blocks' arrays.
  """

  def __init__(self, block: int, budget_bytes: int):
    if block < 1 or budget_bytes < 1:
      raise ValueError(f"PrefixCache: block={block} and budget_bytes={budget_bytes} must be >= 1.")
    self.block, self.budget = block, budget_bytes
    self.blocks: collections.OrderedDict[bytes, Block] = collections.OrderedDict()  # LRU first
    self.nbytes = 0
    self.evictions = 0
    self.epoch = 0  # bumped by clear(): requests admitted before may not add blocks

  def __len__(self) -> int:
    return len(self.blocks)

  def get(self, key: bytes) -> Block | None:
    return self.blocks.get(key)

  def longest(self, keys: Sequence[bytes], need_routing: bool = False) -> list[Block]:
    """The chain (block 0 first) ending at the last key whose block has a snapshot; [] if none.

    need_routing: only chains whose every block recorded its experts (RL's routing replay).
    """
    for j in range(len(keys) - 1, -1, -1):
      b = self.blocks.get(keys[j])
      if b is None or b.state is None:
        continue
      chain = []
      while b is not None:
        chain.append(b)
        b = b.parent
      chain.reverse()
      if need_routing and any(c.routing is None for c in chain):
        continue
      return chain
    return []

  def touch(self, chain: Sequence[Block]) -> None:
    """Marks a chain used now (ancestors first, so a leaf stays the most recent)."""
    for b in chain:
      self.blocks.move_to_end(b.key)

  def add(self, key: bytes, parent: Block | None, index: int, tokens: Any, state: Any | None,
          routing: np.ndarray | None) -> Block | None:
    """A new block (the caller checked the key is absent), or None when it cannot fit."""
    size = _nbytes(tokens) + (_nbytes(state) if state is not None else 0)
    size += routing.nbytes if routing is not None else 0
    if not self._make_room(size):
      return None
    b = Block(key, parent, index, tokens, size, state, routing)
    self.blocks[key] = b
    self.nbytes += size
    if parent is not None:
      parent.children += 1
    return b

  def add_state(self, b: Block, state: Any) -> bool:
    """Gives an existing block its snapshot; False when it cannot fit."""
    size = _nbytes(state)
    if not self._room_beside(b, size):
      return False
    b.state = state
    b.nbytes += size
    self.nbytes += size
    return True

  def add_routing(self, b: Block, routing: np.ndarray) -> bool:
    """Gives an existing block the experts of its tokens; False when they cannot fit (the block
    then serves requests that do not record routing, as before)."""
    if not self._room_beside(b, routing.nbytes):
      return False
    b.routing = routing
    b.nbytes += routing.nbytes
    self.nbytes += routing.nbytes
    return True

  def _room_beside(self, b: Block, size: int) -> bool:
    """_make_room for `size` more bytes on block b, which is not evicted to make it."""
    b.refs += 1
    try:
      return self._make_room(size)
    finally:
      b.refs -= 1

  def _make_room(self, size: int) -> bool:
    if size > self.budget:
      return False
    while self.nbytes + size > self.budget:
      victim = next((b for b in self.blocks.values() if b.refs == 0 and b.children == 0), None)
      if victim is None:
        return False
      self._drop(victim)
      self.evictions += 1
    return True

  def _drop(self, b: Block) -> None:
    del self.blocks[b.key]
    self.nbytes -= b.nbytes
    if b.parent is not None:
      b.parent.children -= 1

  def clear(self) -> None:
    """Forgets every block (new weights); running requests stop adding to the cache."""
    self.blocks.clear()
    self.nbytes = 0
    self.epoch += 1


class Prefixer:
  """The engine's side: a new row loads its prompt's longest cached prefix, and a running row adds
  the blocks it completes (thread: the engine's loop). Rows are `serving.batch.Slot`s.

  Args:
    store: the blocks.
    prefill_chunk: the engine's chunk (a multiple of store.block).
    exact: cache only what whole prefill chunks computed, so resumes land where a cold run's
      chunks end and are bit-identical to it; else decode steps' blocks are cached too.
    image_token_id: the image placeholder id.
  """

  def __init__(self, store: PrefixCache, *, prefill_chunk: int, exact: bool, image_token_id: int):
    self.store, self.fns = store, dict(cache_programs(store.block))
    self.prefill_chunk, self.exact, self.image_token_id = prefill_chunk, bool(exact), image_token_id

  def load(self, cache: Any, i: int, s: Any) -> tuple[Any, int]:
    """(cache with row i's longest cached prefix loaded, tokens reused); >= 1 token is left to prefill."""
    pc = self.store
    s.cache_epoch = pc.epoch
    s.image_extra = image_extra_fn(s.prompt, s.handle.request.images, self.image_token_id)
    s.keys = block_keys(b"", s.prompt, pc.block, 0, (len(s.prompt) - 1) // pc.block, s.image_extra)
    chain = pc.longest(s.keys, need_routing=s.routing is not None)
    if not chain:
      return cache, 0
    pc.touch(chain)
    for b in chain:
      b.refs += 1
    s.chain = chain  # before the device calls: a failed one ends the row, and its end gives the refs back
    row = np.int32(i)
    for b in chain:
      cache = self.fns["put_tokens"](cache, row, np.int32(b.index * pc.block), b.tokens)
    end = len(chain) * pc.block
    cache = self.fns["put_state"](cache, row, chain[-1].state, np.int32(end))
    s.fed = s.cache_len = s.cached = end
    s.images_fed = int(np.sum(s.prompt[:end] == self.image_token_id))
    if s.routing is not None:
      s.routing = [b.routing for b in chain]
    return cache, end

  def add_blocks(self, cache: Any, i: int, s: Any, decoded: bool = False) -> None:
    """Caches the blocks row i (slot s) completed since the last call (decoded: by a decode step),
    with a snapshot where it stands on a block's end."""
    pc = self.store
    if s.cache_epoch != pc.epoch:
      return
    if self.exact and (decoded or s.cache_len % self.prefill_chunk):
      return  # exact: only what whole prefill chunks computed (a narrower one may round differently)
    B, fns, row = pc.block, self.fns, np.int32(i)
    while (len(s.chain) + 1) * B <= s.cache_len:
      j = len(s.chain)
      if j >= len(s.keys):
        fed = np.concatenate([s.prompt, np.asarray(s.generated, np.int32)])[:(j + 1) * B]
        s.keys += block_keys(s.keys[-1] if s.keys else b"", fed, B, len(s.keys), j + 1 - len(s.keys),
                             s.image_extra)
      at_end = (j + 1) * B == s.cache_len
      routing = np.concatenate(s.routing)[j * B:(j + 1) * B] if s.routing else None
      b = pc.get(s.keys[j])
      if b is None:
        tokens = fns["take_tokens"](cache, row, np.int32(j * B))
        state = fns["take_state"](cache, row) if at_end else None
        b = pc.add(s.keys[j], s.chain[-1] if s.chain else None, j, tokens, state, routing)
        if b is None:  # no room even after evicting: this request caches nothing more
          s.cache_epoch = -1
          return
      else:
        if at_end and b.state is None:
          pc.add_state(b, fns["take_state"](cache, row))
        if b.routing is None and routing is not None:
          pc.add_routing(b, routing)
        pc.touch([b])
      b.refs += 1
      s.chain.append(b)


def build_prefixer(mb: float, block: int, prefill_chunk: int, exact: bool, image_token_id: int,
                   cache: Sequence[Any]) -> Prefixer | None:
  """The engine's prefix cache from its settings (None when mb is 0); errors name the field."""
  check_prefix_settings(mb, block, prefill_chunk)
  if not mb:
    return None
  check_cacheable(cache)
  return Prefixer(PrefixCache(int(block), int(mb * 2**20)), prefill_chunk=prefill_chunk, exact=exact,
                  image_token_id=image_token_id)
