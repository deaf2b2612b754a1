"""decode_image: formats, data URLs / base64 / bytes, resizing, and the errors clients see."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from serving.images import decode_image, sniff_media_type

SIZE = 11  # odd output size on purpose


def _picture(w=13, h=7, mode="RGB", seed=0):
  rng = np.random.default_rng(seed)
  arr = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
  return Image.fromarray(arr if len(mode) > 1 else arr[..., 0], mode)


def _encode(img, fmt, **kw):
  buf = io.BytesIO()
  img.save(buf, format=fmt, **kw)
  return buf.getvalue()


def _reference(img, size=SIZE, mode="RGB"):
  out = np.asarray(img.convert(mode).resize((size, size), Image.BICUBIC), np.float32) / 255.0
  return out.reshape(size, size, -1)


@pytest.mark.parametrize("fmt", ["PNG", "GIF", "WEBP"])
def test_lossless_round_trip(fmt):
  img = _picture()
  kw = {"lossless": True} if fmt == "WEBP" else {}
  data = _encode(img, fmt, **kw)
  got = decode_image(data, SIZE)
  ref = _reference(Image.open(io.BytesIO(data)))  # GIF quantises to a palette: compare like with like
  assert got.dtype == np.float32 and got.shape == (SIZE, SIZE, 3)
  np.testing.assert_array_equal(got, ref)
  assert 0.0 <= got.min() and got.max() <= 1.0
  if fmt != "GIF":  # lossless codec at its own (square) size: exactly the original pixels
    square = _picture(9, 9, seed=1)
    same = decode_image(_encode(square, fmt, **kw), 9)
    np.testing.assert_array_equal(same, np.asarray(square, np.float32) / 255.0)


def test_jpeg_round_trip_close():
  img = Image.fromarray(np.tile(np.linspace(0, 255, 40, dtype=np.uint8)[None, :, None], (30, 1, 3)))
  got = decode_image(_encode(img, "JPEG", quality=95), SIZE)
  ref = _reference(img)
  assert got.shape == (SIZE, SIZE, 3)
  assert np.abs(got - ref).max() < 0.05  # lossy codec on a smooth gradient


def test_data_url_raw_base64_and_bytes_agree():
  data = _encode(_picture(), "PNG")
  b64 = base64.b64encode(data).decode()
  wrapped = "\n".join(b64[i:i + 60] for i in range(0, len(b64), 60))  # MIME-style line breaks
  outs = [decode_image(data, SIZE), decode_image(b64, SIZE),
          decode_image(f"data:image/png;base64,{b64}", SIZE),
          decode_image("DATA:image/png;x=y;base64," + wrapped, SIZE),
          decode_image(base64.urlsafe_b64encode(data).decode().rstrip("="), SIZE),
          decode_image(bytearray(data), SIZE)]
  for o in outs[1:]:
    np.testing.assert_array_equal(o, outs[0])


def test_modes_and_transparency():
  rgba = Image.new("RGBA", (6, 5), (10, 200, 30, 0))  # fully transparent: white after compositing
  got = decode_image(_encode(rgba, "PNG"), 4)
  np.testing.assert_array_equal(got, np.ones((4, 4, 3), np.float32))
  gray = _picture(mode="L")
  got = decode_image(_encode(gray, "PNG"), SIZE, channels=1)
  assert got.shape == (SIZE, SIZE, 1)
  np.testing.assert_array_equal(got, _reference(gray, mode="L"))
  rgb_from_gray = decode_image(_encode(gray, "PNG"), SIZE)
  assert rgb_from_gray.shape == (SIZE, SIZE, 3)
  np.testing.assert_array_equal(rgb_from_gray[..., 0], rgb_from_gray[..., 2])


def test_sixteen_bit_grey_is_scaled_not_clipped():
  """Pillow opens it as I;16 / I and convert('L') clipped at 255: every such image was white."""
  levels = np.array([[0, 1000, 32768, 65535]], np.uint16).repeat(4, axis=0)
  png = _encode(Image.fromarray(levels), "PNG")
  assert Image.open(io.BytesIO(png)).mode.startswith("I")
  got = decode_image(png, 4, channels=1)[..., 0]  # the same size: no resampling
  np.testing.assert_allclose(got, np.rint(levels / 257.0) / 255.0, rtol=0, atol=1e-7)
  mid = _encode(Image.fromarray(np.full((8, 8), 32768, np.uint16)), "PNG")
  np.testing.assert_allclose(decode_image(mid, 4), 128 / 255, rtol=0, atol=1e-6)  # was 1.0 (white)


def test_animated_gif_first_frame():
  frames = [Image.new("RGB", (5, 5), c) for c in [(255, 0, 0), (0, 0, 255)]]
  buf = io.BytesIO()
  frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
  got = decode_image(buf.getvalue(), 3)
  assert got[..., 0].min() > 0.9 and got[..., 2].max() < 0.1


@pytest.mark.parametrize("source, match", [
    ("https://example.com/cat.png", "image URLs are not fetched by this server"),
    ("  http://x/y.jpg", "image URLs are not fetched"),
    ("data:image/png,notbase64", "not base64-encoded"),
    ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain'"),
    ("data:image/png;base64", "data URL is malformed"),
    ("not base64 at all!!", "not valid base64"),
    ("", "is empty"),
    (base64.b64encode(b"GIF89a but truncated").decode(), "could not be decoded"),
    (base64.b64encode(b"hello world, not an image").decode(), "could not be decoded"),
    (12345, "expected a data URL"),
])
def test_errors(source, match):
  with pytest.raises(ValueError, match=match):
    decode_image(source, SIZE)


def test_unsupported_format_and_truncated():
  with pytest.raises(ValueError, match="PNG, JPEG, GIF and WebP"):
    decode_image(_encode(_picture(), "BMP"), SIZE)
  data = _encode(_picture(64, 64, seed=3), "PNG")
  with pytest.raises(ValueError, match="truncated or corrupt"):
    decode_image(data[:len(data) // 2], SIZE)
  with pytest.raises(ValueError, match="image_size"):
    decode_image(data, 0)
  with pytest.raises(ValueError, match="channels"):
    decode_image(data, SIZE, channels=2)


def test_huge_image_rejected_before_decoding():
  # A 1-bit PNG of 9000 x 8000 = 72 megapixels compresses to a few kB.
  big = _encode(Image.new("1", (9000, 8000)), "PNG")
  assert len(big) < 100_000
  with pytest.raises(ValueError, match=r"9000x8000 = 72.0 megapixels, more than the 64 megapixel limit"):
    decode_image(big, SIZE)
  bomb = _encode(Image.new("1", (20000, 10000)), "PNG")  # past Pillow's own bomb limit
  with pytest.raises(ValueError, match="larger than 64 megapixels"):
    decode_image(bomb, SIZE)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_exif_orientation_is_applied(fmt, orientation):
  """A phone photo stored sideways with an EXIF Orientation tag is seen upright (as viewers show it)."""
  from PIL import ImageOps
  img = _picture(12, 6, seed=4)
  exif = img.getexif()
  exif[0x0112] = orientation
  kw = {"quality": 95} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}
  data = _encode(img, fmt, exif=exif.tobytes(), **kw)
  upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
  assert upright.size == ((6, 12) if orientation >= 5 else (12, 6))
  np.testing.assert_array_equal(decode_image(data, SIZE), _reference(upright))


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")  # Pillow's, from Image.open
def test_malformed_exif_is_ignored():
  data = _encode(_picture(), "JPEG", exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff")
  assert decode_image(data, SIZE).shape == (SIZE, SIZE, 3)


@pytest.mark.parametrize("mode, colour", [("RGB", (0, 0, 0)), ("L", 0)])
def test_transparent_colour_key_becomes_white(mode, colour):
  """PNG tRNS on an RGB or grey image marks one colour transparent; like alpha, it shows white."""
  img = Image.new(mode, (6, 5), colour)
  img.paste((255, 0, 0) if mode == "RGB" else 200, (0, 0, 3, 5))  # left half opaque
  data = _encode(img, "PNG", transparency=colour)
  got = decode_image(data, 6)
  rgba = Image.open(io.BytesIO(data)).convert("RGBA")
  assert rgba.getpixel((5, 0))[3] == 0  # Pillow reads the key as alpha 0
  want = Image.alpha_composite(Image.new("RGBA", (6, 5), (255,) * 4), rgba)
  np.testing.assert_array_equal(got, _reference(want, 6))
  assert got[:, -1].min() == 1.0  # the transparent right edge is white, not black


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"),
                                       ("WEBP", "image/webp")])
def test_sniff_media_type(fmt, mime):
  data = _encode(_picture(seed=3), fmt)
  text = base64.b64encode(data).decode()
  assert sniff_media_type(text) == mime
  urlsafe = base64.urlsafe_b64encode(data).decode()
  assert sniff_media_type("\n ".join(urlsafe[i:i + 5] for i in range(0, 60, 5))) == mime  # wrapped lines
  # not an image signature, not base64, too short: None (decoding then names the problem)
  assert sniff_media_type(base64.b64encode(b"BM6\x00\x00\x00\x00\x00" + data).decode()) is None
  assert sniff_media_type("%%%%" + text) is None and sniff_media_type("") is None
  # GIF87a's signature and a RIFF container that is not WebP (a WAV file's header)
  assert sniff_media_type(base64.b64encode(b"GIF87a" + bytes(10)).decode()) == "image/gif"
  assert sniff_media_type(base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode()) is None
