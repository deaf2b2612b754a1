"""Signatures for Anthropic thinking blocks and the opaque `redacted_thinking` payload.

Anthropic's Messages API (extended thinking) returns every `thinking` block with
a `signature`; a client continuing a tool-use turn must send those blocks back
unchanged, and the API rejects a block whose text was altered. The model reads
its earlier reasoning back (serving/chat.py renders all history thinking), so
the check matters: a client must not be able to put words in the model's
"mind" while claiming the model wrote them.

Signature = base64(HMAC-SHA256(key, domain || utf8(thinking))) (RFC 2104),
compared in constant time (`hmac.compare_digest`). The key is
`config.serving.signing_key` (UTF-8) or, when that is empty, 32 random bytes
drawn at server start: signatures then do not survive a restart, and a
conversation carried across one gets a 400 for its old thinking blocks.

Thinking the client must not read is sealed instead: `redacted_thinking`
blocks carry it as `data`, and thinking blocks requested with `thinking.display:
"omitted"` carry it as their `signature` (empty `thinking` text, as Anthropic
returns them "for multi-turn continuity"). Either way it is an opaque string
the client sends back and the server opens. Sealing is encrypt-then-MAC with HMAC-SHA256 only (no
extra dependency): a keystream HMAC(k_enc, nonce || counter) in counter mode
(HMAC as the PRF, NIST SP 800-108 style key derivation of k_enc / k_mac from
the signing key), then a tag HMAC(k_mac, version || nonce || ciphertext). The
server verifies and decrypts a returned block and renders its thinking back to
the model exactly like a plain thinking block.

When we emit redacted_thinking: never on our own. Anthropic redacts reasoning
its safety systems flag; Horizon has no such classifier, so faking one would be
a fake result. The one exception is Anthropic's documented test trigger
(`REDACTED_THINKING_TRIGGER` in a user message, with thinking enabled): then
every thinking block of the answer is returned redacted, so a client can test
its redacted_thinking handling against this server as it would against
Anthropic's (see serving/anthropic_api.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

# Anthropic's documented test string ("extended thinking: thinking redaction").
REDACTED_THINKING_TRIGGER = ("ANTHROPIC_MAGIC_STRING_TRIGGER_REDACTED_THINKING_"
                             "46C9A13E193C177646C7398A98432ECCCE4C1253D5E2D82641AC0E52CC2876CB")

_SIGN_DOMAIN = b"horizon.thinking.signature.v1\x00"
_ENC_LABEL = b"horizon.sealed_thinking.encrypt.v1"
_MAC_LABEL = b"horizon.sealed_thinking.mac.v1"
_VERSION = b"\x01"
_NONCE = 16  # bytes
_TAG = 32  # bytes (SHA-256)


def signing_key(configured: str) -> bytes:
  """The HMAC key: `config.serving.signing_key` as UTF-8, or 32 random bytes when it is empty."""
  if not isinstance(configured, str):
    raise TypeError(f"signing_key: expected a str (config.serving.signing_key), got {type(configured)}.")
  return configured.encode("utf-8") if configured else secrets.token_bytes(32)


def _check_key(key: bytes) -> None:
  if not isinstance(key, (bytes, bytearray)) or not key:
    raise ValueError("key: expected non-empty bytes; build it with serving.signing.signing_key(config).")


def sign_thinking(key: bytes, thinking: str) -> str:
  """The signature of a thinking block's text: base64 of an HMAC-SHA256 (44 characters)."""
  _check_key(key)
  mac = hmac.new(bytes(key), _SIGN_DOMAIN + thinking.encode("utf-8"), hashlib.sha256).digest()
  return base64.b64encode(mac).decode("ascii")


def verify_thinking(key: bytes, thinking: str, signature: str) -> bool:
  """True iff `signature` was made by `sign_thinking(key, thinking)`; constant-time, never raises."""
  _check_key(key)
  if not isinstance(thinking, str) or not isinstance(signature, str):
    return False
  try:
    expected = sign_thinking(key, thinking).encode("ascii")
    given = signature.encode("ascii")
  except UnicodeEncodeError:  # non-ASCII signature, or a lone surrogate (JSON "\ud800") in the text
    return False
  return hmac.compare_digest(expected, given)


def _subkey(key: bytes, label: bytes) -> bytes:
  return hmac.new(bytes(key), label, hashlib.sha256).digest()


def _keystream_xor(k_enc: bytes, nonce: bytes, data: bytes) -> bytes:
  """data XOR the HMAC-SHA256 counter-mode keystream (encrypts and decrypts)."""
  blocks = (len(data) + 31) // 32
  stream = b"".join(hmac.new(k_enc, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest()
                    for i in range(blocks))
  return bytes(a ^ b for a, b in zip(data, stream, strict=False))


def seal_thinking(key: bytes, thinking: str) -> str:
  """Sealed thinking: base64(version | nonce | ciphertext | tag), opaque to the client."""
  _check_key(key)
  nonce = secrets.token_bytes(_NONCE)
  body = _keystream_xor(_subkey(key, _ENC_LABEL), nonce, thinking.encode("utf-8"))
  tag = hmac.new(_subkey(key, _MAC_LABEL), _VERSION + nonce + body, hashlib.sha256).digest()
  return base64.b64encode(_VERSION + nonce + body + tag).decode("ascii")


def unseal_thinking(key: bytes, data: str) -> str | None:
  """The thinking text inside `seal_thinking(key, ...)`'s output, or None when not authentic.

  None for anything this server (with this key) did not make: bad base64, a
  wrong version, a truncated payload, a failed tag check. Never raises.
  """
  _check_key(key)
  try:
    raw = base64.b64decode(data.encode("ascii"), validate=True)
  except (binascii.Error, UnicodeEncodeError, AttributeError):
    return None
  if len(raw) < 1 + _NONCE + _TAG or raw[:1] != _VERSION:
    return None
  nonce, body, tag = raw[1:1 + _NONCE], raw[1 + _NONCE:-_TAG], raw[-_TAG:]
  expected = hmac.new(_subkey(key, _MAC_LABEL), _VERSION + nonce + body, hashlib.sha256).digest()
  if not hmac.compare_digest(expected, tag):
    return None
  try:
    return _keystream_xor(_subkey(key, _ENC_LABEL), nonce, body).decode("utf-8")
  except UnicodeDecodeError:
    return None
