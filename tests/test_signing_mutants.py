"""serving.signing edge cases that mutation testing found unchecked: the documented HMAC formulas
written out, truncated / foreign / altered signatures and sealed payloads, odd argument types."""

import base64
import hashlib
import hmac
import json

import pytest

from serving import signing
from serving.anthropic_request import InvalidRequest, parse_request

KEY = "schl\u00fcssel \u2603".encode()  # config.serving.signing_key "schlüssel ☃" as UTF-8
TEXT = "Erst rechnen, dann antworten: 17 * 23 = 391. " * 3  # 138 bytes: five keystream blocks


def _hmac(key: bytes, msg: bytes) -> bytes:
  return hmac.new(key, msg, hashlib.sha256).digest()


def test_signature_is_the_documented_hmac():
  """base64(HMAC-SHA256(key, domain || utf8(thinking))) with the key from config as UTF-8."""
  key = signing.signing_key("schl\u00fcssel \u2603")
  assert key == b"schl\xc3\xbcssel \xe2\x98\x83"
  want = base64.b64encode(_hmac(key, b"horizon.thinking.signature.v1\x00" + TEXT.encode())).decode()
  assert signing.sign_thinking(key, TEXT) == want and len(want) == 44
  assert signing.sign_thinking(bytearray(key), TEXT) == want


def test_truncated_or_extended_signatures_are_refused():
  sig = signing.sign_thinking(KEY, TEXT)
  assert signing.verify_thinking(KEY, TEXT, sig)
  for bad in ["", sig[:1], sig[:-1], sig[:-4], sig[:40], sig + "A", sig + "=", " " + sig]:
    assert not signing.verify_thinking(KEY, TEXT, bad), bad


def test_verify_never_raises_on_odd_types():
  sig = signing.sign_thinking(KEY, TEXT)
  assert not signing.verify_thinking(KEY, None, sig)
  assert not signing.verify_thinking(KEY, 17, sig)
  assert not signing.verify_thinking(KEY, TEXT, None)
  assert not signing.verify_thinking(KEY, TEXT, sig.encode())
  assert not signing.verify_thinking(KEY, "a\ud800", sig)  # a lone surrogate: JSON allows "\ud800"


def test_thinking_with_a_lone_surrogate_is_a_400_not_a_crash(serve_config):
  """json.loads turns the escape "\\ud800" into a lone surrogate, which UTF-8 cannot encode: the
  signature check raised UnicodeEncodeError (a 500) instead of refusing the block."""
  body = json.loads('{"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "x"}, '
                    '{"role": "assistant", "content": [{"type": "thinking", "thinking": "a\\ud800", '
                    '"signature": "AAAA"}]}, {"role": "user", "content": "y"}]}')
  assert body["messages"][1]["content"][0]["thinking"] == "a\ud800"
  with pytest.raises(InvalidRequest, match="Invalid `signature` in `thinking` block"):
    parse_request(body, serving=serve_config.serving, key=KEY, decode_image=None)


@pytest.mark.parametrize("key", [b"", bytearray(), "text key", None])
def test_keys_must_be_non_empty_bytes(key):
  for call in (lambda: signing.sign_thinking(key, TEXT), lambda: signing.verify_thinking(key, TEXT, "x"),
               lambda: signing.seal_thinking(key, TEXT), lambda: signing.unseal_thinking(key, "x")):
    with pytest.raises(ValueError, match="non-empty bytes"):
      call()


def test_signing_key_from_config_must_be_a_str():
  with pytest.raises(TypeError, match="expected a str"):
    signing.signing_key(b"bytes")


def _open(key: bytes, sealed: str) -> str:
  """The documented sealing, undone by hand: version 1 | nonce(16) | ciphertext | tag(32)."""
  raw = base64.b64decode(sealed)
  nonce, body, tag = raw[1:17], raw[17:-32], raw[-32:]
  k_enc = _hmac(key, b"horizon.sealed_thinking.encrypt.v1")
  k_mac = _hmac(key, b"horizon.sealed_thinking.mac.v1")
  assert raw[0] == 1 and tag == _hmac(k_mac, b"\x01" + nonce + body)
  stream = b"".join(_hmac(k_enc, nonce + i.to_bytes(8, "big")) for i in range(5))
  return bytes(a ^ b for a, b in zip(body, stream, strict=False)).decode()


def test_sealed_thinking_follows_the_documented_construction():
  sealed = signing.seal_thinking(KEY, TEXT)
  assert len(base64.b64decode(sealed)) == 1 + 16 + len(TEXT.encode()) + 32
  assert _open(KEY, sealed) == TEXT
  assert signing.unseal_thinking(KEY, sealed) == TEXT


def test_empty_thinking_seals_and_opens():
  sealed = signing.seal_thinking(KEY, "")
  assert len(base64.b64decode(sealed)) == 49
  assert signing.unseal_thinking(KEY, sealed) == ""


def _reseal(sealed: str, i: int) -> str:
  raw = bytearray(base64.b64decode(sealed))
  raw[i] ^= 0x01
  return base64.b64encode(bytes(raw)).decode()


def test_every_altered_byte_is_refused():
  """Version, each nonce byte, ciphertext and every tag byte (the last 16 too) are all checked."""
  sealed = signing.seal_thinking(KEY, "kurz")
  n = len(base64.b64decode(sealed))
  assert n == 1 + 16 + 4 + 32
  for i in range(n):
    assert signing.unseal_thinking(KEY, _reseal(sealed, i)) is None, i


def test_malformed_sealed_payloads_are_refused():
  sealed = signing.seal_thinking(KEY, TEXT)
  raw = base64.b64decode(sealed)
  for bad in [None, 12, sealed[:-4], sealed[:40] + "!" + sealed[40:], sealed[:40] + "\u00e9" + sealed[40:],
              base64.b64encode(raw[:48]).decode(), base64.b64encode(raw + b"\x00").decode(), ""]:
    assert signing.unseal_thinking(KEY, bad) is None, bad
  assert signing.unseal_thinking(b"another key", sealed) is None
