"""Horizon's tokenizer: byte-level BPE plus one set of special tokens.

Byte-level BPE (Sennrich et al., 2016, "Neural Machine Translation of Rare
Words with Subword Units"; byte-level variant: Radford et al., 2019, GPT-2)
works on UTF-8 bytes, so every string -- code, any script, emoji, broken
encodings -- is representable with no unknown token, and
`decode(encode(x)) == x` for every `x`.

Text is first split into pieces with the GPT-4 (`cl100k_base`) split pattern
in the form Llama 3's tokenizer.json publishes (`SPLIT_PATTERN`: no possessive
quantifiers and no `$`, so the Rust `regex`/`fancy-regex` engine of tiktoken
and the Oniguruma engine of HF `tokenizers` split identically). It keeps
letters, runs of up to 3 digits, punctuation runs and whitespace runs apart,
so merges never cross a word boundary and numbers are not memorised whole.

Special tokens (chat roles, end of turn, thinking, tool call/result, image
placeholder, padding) are defined once, here, as `SPECIAL_TOKENS`; training,
RL and serving look ids up by name. In a Horizon-trained tokenizer they are the
last 15 ids, `<|image|>` the very last (= `config.model.image_token_id`).

Two file formats load by path (`load_tokenizer`), told apart by content:
  * HF `tokenizers` JSON (`tokenizer.json`, what `experiments/train_tokenizer`
    writes; also most Hub models' files);
  * tiktoken BPE rank files (`*.tiktoken`: one `base64(token) rank` per line).
    They carry no special tokens; Horizon's are appended after the last rank.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import tiktoken
import tokenizers
from etils import epath

from model.config import ConfigError

_log = logging.getLogger(__name__)

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>", "<|bos|>", "<|eos|>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end_of_turn|>",
    "<|think|>", "<|/think|>",
    "<|tool_call|>", "<|/tool_call|>", "<|tool_result|>", "<|/tool_result|>",
    "<|image|>",
)

# GPT-4's cl100k_base split pattern as published in Llama 3's tokenizer.json.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")



def split_pattern(max_digits: int = 3) -> str:
  """SPLIT_PATTERN with runs of at most `max_digits` digits (1: every digit its own piece).

  One digit per piece (as Llama 1/2 split numbers) gives every number the same
  digit-by-digit spelling, so column arithmetic is learnt from ten digit tokens
  instead of memorised over a thousand 1-3 digit ones; the pattern is saved in
  the tokenizer.json, so a file always splits as it was trained.
  """
  if not 1 <= max_digits <= 3:
    raise ValueError(f"max_digits={max_digits}: choose 1, 2 or 3 digits per piece.")
  return SPLIT_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}" if max_digits == 1 else rf"\p{{N}}{{1,{max_digits}}}")


ASSETS_DIR = Path(__file__).resolve().parent / "assets"
# Variants whose tokenizer ships with the repo (tiny_sharded pads tiny's 331 ids to 332).
_BUNDLED = {"tiny": "tokenizer_tiny.json", "tiny_sharded": "tokenizer_tiny.json",
            "small": "tokenizer_small.json", "agent": "tokenizer_agent.json"}
# Digits per piece of the bundled tokenizers (3 unless named): `agent` does column arithmetic.
BUNDLED_MAX_DIGITS = {"agent": 1}
_CREATE_HINT = "python -m experiments.train_tokenizer --config=configs/horizon.py:<variant> --out=PATH"

DEFAULT_CORPUS_BYTES = 8 << 20  # training bytes of the stdlib corpus (training.byte_corpus)
DEFAULT_HELDOUT_BYTES = 1 << 18  # held-out bytes: whole files after the training bytes


class _HFBackend:
  """HF `tokenizers` JSON. Two instances: one matches special strings, one treats them as text."""

  kind = "huggingface"

  def __init__(self, tok: tokenizers.Tokenizer):
    tok.no_truncation()  # a foreign tokenizer.json may pad/truncate; encode must be lossless
    tok.no_padding()
    self._special = tokenizers.Tokenizer.from_str(tok.to_str())  # picks up the two calls above
    self._plain = tokenizers.Tokenizer.from_str(tok.to_str())
    self._plain.encode_special_tokens = True
    self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

  def __setstate__(self, state: dict) -> None:
    # Pickling an HF tokenizer drops `encode_special_tokens`; without this,
    # data-loader workers would turn "<|user|>" in user text into a special id.
    self.__dict__.update(state)
    self._plain.encode_special_tokens = True

  def token_id(self, token: str) -> int | None:
    return self._plain.token_to_id(token)

  def encode(self, text: str, allow_special: bool) -> list[int]:
    # add_special_tokens=False: no post-processor template (e.g. an implicit BOS);
    # callers add <|bos|>/<|eos|> explicitly.
    tok = self._special if allow_special else self._plain
    return tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str], allow_special: bool) -> list[list[int]]:
    tok = self._special if allow_special else self._plain
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids: list[int]) -> str:
    return self._plain.decode(ids, skip_special_tokens=False)


class _TiktokenBackend:
  """A tiktoken rank file plus Horizon's special tokens after its last rank."""

  kind = "tiktoken"

  def __init__(self, ranks: dict[bytes, int], name: str):
    first = max(ranks.values()) + 1
    specials = {t: first + i for i, t in enumerate(SPECIAL_TOKENS)}
    self._enc = tiktoken.Encoding(name, pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                                  special_tokens=specials)
    self._specials = specials
    self.special_ids = frozenset(specials.values())
    self.vocab_size = self._enc.n_vocab

  def token_id(self, token: str) -> int | None:
    return self._specials.get(token)

  def encode(self, text: str, allow_special: bool) -> list[int]:
    if allow_special:
      return self._enc.encode(text, allowed_special="all")
    return self._enc.encode_ordinary(text)

  def encode_batch(self, texts: list[str], allow_special: bool) -> list[list[int]]:
    if allow_special:
      return self._enc.encode_batch(texts, allowed_special="all")
    return self._enc.encode_ordinary_batch(texts)

  def decode(self, ids: list[int]) -> str:
    return self._enc.decode(ids)  # invalid UTF-8 (a cut multi-byte char) -> U+FFFD, as HF


class Tokenizer:
  """Text <-> token ids with Horizon's special tokens; build with `load_tokenizer`.

  Attributes:
    path: where the file was read from.
    fingerprint: sha256 (hex) of the file's bytes, recorded by data manifests
      so token ids are never mixed across tokenizers.
    kind: "huggingface" or "tiktoken".
    vocab_size: number of ids (largest id + 1); the model's embedding must
      have at least this many rows.
  """

  def __init__(self, backend: _HFBackend | _TiktokenBackend, path: str, fingerprint: str):
    self._backend = backend
    self.path = path
    self.fingerprint = fingerprint
    self.kind = backend.kind
    self.vocab_size = backend.vocab_size
    ids = {t: backend.token_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
      raise ValueError(f"tokenizer {path}: special tokens {missing} have no id.")
    if len(set(ids.values())) != len(ids):
      raise ValueError(f"tokenizer {path}: two special tokens share an id ({ids}).")
    self._special_ids: dict[str, int] = ids  # type: ignore[assignment]
    self._skip = backend.special_ids | frozenset(ids.values())

  def __repr__(self) -> str:
    return (f"Tokenizer(path={self.path!r}, kind={self.kind!r}, vocab_size={self.vocab_size}, "
            f"fingerprint={self.fingerprint[:12]}...)")

  @property
  def special_ids(self) -> dict[str, int]:
    """{special token string: id} for every entry of SPECIAL_TOKENS."""
    return dict(self._special_ids)

  def special_id(self, name: str) -> int:
    """The id of a special token, by full string ("<|image|>") or bare name ("image")."""
    token = name if name.startswith("<|") else f"<|{name}|>"
    if token not in self._special_ids:
      raise KeyError(f"special_id({name!r}): not a Horizon special token; choose one of "
                     f"{list(SPECIAL_TOKENS)} (or the bare name, e.g. 'image').")
    return self._special_ids[token]

  @property
  def pad_id(self) -> int:
    return self._special_ids["<|pad|>"]

  @property
  def bos_id(self) -> int:
    return self._special_ids["<|bos|>"]

  @property
  def eos_id(self) -> int:
    return self._special_ids["<|eos|>"]

  @property
  def image_id(self) -> int:
    return self._special_ids["<|image|>"]

  def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
    """Token ids of `text`; never adds BOS/EOS (callers add them explicitly).

    Args:
      text: the string to encode.
      allow_special: if False (default), special-token strings inside `text`
        (e.g. a user typing "<|assistant|>") are encoded as ordinary text, so
        user, document or tool content cannot forge a role switch, end of
        turn or tool call (prompt injection). Only code that renders trusted
        templates (the chat format) passes True.

    Returns:
      [len] ids in [0, vocab_size).
    """
    if not isinstance(text, str):
      raise TypeError(f"encode(text=...): expected str, got {type(text).__name__}; "
                      "use encode_batch for a list of strings.")
    return self._backend.encode(text, allow_special)

  def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False) -> list[list[int]]:
    """`encode` over many strings (multi-threaded in both backends): [n] lists of ids."""
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
      raise TypeError("encode_batch(texts=...): expected a sequence of str; use encode for one string.")
    return self._backend.encode_batch(list(texts), allow_special)

  def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = False) -> str:
    """The text of `ids` ([len] ints); `skip_special` drops special tokens first.

    Bytes that do not form valid UTF-8 (a sequence cut inside a character)
    decode to U+FFFD; streaming decoders should hold back incomplete tails.
    """
    arr = np.asarray(ids)
    if arr.size == 0:
      return ""
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"decode(ids=...): expected one sequence of ints, got shape {arr.shape} "
                       f"dtype {arr.dtype}; decode rows one at a time.")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= self.vocab_size:
      raise ValueError(f"decode(ids=...): id {lo if lo < 0 else hi} is outside [0, {self.vocab_size}) "
                       f"of tokenizer {self.path}; were these ids made by another tokenizer?")
    out = arr.tolist()
    if skip_special:
      out = [i for i in out if i not in self._skip]
    return self._backend.decode(out)


# ------------------------------------------------------------------ loading --


def _parse_rank_file(data: bytes, path: str) -> dict[bytes, int]:
  """`base64(token) rank` lines -> {token bytes: rank}, validated for byte-level BPE."""
  ranks: dict[bytes, int] = {}
  for lineno, line in enumerate(data.splitlines(), 1):
    if not line.strip():
      continue
    parts = line.split()
    try:
      if len(parts) != 2:
        raise ValueError(f"expected 2 fields, got {len(parts)}")
      token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
    except (ValueError, binascii.Error) as e:
      raise ValueError(
          f"tokenizer file {path} is neither a tokenizer.json (JSON) nor a tiktoken BPE rank file "
          f"('base64token rank' per line): line {lineno}: {e} ({line[:60]!r}).") from None
    if token in ranks or rank < 0 or not token:
      raise ValueError(f"tiktoken rank file {path}: line {lineno}: empty, negative or repeated token.")
    ranks[token] = rank
  if not ranks:
    raise ValueError(f"tokenizer file {path} is empty; create one with `{_CREATE_HINT}`.")
  if len(set(ranks.values())) != len(ranks):
    raise ValueError(f"tiktoken rank file {path}: two tokens share a rank; ranks must be unique.")
  absent = [b for b in range(256) if bytes([b]) not in ranks]
  if absent:
    raise ValueError(f"tiktoken rank file {path}: no token for {len(absent)} single byte values "
                     f"(e.g. {absent[:5]}); byte-level BPE needs all 256 so any text encodes.")
  clash = [t for t in SPECIAL_TOKENS if t.encode() in ranks]
  if clash:
    raise ValueError(f"tiktoken rank file {path}: {clash} are ordinary tokens there, so plain text "
                     "could produce them; remove them from the rank file (Horizon appends its "
                     "special tokens after the last rank).")
  return ranks


def _hf_with_specials(data: bytes, path: str) -> tokenizers.Tokenizer:
  """Parses a tokenizer.json and makes every Horizon special token a special added token."""
  try:
    text = data.decode("utf-8")
    tok = tokenizers.Tokenizer.from_str(text)
    listed = {a["content"]: a["id"] for a in json.loads(text).get("added_tokens", [])}
  except Exception as e:  # the Rust parser raises a bare Exception
    raise ValueError(f"tokenizer file {path} is JSON but not a valid HF tokenizers file "
                     f"(tokenizer.json): {e}") from None
  moved = {t: (i, tok.token_to_id(t)) for t, i in listed.items() if tok.token_to_id(t) != i}
  if moved:  # HF numbers added tokens densely after the model vocab, whatever the file says
    _log.warning("tokenizer %s: HF tokenizers gives %d added tokens other ids than the file lists "
                 "(e.g. %s as (file id, id used)); the ids used are HF's.", path, len(moved),
                 dict(list(moved.items())[:3]))
  missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
  special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
  # Re-adding an existing token marks it special at its current id, so it is
  # matched only with allow_special=True; missing ones get new ids at the end.
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in SPECIAL_TOKENS if t not in special])
  if missing:
    _log.warning("tokenizer %s lacks Horizon special tokens %s; added them as ids %s (the file is "
                 "unchanged; its fingerprint still names it).", path, missing,
                 [tok.token_to_id(t) for t in missing])
  return tok


def tokenizer_from_bytes(data: bytes, path: str = "<bytes>", model_vocab_size: int | None = None,
                         image_token_id: int | None = None) -> Tokenizer:
  """A Tokenizer from a file's contents; see `load_tokenizer` for the checks."""
  fingerprint = hashlib.sha256(data).hexdigest()
  if data.lstrip()[:1] == b"{":
    backend: _HFBackend | _TiktokenBackend = _HFBackend(_hf_with_specials(data, path))
  else:
    backend = _TiktokenBackend(_parse_rank_file(data, path), name=Path(path).stem or "horizon")
  tok = Tokenizer(backend, path, fingerprint)
  if model_vocab_size is not None and tok.vocab_size > model_vocab_size:
    raise ConfigError(f"config.model.vocab_size={model_vocab_size} is smaller than the tokenizer's "
                      f"{tok.vocab_size} ids ({path}); raise it or use a smaller tokenizer.")
  if image_token_id is not None and tok.image_id != image_token_id:
    raise ConfigError(f"config.model.image_token_id={image_token_id} but the tokenizer's <|image|> is "
                      f"{tok.image_id} ({path}); set config.model.image_token_id={tok.image_id} or use "
                      "the tokenizer trained for this config.")
  return tok


class TokenizerError(ValueError):
  """A tokenizer that cannot be used (no bundled one for the variant, a file that is not a
  tokenizer): the message names the file, the setting that chose it and the fix."""


class TokenizerNotFound(TokenizerError, FileNotFoundError):
  """The tokenizer file does not exist."""


def load_tokenizer(path: str, model_vocab_size: int | None = None,
                   image_token_id: int | None = None, field: str = "--config.data.tokenizer") -> Tokenizer:
  """Loads a tokenizer.json or tiktoken rank file (local path or URL, e.g. gs://).

  The format is detected from the content. A directory holding a
  `tokenizer.json` (an HF model folder) is accepted too.

  Args:
    path: the file (or a folder with tokenizer.json).
    model_vocab_size: if given, the tokenizer's ids must fit the embedding.
    image_token_id: if given, must equal the tokenizer's <|image|> id.
    field: the setting that names `path`, for the error (the server's is config.serving.tokenizer).

  Raises:
    TokenizerNotFound (a FileNotFoundError): `path` does not exist.
    TokenizerError (a ValueError): the file is neither format.
    ConfigError: a check against the model above fails.
  """
  p = epath.Path(path)
  if p.is_dir() and (p / "tokenizer.json").exists():
    p = p / "tokenizer.json"
  if not p.exists() or p.is_dir():
    raise TokenizerNotFound(
        f"tokenizer file {str(path)!r} does not exist. Create one with `{_CREATE_HINT}`, or point "
        f"{field} at an existing tokenizer.json / .tiktoken file.")
  try:
    return tokenizer_from_bytes(p.read_bytes(), str(p), model_vocab_size, image_token_id)
  except ConfigError:
    raise
  except ValueError as e:  # what the file holds; the setting that named it is the way out
    raise TokenizerError(f"{e} (the tokenizer named by {field})") from None


def default_tokenizer_path(variant: str, field: str = "--config.data.tokenizer") -> str:
  """The tokenizer bundled for a configs/horizon.py variant (training/assets/); a TokenizerError
  (a ValueError) naming `field`, the setting that would give one, for a variant without one."""
  if variant not in _BUNDLED:
    raise TokenizerError(
        f"no bundled tokenizer for variant {variant!r} (bundled: {sorted(_BUNDLED)}); pass "
        f"{field}=PATH, or train one with `{_CREATE_HINT}`.")
  return str(ASSETS_DIR / _BUNDLED[variant])


# ----------------------------------------------------------------- training --


def _stdlib_files() -> Iterator[bytes]:
  """The stdlib's .py files in training.byte_corpus's order (sorted paths, no site-packages)."""
  root = Path(sysconfig.get_paths()["stdlib"])
  for path in sorted(root.rglob("*.py")):
    if "site-packages" in path.parts:
      continue
    try:
      yield path.read_bytes()
    except OSError:
      continue


def stdlib_heldout_text(max_bytes: int = DEFAULT_CORPUS_BYTES,
                        num_bytes: int = DEFAULT_HELDOUT_BYTES) -> str:
  """Whole stdlib files that start after the first `max_bytes` (none seen in training).

  Offsets follow training.byte_corpus.load_stdlib_bytes (each file + b"\\n");
  files are taken until at least `num_bytes` are collected.
  """
  offset, out, total = 0, [], 0
  for data in _stdlib_files():
    if offset >= max_bytes:
      out.append(data + b"\n")
      total += len(data) + 1
      if total >= num_bytes:
        break
    offset += len(data) + 1
  if total < num_bytes:
    raise ValueError(f"only {total} stdlib bytes lie after the first {max_bytes}; lower max_bytes "
                     "or num_bytes.")
  return b"".join(out).decode("utf-8", errors="replace")


def stdlib_training_texts(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[str]:
  """training.byte_corpus's first `max_bytes`, as the chunks the BPE trainer reads.

  Chunks end at a newline followed by a non-space character; no piece of
  SPLIT_PATTERN spans such a point, so training on the chunks equals training
  on the whole text (chunks only let the trainer count in parallel).
  """
  from training.byte_corpus import load_stdlib_bytes  # imports jax; only needed to train
  text = load_stdlib_bytes(max_bytes).tobytes().decode("utf-8", errors="replace")
  return re.split(r"(?<=\n)(?=\S)", text)


def train_bpe(texts: Iterable[str], vocab_size: int, max_digits: int = 3) -> str:
  """Trains a byte-level BPE and returns its tokenizer.json (HF tokenizers format).

  Args:
    texts: training text (deterministic order; the result depends only on it).
    vocab_size: total ids including SPECIAL_TOKENS: 256 byte tokens, then
      vocab_size - 271 merges, then the 15 special tokens (<|image|> last).
    max_digits: longest run of digits in one piece (`split_pattern`).

  Returns:
    The JSON text; load it with `tokenizer_from_bytes` / `load_tokenizer`.
  """
  base = vocab_size - len(SPECIAL_TOKENS)
  if base < 256:
    raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs >= {256 + len(SPECIAL_TOKENS)} "
                     f"ids (256 bytes + {len(SPECIAL_TOKENS)} special tokens).")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())  # no unk: every byte is a token
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Split(tokenizers.Regex(split_pattern(max_digits)), behavior="isolated"),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=base, show_progress=False, special_tokens=[],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  if tok.get_vocab_size() != base:
    raise ValueError(f"the corpus yielded only {tok.get_vocab_size() - 256} merges, not {base - 256}; "
                     "train on more text (--max_bytes).")
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in SPECIAL_TOKENS])
  return tok.to_str(pretty=True)
