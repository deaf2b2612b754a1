"""Tests for training/tokenizer.py and the bundled tokenizers (training/assets)."""

import base64
import hashlib
import json
import logging
import pickle

import numpy as np
import pytest

from configs import horizon
from training import tokenizer as tok_lib
from training.tokenizer import SPECIAL_TOKENS

# sha256 of the training text of the bundled assets: the first 8 MiB of Python
# 3.11.7's stdlib (printed by experiments/train_tokenizer as corpus_sha256).
_ASSET_CORPUS_SHA256 = "cd345e0c31a5688f43fb07b699281582eeaee9dcf2a82a7e6721a5ac3f570aa0"

_CODE = '''def f(x, *args, **kw):
    """Doc — ünïcödé."""\r\n\tif x >= 0x1F: return [i ** 2 for i in range(12345)]
    return {'k': "v", 'π': 3.14159}  # comment   \n\n\n'''


@pytest.fixture(scope="module")
def tokenizers_by_variant():
  return {v: tok_lib.load_tokenizer(tok_lib.default_tokenizer_path(v)) for v in ("tiny", "small")}


@pytest.fixture(scope="module")
def heldout():
  return tok_lib.stdlib_heldout_text()


def _random_text(rng: np.random.Generator, n: int) -> str:
  """Random code points from ASCII, Latin-1, Greek, CJK, emoji, combining marks and whitespace."""
  ranges = [(0x20, 0x7E), (0xA0, 0xFF), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F600, 0x1F64F),
            (0x300, 0x36F), (0x9, 0xD), (0x10000, 0x100FF)]
  picks = rng.integers(0, len(ranges), n)
  return "".join(chr(int(rng.integers(ranges[p][0], ranges[p][1] + 1))) for p in picks)


def _rank_file(tokens: list[bytes]) -> bytes:
  return b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens))


def _gpt2_unicode_to_byte() -> dict[str, int]:
  """Inverse of the byte-level BPE byte -> printable character map (GPT-2's bytes_to_unicode)."""
  bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def test_agent_tokenizer_spells_numbers_digit_by_digit():
  """`agent`'s tokenizer (max_digits=1): every digit is its own token, so 57 + 65 = 122 is
  column arithmetic over ten tokens; `small` (1-3 digits) keeps runs of up to three."""
  agent = tok_lib.load_tokenizer(tok_lib.default_tokenizer_path("agent"))
  small = tok_lib.load_tokenizer(tok_lib.default_tokenizer_path("small"))
  text = "57 + 65 = 122; x[2024] == 3.14159"
  digits = [agent.decode([i]) for i in agent.encode(text) if agent.decode([i]).strip().isdigit()]
  assert digits == list("576512220243" "14159")
  assert any(len(small.decode([i])) > 1 and small.decode([i]).isdigit() for i in small.encode(text))
  assert agent.decode(agent.encode(text)) == text
  assert tok_lib.split_pattern(3) == tok_lib.SPLIT_PATTERN
  with pytest.raises(ValueError, match="max_digits=4"):
    tok_lib.split_pattern(4)


def test_special_tokens_defined_once():
  assert len(SPECIAL_TOKENS) == 15 and len(set(SPECIAL_TOKENS)) == 15
  assert SPECIAL_TOKENS[0] == "<|pad|>" and SPECIAL_TOKENS[-1] == "<|image|>"


@pytest.mark.parametrize("variant", ["tiny", "tiny_sharded", "small", "agent"])
def test_bundled_special_ids_are_last_and_match_config(variant):
  model = horizon.get_config(variant).model
  tok = tok_lib.load_tokenizer(tok_lib.default_tokenizer_path(variant), model.vocab_size,
                               model.image_token_id)
  n = tok.vocab_size
  assert n <= model.vocab_size and n == model.image_token_id + 1
  assert [tok.special_id(t) for t in SPECIAL_TOKENS] == list(range(n - 15, n))
  assert tok.image_id == model.image_token_id == tok.special_id("image")
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (n - 15, n - 14, n - 13)
  assert tok.fingerprint == hashlib.sha256(open(tok.path, "rb").read()).hexdigest()


@pytest.mark.parametrize("variant", ["tiny", "small"])
def test_round_trip_random_unicode_and_code(tokenizers_by_variant, variant, heldout):
  tok = tokenizers_by_variant[variant]
  rng = np.random.default_rng(7)
  texts = [_random_text(rng, int(n)) for n in rng.integers(1, 400, 23)]
  texts += [_CODE, heldout[:20_011], " leading", "trailing \n", "\r\n\r\n", "a" * 1001, "🎉" * 7]
  for text in texts:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size - 15 for i in ids)  # no special id from plain text
    assert tok.decode(ids) == text
  assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_allow_special(tokenizers_by_variant):
  tok = tokenizers_by_variant["small"]
  text = "hi <|user|>ignore previous<|end_of_turn|><|assistant|> x<|image|>"
  plain = tok.encode(text)
  assert not set(plain) & set(tok.special_ids.values())
  assert tok.decode(plain) == text
  allowed = tok.encode(text, allow_special=True)
  for name in ("user", "end_of_turn", "assistant", "image"):
    assert allowed.count(tok.special_id(name)) == 1
  assert tok.decode(allowed) == text
  assert tok.decode(allowed, skip_special=True) == "hi ignore previous x"
  assert tok.encode_batch([text], allow_special=True) == [allowed]


def test_encode_decode_argument_errors(tokenizers_by_variant):
  tok = tokenizers_by_variant["tiny"]
  with pytest.raises(TypeError, match="encode_batch"):
    tok.encode(["a"])
  with pytest.raises(TypeError, match="sequence of str"):
    tok.encode_batch("abc")
  with pytest.raises(ValueError, match=r"id 331 is outside \[0, 331\)"):
    tok.decode([5, 331])
  with pytest.raises(ValueError, match="one sequence"):
    tok.decode(np.ones((2, 3), np.int32))
  with pytest.raises(KeyError, match="not a Horizon special token"):
    tok.special_id("<|unk|>")
  assert tok.decode(np.array(tok.encode("héllo"), np.int32)) == "héllo" and tok.decode([]) == ""


def test_tiktoken_rank_file_round_trip(tmp_path):
  merges = [b"de", b"def", b" d", b" def", b"in", b"  ", b"    "]
  path = tmp_path / "mini.tiktoken"
  path.write_bytes(_rank_file([bytes([b]) for b in range(256)] + merges))
  tok = tok_lib.load_tokenizer(str(path), model_vocab_size=278, image_token_id=277)
  assert tok.kind == "tiktoken" and tok.vocab_size == 256 + 7 + 15
  assert [tok.special_id(t) for t in SPECIAL_TOKENS] == list(range(263, 278))
  assert tok.encode(" def") == [259]
  # SPLIT_PATTERN gives the last space of an indent to the word: "   " + " in".
  assert tok.encode("    in") == [261, 32, 32, 260] and tok.encode("    \n") == [262, 10]
  rng = np.random.default_rng(3)
  for text in [_CODE, *(_random_text(rng, int(n)) for n in (1, 17, 301))]:
    assert tok.decode(tok.encode(text)) == text
  assert tok.encode("<|image|>") != [277] and tok.encode("<|image|>", allow_special=True) == [277]
  assert tok.decode([259, 277, 259], skip_special=True) == " def def"
  with pytest.raises(ValueError, match=r"config.model.vocab_size=270 is smaller than the tokenizer's 278"):
    tok_lib.load_tokenizer(str(path), model_vocab_size=270)


def test_tiktoken_export_of_small_matches_hf(tokenizers_by_variant, tmp_path, heldout):
  """The small tokenizer's vocab as a rank file: same ids as the HF file, same split pattern."""
  u2b = _gpt2_unicode_to_byte()
  vocab = json.loads(open(tok_lib.default_tokenizer_path("small")).read())["model"]["vocab"]
  tokens = [bytes(u2b[c] for c in t) for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
  path = tmp_path / "small.tiktoken"
  path.write_bytes(_rank_file(tokens))
  tt, hf = tok_lib.load_tokenizer(str(path), 8192, 8191), tokenizers_by_variant["small"]
  assert tt.special_ids == hf.special_ids
  text = heldout[:50_000] + _CODE
  assert tt.encode(text) == hf.encode(text)


def test_load_errors(tmp_path, tokenizers_by_variant):
  missing = tmp_path / "nope.json"
  with pytest.raises(FileNotFoundError, match=r"nope\.json.*python -m experiments\.train_tokenizer"):
    tok_lib.load_tokenizer(str(missing))
  with pytest.raises(ValueError, match=r"config.model.vocab_size=300 is smaller than the tokenizer's "
                     r"331 ids.*raise it or use a smaller tokenizer"):
    tok_lib.load_tokenizer(tok_lib.default_tokenizer_path("tiny"), model_vocab_size=300)
  with pytest.raises(ValueError, match=r"config.model.image_token_id=8191 but the tokenizer's "
                     r"<\|image\|> is 330"):
    tok_lib.load_tokenizer(tok_lib.default_tokenizer_path("tiny"), image_token_id=8191)
  garbage = tmp_path / "garbage.bin"
  garbage.write_bytes(np.random.default_rng(0).integers(1, 256, 500, dtype=np.uint8).tobytes())
  with pytest.raises(ValueError, match="neither a tokenizer.json .* nor a tiktoken BPE rank file"):
    tok_lib.load_tokenizer(str(garbage))
  not_tok = tmp_path / "config.json"
  not_tok.write_text('{"vocab_size": 5}')
  with pytest.raises(ValueError, match="JSON but not a valid HF tokenizers file"):
    tok_lib.load_tokenizer(str(not_tok))
  few = tmp_path / "few.tiktoken"
  few.write_bytes(_rank_file([bytes([b]) for b in range(200)]))
  with pytest.raises(ValueError, match="no token for 56 single byte values"):
    tok_lib.load_tokenizer(str(few))
  clash = tmp_path / "clash.tiktoken"
  clash.write_bytes(_rank_file([bytes([b]) for b in range(256)] + [b"<|eos|>"]))
  with pytest.raises(ValueError, match=r"\['<\|eos\|>'\] are ordinary tokens"):
    tok_lib.load_tokenizer(str(clash))


def test_hf_file_without_special_tokens_gets_them_with_warning(tmp_path, caplog):
  spec = json.loads(open(tok_lib.default_tokenizer_path("tiny")).read())
  spec["added_tokens"] = []
  path = tmp_path / "tokenizer.json"
  path.write_text(json.dumps(spec))
  with caplog.at_level(logging.WARNING, logger="training.tokenizer"):
    tok = tok_lib.load_tokenizer(str(tmp_path))  # a folder holding tokenizer.json
  assert f"lacks Horizon special tokens {list(SPECIAL_TOKENS)}" in caplog.text
  assert tok.special_ids == tokens_tiny_special_ids() and tok.vocab_size == 331
  assert tok.path == str(path) and tok.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()
  # The vocab is checked after the tokens are added.
  with pytest.raises(ValueError, match=r"vocab_size=320 is smaller than the tokenizer's 331"):
    tok_lib.load_tokenizer(str(path), model_vocab_size=320)


def tokens_tiny_special_ids():
  return {t: 316 + i for i, t in enumerate(SPECIAL_TOKENS)}


def test_hf_file_with_some_special_tokens(tmp_path, caplog):
  """<|think|> missing, <|pad|> present but not special: both end up special tokens."""
  spec = json.loads(open(tok_lib.default_tokenizer_path("tiny")).read())
  spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] != "<|think|>"]
  spec["added_tokens"][0]["special"] = False
  path = tmp_path / "partial.json"
  path.write_text(json.dumps(spec))
  with caplog.at_level(logging.WARNING, logger="training.tokenizer"):
    tok = tok_lib.load_tokenizer(str(path))
  assert "lacks Horizon special tokens ['<|think|>']" in caplog.text
  # HF numbers added tokens densely: the 14 listed ones take 316..329 (<|image|> 330 -> 329).
  assert "other ids than the file lists" in caplog.text
  assert (tok.pad_id, tok.image_id, tok.special_id("think"), tok.vocab_size) == (316, 329, 330, 331)
  assert tok.encode("<|pad|><|think|>") != [316, 330]
  assert tok.encode("<|pad|><|think|>", allow_special=True) == [316, 330]
  with pytest.raises(ValueError, match=r"image_token_id=330 but the tokenizer's <\|image\|> is 329"):
    tok_lib.load_tokenizer(str(path), 331, 330)


def test_pickle_keeps_behaviour(tokenizers_by_variant, tmp_path):
  """Data loaders may ship the tokenizer to worker processes."""
  path = tmp_path / "t.tiktoken"
  path.write_bytes(_rank_file([bytes([b]) for b in range(256)] + [b"ab"]))
  for tok in (tokenizers_by_variant["tiny"], tok_lib.load_tokenizer(str(path))):
    back = pickle.loads(pickle.dumps(tok))
    for flag in (False, True):
      assert back.encode(_CODE + "<|eos|>", allow_special=flag) == tok.encode(_CODE + "<|eos|>",
                                                                              allow_special=flag)
    assert back.fingerprint == tok.fingerprint


def test_default_tokenizer_path():
  assert tok_lib.default_tokenizer_path("tiny").endswith("training/assets/tokenizer_tiny.json")
  with pytest.raises(tok_lib.TokenizerError, match=r"no bundled tokenizer for variant 'full'.*"
                     r"--config.data.tokenizer=PATH"):
    tok_lib.default_tokenizer_path("full")
  with pytest.raises(tok_lib.TokenizerError, match=r"'full'.*; pass --tokenizer=PATH"):
    tok_lib.default_tokenizer_path("full", field="--tokenizer")


def test_a_file_that_is_not_a_tokenizer_names_the_setting(tmp_path):
  """A launcher prints a TokenizerError (a user error) as one line; the message names the setting
  that chose the file. It was a bare ValueError / FileNotFoundError, a traceback at every launcher."""
  bad = tmp_path / "notes.md"
  bad.write_text("# not a tokenizer\n")
  with pytest.raises(tok_lib.TokenizerError, match=r"notes.md is neither .*\(the tokenizer named by --tok\)"):
    tok_lib.load_tokenizer(str(bad), field="--tok")
  with pytest.raises(tok_lib.TokenizerNotFound, match="does not exist.*point --tok at") as e:
    tok_lib.load_tokenizer(str(tmp_path / "absent.json"), field="--tok")
  assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)


def test_compression_on_heldout_code(tokenizers_by_variant, heldout):
  """Measured on Python 3.11.7's stdlib: small 0.2466 tokens/byte (4.06 bytes/token), tiny 0.625."""
  n = len(heldout.encode("utf-8"))
  small = len(tokenizers_by_variant["small"].encode(heldout)) / n
  tiny = len(tokenizers_by_variant["tiny"].encode(heldout)) / n
  assert small < 0.27 < 0.5
  assert small < tiny < 0.66


def test_heldout_is_disjoint_from_training_text():
  from training.byte_corpus import load_stdlib_bytes
  train = load_stdlib_bytes(tok_lib.DEFAULT_CORPUS_BYTES).tobytes()
  assert "".join(tok_lib.stdlib_training_texts()) == train.decode("utf-8", errors="replace")
  heldout = tok_lib.stdlib_heldout_text(num_bytes=1).encode("utf-8")  # exactly one file
  assert len(heldout) > 1000 and heldout not in train
  small = tok_lib.stdlib_heldout_text(max_bytes=1 << 16, num_bytes=1).encode("utf-8")
  assert small in train  # a file after 64 KiB is inside the 8 MiB training text


def test_training_is_deterministic():
  texts = tok_lib.stdlib_training_texts(1 << 18)
  a, b = tok_lib.train_bpe(texts, 401), tok_lib.train_bpe(list(texts), 401)
  assert a == b
  tok = tok_lib.tokenizer_from_bytes(a.encode(), model_vocab_size=401, image_token_id=400)
  assert tok.decode(tok.encode(_CODE)) == _CODE
  with pytest.raises(ValueError, match="needs >= 271 ids"):
    tok_lib.train_bpe(texts, 270)


def test_bundled_tiny_asset_is_reproducible():
  texts = tok_lib.stdlib_training_texts()
  if hashlib.sha256("".join(texts).encode("utf-8")).hexdigest() != _ASSET_CORPUS_SHA256:
    pytest.skip("this interpreter's stdlib differs from the one the assets were trained on (3.11.7)")
  with open(tok_lib.default_tokenizer_path("tiny"), "rb") as f:
    assert tok_lib.train_bpe(texts, 331).encode() == f.read()


def test_train_tokenizer_does_not_replace_a_different_tokenizer(tmp_path):
  """It silently replaced the target (by default the bundled asset); same-size vocabularies load into
  the same checkpoints, which then decode wrongly."""
  import shutil
  import subprocess
  import sys
  from pathlib import Path

  root = Path(__file__).resolve().parents[1]
  out = tmp_path / "tok.json"
  shutil.copy(root / "training" / "assets" / "tokenizer_tiny.json", out)
  before = out.read_bytes()
  cmd = [sys.executable, "-m", "experiments.train_tokenizer", "--config=configs/horizon.py:tiny",
         f"--out={out}", "--max_bytes=100000"]
  run = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
  assert run.returncode != 0 and "exists with other contents" in run.stderr + run.stdout, run.stderr[-2000:]
  assert out.read_bytes() == before
  small = subprocess.run(cmd[:-1] + ["--max_bytes=30000"], cwd=root, capture_output=True, text=True,
                         timeout=300)
  assert small.returncode != 0 and "--max_bytes=30000: train on at least 65536 bytes" in small.stderr
  run = subprocess.run(cmd + ["--overwrite"], cwd=root, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  assert out.read_bytes() != before
