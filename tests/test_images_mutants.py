"""serving.images edge cases that mutation testing found unchecked: byte and pixel limits at their
boundaries, base64 strictness, data-URL spelling, alpha and argument checks (references written out)."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from serving.images import decode_image, image_bytes


def _png(img):
  buf = io.BytesIO()
  img.save(buf, format="PNG")
  return buf.getvalue()


PNG = _png(Image.new("RGB", (5, 4), (10, 20, 30)))
B64 = base64.b64encode(PNG).decode()
PIXEL = np.array([10, 20, 30], np.float32) / 255.0


def _solid(got, rgb=PIXEL):
  np.testing.assert_array_equal(got, np.broadcast_to(rgb, got.shape))


@pytest.mark.parametrize("source", [PNG, B64, "data:image/png;base64," + B64])
def test_byte_limit_is_inclusive_for_every_source_kind(source):
  """An image of exactly max_bytes is accepted; one byte less of limit refuses it."""
  assert image_bytes(source, max_bytes=len(PNG)) == PNG
  with pytest.raises(ValueError, match="MB"):
    image_bytes(source, max_bytes=len(PNG) - 1)
  _solid(decode_image(source, 3, max_bytes=len(PNG)))
  with pytest.raises(ValueError, match="MB"):
    decode_image(source, 3, max_bytes=len(PNG) - 1)


def test_line_broken_base64_at_the_byte_limit_is_accepted():
  """MIME base64 (76 characters a line, CRLF) of a file of exactly max_bytes: the line breaks are
  not image bytes (a 300 kB file's 7.9 k of them was refused as 'about 0.3 MB, more than 0.3 MB')."""
  raw = bytes(np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8))
  text = base64.b64encode(raw).decode()
  wrapped = "\r\n".join(text[i:i + 76] for i in range(0, len(text), 76))
  assert image_bytes(wrapped, max_bytes=300_000) == raw
  assert image_bytes("data:image/png;base64," + wrapped, max_bytes=300_000) == raw
  with pytest.raises(ValueError, match="limit"):
    image_bytes(wrapped, max_bytes=299_999)


def test_oversized_text_is_refused_before_base64_decoding():
  """The size check comes first: 40 000 characters cannot hold a file of at most 1000 bytes, whatever
  they are (here not even base64)."""
  with pytest.raises(ValueError, match="about 0.0 MB, more than the server's limit"):
    image_bytes("!" * 40_000, max_bytes=1000)


@pytest.mark.parametrize("n", [30, 31, 32])
def test_unpadded_base64_of_every_length(n):
  raw = bytes(range(n))
  text = base64.b64encode(raw).decode().rstrip("=")
  assert len(text) % 4 == {30: 0, 31: 2, 32: 3}[n]
  assert image_bytes(text) == raw


def test_characters_outside_base64_are_refused_not_skipped():
  with pytest.raises(ValueError, match="not valid base64"):
    image_bytes(B64[:20] + "*" + B64[20:])
  with pytest.raises(ValueError, match="not valid base64"):
    image_bytes("data:image/png;base64," + B64[:8] + "." + B64[8:])


@pytest.mark.parametrize("url", [
    "DATA:IMAGE/PNG;BASE64," + B64,  # scheme, media type and ;base64 are case-insensitive (RFC 2397)
    "data:Image/Png;Base64," + B64,
    "  \n data:image/png;base64," + B64 + " \n",  # surrounding whitespace
])
def test_data_url_spellings(url):
  assert image_bytes(url) == PNG


def test_data_url_without_a_media_type_is_accepted_but_a_wrong_one_is_not():
  assert image_bytes("data:;base64," + B64) == PNG
  with pytest.raises(ValueError, match="'application/octet-stream'"):
    image_bytes("data:application/octet-stream;base64," + B64)


def test_memoryview_and_bytearray_sources():
  assert image_bytes(memoryview(PNG)) == PNG
  _solid(decode_image(memoryview(PNG), 2))
  _solid(decode_image(bytearray(PNG), 2))
  with pytest.raises(ValueError, match="limit"):
    image_bytes(memoryview(PNG), max_bytes=10)


def test_pixel_limit_is_inclusive():
  """5 x 4 = 20 pixels: accepted at max_pixels=20, refused at 19."""
  _solid(decode_image(PNG, 3, max_pixels=20))
  with pytest.raises(ValueError, match=r"5x4 = 0.0 megapixels, more than the 1.9e-05 megapixel limit"):
    decode_image(PNG, 3, max_pixels=19)


def test_grey_with_alpha_is_composited_onto_white():
  """A transparent LA (grey + alpha) PNG shows white, like an RGBA one; half alpha blends."""
  clear = _png(Image.new("LA", (3, 3), (0, 0)))
  np.testing.assert_array_equal(decode_image(clear, 3, channels=1), np.ones((3, 3, 1), np.float32))
  np.testing.assert_array_equal(decode_image(clear, 3), np.ones((3, 3, 3), np.float32))


def test_half_transparent_black_blends_with_opaque_white():
  """alpha 128 over opaque white: 255 * (1 - 128/255) = 127 in every channel."""
  half = _png(Image.new("RGBA", (2, 2), (0, 0, 0, 128)))
  np.testing.assert_array_equal(decode_image(half, 2), np.full((2, 2, 3), 127 / 255, np.float32))


@pytest.mark.parametrize("size, channels", [(np.int64(3), 3), (np.int32(3), np.int64(1)), (3, np.uint8(3))])
def test_numpy_integer_sizes_and_channels(size, channels):
  got = decode_image(PNG, size, channels)
  assert got.shape == (3, 3, int(channels))
  if int(channels) == 3:
    _solid(got)


@pytest.mark.parametrize("kw, match", [
    ({"image_size": 3.0}, "image_size"), ({"image_size": True}, "image_size"),
    ({"image_size": "3"}, "image_size"),
    ({"image_size": 3, "channels": 4}, "channels"), ({"image_size": 3, "channels": 3.0}, "channels"),
    ({"image_size": 3, "channels": True}, "channels"),
])
def test_non_integer_size_or_channels_are_refused_up_front(kw, match):
  with pytest.raises(ValueError, match=match):
    decode_image(PNG, **kw)
