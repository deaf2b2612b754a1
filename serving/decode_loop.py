"""The engine's decode program: 1 to K decode + sample steps in one device call.

A decode step feeds every decoding row its pending token and samples the next (serving/sampling.py:
per-row keys from the seed and `n_generated`, counted on the device). One step per call costs a
host sync and a Python pass over the rows per token; when no row needs the host between tokens
(`run_ahead`), one call runs up to K = `decode_steps` steps in a `jax.lax.while_loop` and stops
a row on the device when it samples one of its stop ids or reaches its token budget (min of
max_tokens and the context left). The host then delivers each row's tokens through the engine's
usual accept path, which reaches the same finish reasons at the same tokens.

Every decode step the engine runs, one at a time or K at a time, goes through this one compiled
program (fixed shapes; the step count is an argument), so a request's tokens and log-probs do not
depend on how the engine happened to group its steps (XLA compiles the same maths differently in
different programs: a separate one-step program differed in the last bit of some indexer keys).

A row stops on the device at one of its stop ids (finished), at its token budget, or at a
token its processor asked to see first (`FreeRun.pause_ids`: for the chat processor, the
special tokens that change its phase); a paused row's last token stays pending, as after a
one-step call. A processor that finishes its request on the host (a stop string) ends the row
there and the row's later tokens of the run are dropped (computed, never delivered).

Eligibility: `run_ahead`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.layers import scatter_set
from serving.batch import open_rows, sampling_args, shared_by_graphdef
from serving.sampling import sample_batch
from serving.types import FreeRun


@shared_by_graphdef  # shared by engines over models of one config (batch.compile_programs)
def compile_decode_loop(graphdef: nnx.GraphDef, steps: int) -> Callable:
  """jit(decode_loop)(state, cache, rows int32 [B], tokens [B], active bool [B], budget int32 [B], stop
  bool [B, V], temperature, top_k, top_p, mask bool [B, V], forced int32 [B], seed_lo, seed_hi,
  n_generated, max_steps int32 [], yield_on_stop bool []) -> (tokens int32 [B, K], logprobs f32
  [B, K], counts int32 [B], routed int32 [B, K, moe layers, k] or None, cache), K = `steps`. The
  call computes B of the cache's S rows: row j of every [B] input and output is the cache's row
  `rows[j]` (distinct; B = S computes the cache in place, B < S gathers those rows and writes them
  back, one program per B). At most max_steps <= K steps; row j produced counts[j] tokens (its
  first counts[j] columns) and stops after one in its `stop` row or at its budget; with
  yield_on_stop the call ends after the step at which its first row stops (the others keep their
  state and pending token); forced (>= 0) replaces a row's draw (one-step calls only);
  routed[j, i]: the experts of the token fed at step i (the pending one, then each sampled one but
  the last). The decode state is donated."""

  def decode_loop(state, cache, rows_in, tokens, active, budget, stop, temperature, top_k, top_p, mask,
                  forced, seed_lo, seed_hi, n_generated, max_steps, yield_on_stop):
    model = nnx.merge(graphdef, state)
    s = tokens.shape[0]
    whole = s == jax.tree.leaves(cache)[0].shape[0]  # B = S: every row, in place
    full, cache = cache, (cache if whole else jax.tree.map(lambda a: a[rows_in], cache))
    rows = jnp.arange(s)
    n_moe = sum(kind == "moe" for kind in model.cfg.ffn_kinds)

    def body(carry):
      i, cache, fed, live, count, out_t, out_lp, out_r = carry
      logits, cache, routed = model.prefill(fed[:, None], live.astype(jnp.int32), cache,
                                            return_routing=True)
      new, lp = sample_batch(logits[:, 0], temperature, top_k, top_p, mask, forced, seed_lo, seed_hi,
                             n_generated + count.astype(jnp.uint32))
      out_t = out_t.at[:, i].set(jnp.where(live, new, -1))
      out_lp = out_lp.at[:, i].set(jnp.where(live, lp, 0.0))
      if n_moe:
        out_r = out_r.at[:, i].set(routed[:, 0])
      count = count + live.astype(jnp.int32)
      stopped = stop[rows, new] | (count >= budget)
      return i + 1, cache, jnp.where(live, new, fed), live & ~stopped, count, out_t, out_lp, out_r

    live0 = active & (budget > 0)

    def cond(carry):
      one_stopped = jnp.any(live0 & ~carry[3])
      return (carry[0] < jnp.minimum(max_steps, steps)) & jnp.any(carry[3]) & ~(yield_on_stop & one_stopped)

    routed0 = jnp.zeros((s, steps, n_moe, model.cfg.experts_per_token) if n_moe else (0,), jnp.int32)
    init = (jnp.int32(0), cache, tokens, live0, jnp.zeros((s,), jnp.int32),
            jnp.full((s, steps), -1, jnp.int32), jnp.zeros((s, steps), jnp.float32), routed0)
    _, cache, _, _, count, out_t, out_lp, out_r = jax.lax.while_loop(cond, body, init)
    if not whole:
      cache = jax.tree.map(lambda a, b: scatter_set(a, rows_in, b), full, cache)
    return out_t, out_lp, count, (out_r if n_moe else None), cache

  return jax.jit(decode_loop, donate_argnums=(1,))


def input_specs(slots: int, vocab_size: int) -> tuple:
  """jax.ShapeDtypeStruct of each argument after (state, cache) of compile_decode_loop's program for
  `slots` rows (B), in order (serving/weights.engine_castable traces the program with them)."""
  spec = jax.ShapeDtypeStruct
  i32, f32, u32, b = ((slots,), jnp.int32), ((slots,), jnp.float32), ((slots,), jnp.uint32), ((slots,), bool)
  table = ((slots, vocab_size), bool)
  # rows, tokens, active, budget, stop, temperature, top_k, top_p, mask, forced, seed_lo, seed_hi,
  # n_generated, max_steps, yield_on_stop
  return tuple(spec(*a) for a in (i32, i32, b, i32, table, f32, i32, f32, table, i32, u32, u32, u32,
                                  ((), jnp.int32), ((), bool)))


class Call(NamedTuple):
  """One decode call's host inputs: program(state, cache, *head, mask, forced, *tail, max_steps,
  yield_on_stop)."""
  head: tuple  # tokens, active, budget, stop [S, V]
  sampling: tuple  # temperature, top_k, top_p
  mask: np.ndarray | None  # bool [S, V]; None: no row constrained
  forced: np.ndarray  # int32 [S], -1: none
  tail: tuple  # seed_lo, seed_hi, n_generated
  max_steps: int
  yield_on_stop: bool = False  # end the call when its first row stops (a request waits for a slot)


def row_buckets(slots: int, batch_invariant: bool) -> tuple[int, ...]:
  """Row counts B the engine compiles the decode program for: all S slots alone when batch-invariant;
  else the powers of two from 2 up to S, and S (a call computes the smallest B that holds its
  decoding rows). Not 1: XLA:CPU lowers a one-row bf16 matmul through f32 and hoists the weights'
  conversion out of the loop, converting every weight at every call (and its matrix-vector kernel
  rounds differently from the matrix-matrix one that 2..S rows share)."""
  if batch_invariant or slots <= 2:
    return (slots,)
  return tuple(sorted({min(slots, 1 << k) for k in range(1, slots.bit_length() + 1)}))


def select_rows(call: Call, buckets: Sequence[int]) -> tuple[np.ndarray, Call]:
  """(rows [B], the call restricted to them): B is the smallest bucket holding the call's active rows,
  which come first in slot order, then the lowest idle slots (inactive in the call) to fill B."""
  active = call.head[1]
  live = np.flatnonzero(active)
  b = next((n for n in buckets if n >= len(live)), len(active))
  if b == len(active):
    rows = np.arange(b, dtype=np.int32)
  else:
    rows = np.concatenate([live, np.flatnonzero(~active)[:b - len(live)]]).astype(np.int32)
  pick = lambda xs: tuple(x[rows] for x in xs)  # noqa: E731
  return rows, Call(pick(call.head), pick(call.sampling), None if call.mask is None else call.mask[rows],
                    call.forced[rows], pick(call.tail), call.max_steps, call.yield_on_stop)


def _free_run(slot: Any, vocab_size: int) -> FreeRun | None:
  """The row's FreeRun, checked; None (one step per call, under next_constraint) when it has none, it
  raises, or it breaks FreeRun's contract (a mask not a bool [<= V] allowing some token, pause_ids not
  ids): unchecked, such a run failed the whole step and every request running in it."""
  proc = slot.processor
  if proc is None:
    return FreeRun(None, frozenset(), 1 << 30)
  ask = getattr(proc, "free_run", None)
  if ask is None:
    return None
  try:
    run = ask()
    if run is None:
      return None
    mask = None if run.mask is None else np.asarray(run.mask, bool)
    if mask is not None and (mask.ndim != 1 or len(mask) > vocab_size or not mask.any()):
      return None
    return FreeRun(mask, frozenset(int(t) for t in run.pause_ids), int(run.max_tokens))
  except Exception:  # the one-step path asks next_constraint and fails the row if that raises too
    return None


def run_ahead(rows: Sequence[Any], waiting: int, block: int | None, max_context: int, vocab_size: int,
              steps: int, open_row: np.ndarray | None = None) -> Call | None:
  """A call of up to `steps` steps for the engine's rows, or None (a row needs the host each token).

  Eligible: no row prefilling (it would wait K tokens) and every decoding row's processor, if any,
  promising a free run of at least one token (`FreeRun`). While requests wait for a slot (every
  slot busy), the call ends at the first row that stops (`yield_on_stop`), so a finished row's slot
  is taken at the same token as with one step per call; a free slot with a request waiting (it came
  after this iteration's admission) gives None: one step, then the next iteration admits it.
  block: the prefix cache's block when it caches decoded blocks (it snapshots a row's state where
  the row stands on a block's end), so a row's run stops at its next block end; None: no limit.
  open_row: bool [V], what a row without a mask may sample (batch.constraints); None: every id.
  """
  if steps < 2 or (waiting and any(s is None for s in rows)):
    return None
  runs: dict[int, FreeRun] = {}
  for i, s in enumerate(rows):
    if s is None:
      continue
    if s.pending is None or s.fed < len(s.prompt):
      return None
    run = _free_run(s, vocab_size)
    if run is None or run.max_tokens < 1:
      return None
    runs[i] = run
  if not runs:
    return None
  budget = {}
  for i, run in runs.items():
    s = rows[i]
    budget[i] = min(run.max_tokens, row_budget(s.params.max_tokens, len(s.generated), len(s.prompt),
                                               max_context))
    if block:
      budget[i] = min(budget[i], block - s.cache_len % block)
  masks = {i: run.mask for i, run in runs.items() if run.mask is not None}
  mask = None
  if masks:
    mask = open_rows(len(rows), vocab_size, open_row)
    for i, m in masks.items():
      mask[i] = False
      mask[i, :len(m)] = np.asarray(m, bool)
  return _call(rows, budget, {i: run.pause_ids for i, run in runs.items()}, mask,
               np.full(len(rows), -1, np.int32), vocab_size, steps, yield_on_stop=waiting > 0)


def one_step(rows: Sequence[Any], decoding: Sequence[int], mask: np.ndarray | None, forced: np.ndarray,
             vocab_size: int) -> Call:
  """A one-step call for rows `decoding` under the constraints the engine asked their processors
  for (serving/batch.constraints: mask [S, V] or None, forced [S])."""
  return _call(rows, {int(i): 1 for i in decoding}, {}, mask, forced, vocab_size, 1)


def _call(rows, budget: dict[int, int], pauses: dict[int, frozenset[int]], mask, forced, vocab_size: int,
          max_steps: int, yield_on_stop: bool = False) -> Call:
  n = len(rows)
  tokens, budgets = np.zeros(n, np.int32), np.zeros(n, np.int32)
  active, stop = np.zeros(n, bool), np.zeros((n, vocab_size), bool)
  for i, b in budget.items():
    s = rows[i]
    tokens[i], active[i], budgets[i] = s.pending, True, b
    stop[i, [t for t in s.stop_ids | pauses.get(i, frozenset()) if 0 <= t < vocab_size]] = True
  temp, top_k, top_p, lo, hi, n_gen = sampling_args(rows, list(budget))
  return Call((tokens, active, budgets, stop), (temp, top_k, top_p), mask, forced, (lo, hi, n_gen),
              max_steps, yield_on_stop)


def row_budget(max_tokens: int, generated: int, prompt: int, max_context: int) -> int:
  """Tokens a row may still generate: the engine finishes it with "length" at the one that reaches
  max_tokens or fills the context."""
  return max(0, min(max_tokens - generated, max_context - prompt - generated))
