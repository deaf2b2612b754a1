"""Trains Horizon's byte-level BPE tokenizer on the standard-library corpus.

    python -m experiments.train_tokenizer --config=configs/horizon.py:tiny
    python -m experiments.train_tokenizer --config=configs/horizon.py:small
    python -m experiments.train_tokenizer --config=configs/horizon.py:agent   # one digit per token
    python -m experiments.train_tokenizer --config=configs/horizon.py:full --out=/tmp/tok.json

The vocabulary has exactly config.model.vocab_size ids: 256 bytes, BPE merges,
then training.tokenizer.SPECIAL_TOKENS (<|image|> last, which must equal
config.model.image_token_id). The file is checked before it is written, so a
config mismatch never overwrites a bundled tokenizer, and an existing file with other
contents is replaced only with --overwrite. Training is
deterministic: the same corpus (the interpreter's stdlib, first --max_bytes in
sorted-path order) gives the same file byte for byte.

Prints vocab size, bytes per token on held-out stdlib files (none of their
bytes are in the training text) and the special ids; last line JSON.
"""

import hashlib
import json
import platform

from absl import flags
from etils import epath

from experiments.config_util import define_config_flag, run_app
from training import tokenizer as tok_lib

_CONFIG = define_config_flag()
_OUT = flags.DEFINE_string("out", None, "Output tokenizer.json; default: the bundled asset "
                           "training/assets/tokenizer_<variant>.json (tiny and small only).")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", tok_lib.DEFAULT_CORPUS_BYTES,
                                  "Training bytes: the first N of the stdlib corpus.")
_MAX_DIGITS = flags.DEFINE_integer("max_digits", None, "Longest digit run in one piece (1-3); default: "
                                   "the bundled setting for the variant (agent: 1), else 3.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing tokenizer file with different "
                                "contents (checkpoints trained with the old one would decode wrongly).")
_HELDOUT_BYTES = flags.DEFINE_integer("heldout_bytes", tok_lib.DEFAULT_HELDOUT_BYTES,
                                      "Held-out bytes (whole files after the training bytes).")


def _out_path(config) -> str:
  if _OUT.value:
    return _OUT.value
  try:
    return tok_lib.default_tokenizer_path(config.get("variant", ""))
  except ValueError as e:
    raise SystemExit(f"--out is required for this config: {e}") from None


def _check_out(out: epath.Path) -> None:
  """Before training: an --out that cannot be written as a file (a directory, or a file where a
  parent directory should be) ended the run after the training, with a traceback."""
  if out.is_dir():
    raise SystemExit(f"--out={out} is a directory; give the tokenizer file's path (e.g. "
                     f"{out / 'tokenizer.json'}). Nothing was written.")
  for parent in out.parents:
    if parent.exists():
      if not parent.is_dir():
        raise SystemExit(f"--out={out}: {parent} is a file, not a directory. Nothing was written.")
      return


def _check_replace(out: epath.Path, data: bytes) -> None:
  """An existing tokenizer with other contents is replaced only with --overwrite.

  Same-size vocabularies load into the same checkpoints, so a silently replaced tokenizer (by
  default the bundled asset) would make every checkpoint trained with the old one decode
  wrongly. Rebuilding the same file is allowed: training is deterministic.
  """
  if not out.exists() or _OVERWRITE.value:
    return
  old = out.read_bytes()
  if old != data:
    sha = lambda b: hashlib.sha256(b).hexdigest()[:16]  # noqa: E731
    raise SystemExit(f"{out} exists with other contents (sha256 {sha(old)}…, new {sha(data)}…); "
                     "checkpoints trained with it would decode wrongly with the new one. Pass --out=<new "
                     "path>, or --overwrite to replace it. Nothing was written.")


def main(argv):
  del argv
  config = _CONFIG.value
  vocab, image = config.model.vocab_size, config.model.image_token_id
  out = _out_path(config)
  _check_out(epath.Path(out))
  if _HELDOUT_BYTES.value < 1:  # 0 measured one whole held-out file, as if nothing were asked
    raise SystemExit(f"--heldout_bytes={_HELDOUT_BYTES.value}: must be >= 1 (bytes of held-out text "
                     "to measure; whole files are taken until that many).")
  if _MAX_BYTES.value < 1 << 16:
    raise SystemExit(f"--max_bytes={_MAX_BYTES.value}: train on at least {1 << 16} bytes of the corpus.")
  texts = tok_lib.stdlib_training_texts(_MAX_BYTES.value)
  max_digits = _MAX_DIGITS.value  # 0 is refused below, not read as "the default"
  if max_digits is None:
    max_digits = tok_lib.BUNDLED_MAX_DIGITS.get(config.get("variant", ""), 3)
  try:
    tok_lib.split_pattern(max_digits)
  except ValueError as e:
    raise SystemExit(f"--max_digits: {e}") from None
  try:  # before training: a held-out set the corpus cannot give fails now, with nothing written
    heldout = tok_lib.stdlib_heldout_text(_MAX_BYTES.value, _HELDOUT_BYTES.value)
  except ValueError as e:
    flags_given = f"--max_bytes={_MAX_BYTES.value} / --heldout_bytes={_HELDOUT_BYTES.value}"
    raise SystemExit(f"{flags_given}: {e}") from None
  try:
    data = tok_lib.train_bpe(texts, vocab, max_digits).encode()
  except ValueError as e:  # too few merges in the corpus, or a vocab below 271 ids
    raise SystemExit(f"config.model.vocab_size={vocab}: {e}") from None
  tok = tok_lib.tokenizer_from_bytes(data, out)
  if tok.vocab_size != vocab or tok.image_id != image:
    raise SystemExit(
        f"trained {tok.vocab_size} ids with <|image|> = {tok.image_id}, but the config has "
        f"config.model.vocab_size={vocab} and config.model.image_token_id={image}; the tokenizer's "
        f"<|image|> is its last id, so set image_token_id = vocab_size - 1 (a padded vocab such as "
        "tiny_sharded's reuses the unpadded variant's tokenizer). Nothing was written.")
  _check_replace(epath.Path(out), data)
  epath.Path(out).parent.mkdir(parents=True, exist_ok=True)
  epath.Path(out).write_bytes(data)

  heldout_bytes = len(heldout.encode("utf-8"))
  ids = tok.encode(heldout)
  assert tok.decode(ids) == heldout, "round trip failed on the held-out text"
  corpus_sha = hashlib.sha256("".join(texts).encode("utf-8")).hexdigest()
  result = {
      "out": out, "vocab_size": tok.vocab_size,
      "merges": tok.vocab_size - 256 - len(tok_lib.SPECIAL_TOKENS),
      "train_bytes": _MAX_BYTES.value, "heldout_bytes": heldout_bytes,
      "heldout_bytes_per_token": heldout_bytes / len(ids),
      "heldout_tokens_per_byte": len(ids) / heldout_bytes,
      "special_ids": tok.special_ids, "fingerprint": tok.fingerprint,
      "corpus_sha256": corpus_sha, "max_digits": max_digits, "python": platform.python_version()}
  print(f"wrote {out} ({len(data):,} bytes, sha256 {tok.fingerprint[:16]})")
  print(f"vocab size {tok.vocab_size}: 256 bytes + {result['merges']} merges + "
        f"{len(tok_lib.SPECIAL_TOKENS)} special tokens")
  print(f"held-out: {heldout_bytes:,} bytes -> {len(ids):,} tokens = "
        f"{result['heldout_bytes_per_token']:.3f} bytes/token")
  print("special ids: " + ", ".join(f"{t}={i}" for t, i in tok.special_ids.items()))
  print(json.dumps(result))


if __name__ == "__main__":
  run_app(main)
