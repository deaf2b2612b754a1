"""training/tokenizer.py checks that mutation testing found unpinned: a negative rank in a tiktoken
file, and two special tokens sharing one id."""

import base64
import types

import pytest

from training import tokenizer as tok_lib
from training.tokenizer import SPECIAL_TOKENS


def test_negative_rank_is_refused(tmp_path):
  lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
  lines.append(f"{base64.b64encode(b'ab').decode()} -3")
  path = tmp_path / "neg.tiktoken"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=r"neg.tiktoken: line 257: empty, negative or repeated token"):
    tok_lib.load_tokenizer(str(path))


def test_special_tokens_sharing_an_id_are_refused():
  ids = {t: 40 + i for i, t in enumerate(SPECIAL_TOKENS)}
  ids["<|bos|>"] = ids["<|pad|>"]
  backend = types.SimpleNamespace(kind="fake", vocab_size=64, special_ids=frozenset(), token_id=ids.get)
  with pytest.raises(ValueError, match=r"tokenizer fake.json: two special tokens share an id"):
    tok_lib.Tokenizer(backend, "fake.json", "f" * 64)
  ids["<|bos|>"] = 39
  assert tok_lib.Tokenizer(backend, "fake.json", "f" * 64).bos_id == 39
