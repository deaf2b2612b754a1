"""Per-row sampling for the engine: temperature, top-k, top-p, allowed-token masks, forced tokens.

Each row is sampled by itself (`jax.vmap` over rows) with its own key
`fold_in(fold_in(PRNGKey(seed), 0), n_generated)`: a request's draw depends
only on its logits, its parameters, its seed and how many tokens it has
generated, never on the other rows of the batch or on when it was admitted
(the spec's batch-invariance requirement). Filters follow the usual order:
mask, temperature, top-k (Fan et al., 2018), then nucleus top-p (Holtzman et
al., 2020, "The Curious Case of Neural Text Degeneration") over what remains.

Shapes: S rows, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def request_key(seed_lo, seed_hi, n_generated):
  """fold_in(fold_in(PRNGKey(seed), 0), n_generated); seeds >= 2**32 fold their high word in first."""
  key = jax.random.PRNGKey(seed_lo)
  key = jnp.where(seed_hi != 0, jax.random.fold_in(key, seed_hi), key)
  return jax.random.fold_in(jax.random.fold_in(key, 0), n_generated)


def sample_row(logits, temperature, top_k, top_p, mask, forced, seed_lo, seed_hi, n_generated,
               filters: bool = True):
  """Samples one row: logits [V] -> (token int32 [], logprob f32 []).

  Args:
    logits: [V] the model's logits for the next token.
    temperature: [] 0 = greedy (argmax over the allowed tokens).
    top_k: [] keep the k most likely tokens; 0 = off.
    top_p: [] keep the smallest set of most likely tokens with mass >= top_p; 1 = off.
    mask: bool [V] allowed tokens (a processor's constraint; all True when free).
    forced: [] a token that bypasses sampling, or -1.
    seed_lo, seed_hi: uint32 [] the request seed's low and high 32-bit words.
    n_generated: uint32 [] tokens the request has generated so far.
    filters: False leaves out the top-k and top-p code (two sorts of the vocabulary), for rows
      whose top_k is 0 and top_p 1: those filters keep every token, so the result is the same.

  Returns:
    The token and its log-probability under the raw logits (temperature 1, no
    filters): what RL importance ratios and `logprobs` outputs use.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[0]
  logprobs = jax.nn.log_softmax(logits)
  x = jnp.where(mask, logits, -jnp.inf)
  greedy = jnp.argmax(x)
  x = x / jnp.where(temperature > 0, temperature, 1.0)
  if filters:
    desc = jnp.sort(x)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    x = jnp.where(x >= desc[k - 1], x, -jnp.inf)  # top-k (ties at the k-th value are kept)
    p = jax.nn.softmax(x)
    p_desc = jnp.sort(p)[::-1]
    before = jnp.cumsum(p_desc) - p_desc  # mass of strictly more probable tokens
    n_keep = jnp.where(top_p >= 1, vocab, jnp.maximum(jnp.sum(before < top_p), 1))
    x = jnp.where(p >= p_desc[n_keep - 1], x, -jnp.inf)  # top-p (nucleus)
  drawn = jax.random.categorical(request_key(seed_lo, seed_hi, n_generated), x)
  token = jnp.where(forced >= 0, forced, jnp.where(temperature > 0, drawn, greedy))
  return token.astype(jnp.int32), logprobs[token]


def sample_batch(logits, temperature, top_k, top_p, *row_args):
  """`sample_row` over the rows of logits [S, V] -> tokens [S], logprobs [S].

  The top-k/top-p sorts (two per row, most of the cost at S = 16, V = 8192 on CPU) run only when
  some sampled row asks for a filter (`lax.cond` on the whole batch); rows that ask for none get
  the same tokens and log-probs either way, so no row depends on what the others asked for.
  """
  needed = jnp.any((temperature > 0) & ((top_k > 0) | (top_p < 1)))
  args = (logits, temperature, top_k, top_p, *row_args)
  return jax.lax.cond(needed, lambda a: jax.vmap(sample_row)(*a),
                      lambda a: jax.vmap(functools.partial(sample_row, filters=False))(*a), args)


def sample_rows(prefill_logits, decode_logits, from_prefill, *row_args):
  """[S, V] logits (each row from the prefill or the decode call) -> tokens [S], logprobs [S]."""
  return sample_batch(jnp.where(from_prefill[:, None], prefill_logits, decode_logits), *row_args)
