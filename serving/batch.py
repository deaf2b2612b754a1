"""The engine's batch: per-slot request state, the jitted programs over all slots, row constraints.

Why prefill and decode are separate calls with fixed shapes: a request's
numerics must not depend on what else runs. Prefill runs one row's chunk per
call ([1, W], W the smallest of C, C/2, C/4 that holds the chunk; the row
sliced out of the decode state and written back), so its cost follows the
rows that prefill: a [S, C] call would compute S chunks for one new request,
and under agent traffic some row prefills at almost every iteration. Every
computation in the model is per row (attention, the delta rule, dropless MoE
whose per-token result does not depend on the other tokens' routing), a
chunk's shape depends on the request alone (the prefill always takes image
patches, zeros when a chunk has none), and
sampling is `vmap`ped per row with a per-request key
`fold_in(fold_in(PRNGKey(seed), 0), n_generated)` (serving/sampling.py); so
the same request and seed give bit-identical tokens alone or among others, in
any slot (tests/test_engine.py; checked on XLA:CPU in f32 and bf16, where MoE
runs the 'blocked' grouped matmul). On TPU/GPU this relies on XLA's native
ragged dot computing each row independently of where the expert-group
boundaries fall. That holds for decode calls over all S slots (the engine's
`batch_invariant=True`); a decode call over a row bucket (serving/decode_loop.py)
is another program, whose last bits may differ.

The model enters the programs as `nnx.split` graphdef + state: the state is
an argument (so `Engine.update_weights` swaps weights without recompiling),
and the decode state is donated.

Shapes: S slots, C prefill chunk, V vocab, d model dim.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.decoder import reset_cache_rows
from serving.admission import TOP_K_MAX
from serving.handle import Handle
from serving.sampling import sample_rows
from serving.types import SamplingParams, TokenProcessor

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Slot:
  """A request occupying one batch row."""
  handle: Handle
  prompt: np.ndarray  # int32 [P]
  stop_ids: frozenset[int]
  seed: int
  patches: np.ndarray | None = None  # f32 [m * num_patches, d]: encoded at admission
  fed: int = 0  # prompt tokens prefilled so far
  cached: int = 0  # prompt tokens loaded from the prefix cache at admission (usage's cached tokens)
  images_fed: int = 0  # image placeholders prefilled so far
  cache_len: int = 0  # tokens in this row's decode state
  generated: list[int] = dataclasses.field(default_factory=list)
  pending: int | None = None  # the last sampled token, fed by the next decode step
  last_time: float = 0.0
  routing: list[np.ndarray] | None = None  # record_routing: int32 [n, layers, k] per fed chunk
  # Prefix cache (serving/prefix_cache.py): the blocks this row loaded or wrote, block 0 first
  # (held until it finishes); the keys of its blocks so far; the cache epoch it was admitted in
  # (-1: it adds nothing); the image part of its keys.
  chain: list = dataclasses.field(default_factory=list)
  keys: list[bytes] = dataclasses.field(default_factory=list)
  cache_epoch: int = -1
  image_extra: Callable[[int, int], bytes] | None = None

  @property
  def params(self) -> SamplingParams:
    return self.handle.request.params

  @property
  def processor(self) -> TokenProcessor | None:
    return self.handle.request.processor


def chunk_inputs(slot: Slot, chunk: np.ndarray, width: int, cfg, no_images: jax.Array
                 ) -> tuple[np.ndarray, jax.Array]:
  """A prefill chunk's inputs: tokens [1, width] (right-padded) and image_embeds [1, width, d].

  The chunk's image placeholders take the request's next patches, in order (`slot.images_fed`
  advances); a chunk without placeholders gets `no_images` (zeros kept on the device).
  """
  tokens = np.zeros((1, width), np.int32)
  tokens[0, :len(chunk)] = chunk
  n_img = int(np.sum(chunk == cfg.image_token_id))
  if not n_img:
    return tokens, no_images
  patches = np.zeros((1, width, cfg.d_model), np.float32)
  patches[0, :n_img] = slot.patches[slot.images_fed:slot.images_fed + n_img]
  slot.images_fed += n_img
  return tokens, jnp.asarray(patches, cfg.jnp_dtype)


def shared_by_graphdef(build: Callable) -> Callable:
  """`build(graphdef, *args)` cached by its arguments (the last 16), so that engines over models of
  one config share what it builds (MXFP4 models included); a graphdef that cannot be hashed
  (a variable's metadata holding a dict) gets a fresh build."""
  cached = functools.lru_cache(maxsize=16)(build)

  @functools.wraps(build)
  def get(graphdef: nnx.GraphDef, *args):
    try:
      hash(graphdef)
    except (TypeError, ValueError):  # flax raises ValueError for a metadata key it cannot sort
      return build(graphdef, *args)
    return cached(graphdef, *args)
  return get


@shared_by_graphdef
def compile_programs(graphdef: nnx.GraphDef) -> dict[str, Callable]:
  """The engine's jitted programs (pure; the model enters as graphdef + state).

  Shared by graphdef (equal for models of one config): engines over such models (a server's engine
  rebuilt in the same process, a benchmark's engines side by side, a test's) share the jitted
  functions, hence their traces and compiled executables, which jit keys by the arguments' shapes,
  dtypes and shardings. Callers copy the dict before changing it.

  prefill(state, cache, row, tokens [1, W], length [1], image_embeds [1, W, d]) -> (last logits [V],
  cache, routed [W, layers, k]): one chunk of one row (W: a prefill width); routed: the MoE experts of
  each fed token (None without MoE layers); reset(cache, rows bool [S]) zeroes rows; encode(state,
  images [1, H, W, C]) -> patches; sample: serving.sampling.sample_rows (a prefilled row's first
  token). Decoding runs in serving/decode_loop.py's program. The decode state (prefill argument 1,
  reset argument 0) is donated.
  """

  def prefill(state, cache, row, tokens, length, image_embeds):
    # One row's chunk: its decode state is sliced out of the batch, extended and written back
    # in place (the cache is donated), so prefill costs the chunk of the rows that prefill,
    # not S chunks, and its shape depends on the chunk alone, not on what else runs.
    model = nnx.merge(graphdef, state)
    sub = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, row, 1, axis=0), cache)
    logits, sub, routed = model.prefill(tokens, length, sub, image_embeds=image_embeds,
                                        return_routing=True)
    cache = jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, row, axis=0), cache, sub)
    return logits[0, jnp.maximum(length[0] - 1, 0)], cache, (None if routed is None else routed[0])

  def encode(state, images):
    return nnx.merge(graphdef, state).encode_images(images)

  return {"prefill": jax.jit(prefill, donate_argnums=(1,)),
          "reset": jax.jit(reset_cache_rows, donate_argnums=(0,)),
          "encode": jax.jit(encode),
          "sample": jax.jit(sample_rows)}


def sampling_args(slots: Sequence[Slot | None], rows: Sequence[int]) -> tuple[np.ndarray, ...]:
  """[S] per-row inputs of serving.sampling.sample_row for `rows` (zeros elsewhere): temperature,
  top_k, top_p, the seed's low and high words, tokens generated so far.

  top_k is clamped to int32 (sample_row keeps every token for a top_k >= the vocabulary), so no
  row's value can overflow and fail the whole step, every running request with it.
  """
  n = len(slots)
  temp, top_k, top_p = np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32)
  lo, hi, n_gen = (np.zeros(n, np.uint32) for _ in range(3))
  for i in rows:
    s = slots[i]
    temp[i], top_p[i] = s.params.temperature, s.params.top_p
    top_k[i] = min(max(int(s.params.top_k), 0), TOP_K_MAX)
    lo[i], hi[i], n_gen[i] = s.seed & 0xFFFFFFFF, s.seed >> 32, len(s.generated)
  return temp, top_k, top_p, lo, hi, n_gen


def _row_constraint(proc: TokenProcessor, vocab_size: int) -> int | np.ndarray | None:
  """A processor's constraint checked: a forced id, a bool [V] mask, or None (free)."""
  c = proc.next_constraint()
  if c is None:
    return None
  if isinstance(c, (int, np.integer)):
    if not 0 <= int(c) < vocab_size:
      raise ValueError(f"forced token {c} is outside the vocabulary [0, {vocab_size}).")
    return int(c)
  allowed = np.zeros(vocab_size, bool)
  c = np.asarray(c, bool)
  if c.ndim != 1 or len(c) > vocab_size or not c.any():
    raise ValueError(f"mask must be a bool [<= {vocab_size}] array allowing some token, "
                     f"got shape {c.shape} with {int(c.sum())} allowed.")
  allowed[:len(c)] = c
  return allowed


def open_rows(n: int, vocab_size: int, open_row: np.ndarray | None) -> np.ndarray:
  """bool [n, V]: every row may sample what open_row allows (every id when it is None)."""
  if open_row is None:
    return np.ones((n, vocab_size), bool)
  return np.repeat(np.asarray(open_row, bool)[None], n, axis=0)


def constraints(slots: Sequence[Slot | None], rows: Sequence[int], vocab_size: int,
                open_row: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
  """Asks each row's processor: forced ids [S] (-1 = none), masks [S, V] (or None), failed rows.

  open_row: bool [V], what an unconstrained row may sample (default every id; the engine passes
  the ids its tokenizer has). A processor that raises (or returns an invalid constraint) fails its
  row only.
  """
  forced = np.full(len(slots), -1, np.int32)
  masks, failed = None, []
  for i in rows:
    proc = slots[i].processor
    if proc is None:
      continue
    try:
      c = _row_constraint(proc, vocab_size)
    except Exception:
      _log.exception("processor.next_constraint failed for %s", slots[i].handle.id)
      failed.append(i)
      continue
    if isinstance(c, int):
      forced[i] = c
    elif c is not None:
      masks = open_rows(len(slots), vocab_size, open_row) if masks is None else masks
      masks[i] = c
  return forced, masks, failed
