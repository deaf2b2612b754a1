"""Request images (base64 / data URLs) -> the float arrays the vision encoder takes.

Both APIs carry images inline: OpenAI as `image_url.url` (a data URL),
Anthropic as `source: {type: base64, media_type, data}`. The server has no
network, so http(s) URLs are refused with a message saying what to send
instead. Decoding is restricted to PNG, JPEG, GIF and WebP (Pillow), and both
sizes are bounded before the work they would cost: the encoded file's bytes
(`config.serving.max_image_bytes`) from the base64 text's length (whitespace aside), before it is
decoded, and the pixel count (`config.serving.max_image_pixels`) from the
header, before any pixel is decoded, so a small compressed "decompression
bomb" cannot exhaust memory. The API front-ends call `decode_image` in a
worker thread (Pillow releases the GIL while it decodes), never on the event
loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings

import numpy as np
from PIL import Image

from model.config import is_int

MAX_PIXELS = 64_000_000  # default pixel bound: larger images are rejected before decoding
FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
_MODES = {1: "L", 3: "RGB"}
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL | re.IGNORECASE)


def _b64_chars(text: str) -> str:
  """Base64 text without whitespace, in the standard alphabet (URL-safe '-' and '_' mapped)."""
  s = re.sub(r"\s+", "", text)
  return s.replace("-", "+").replace("_", "/") if "-" in s or "_" in s else s


def _padded(s: str) -> str:
  return s + "=" * (-len(s) % 4)


def _b64(text: str, where: str, max_bytes: int | None) -> bytes:
  """Standard or URL-safe base64, whitespace and missing padding tolerated; at most max_bytes decoded."""
  chars = _b64_chars(text)  # line breaks are no image bytes: MIME base64 has 2 in every 78 characters
  if max_bytes is not None and len(chars) // 4 * 3 > max_bytes + 2:  # + 2: at most 2 padding bytes
    raise ValueError(f"image is about {len(chars) // 4 * 3 / 1e6:.1f} MB, more than the server's limit of "
                     f"{max_bytes / 1e6:.1f} MB per image (config.serving.max_image_bytes); send a "
                     "smaller or more compressed image.")
  try:
    data = base64.b64decode(_padded(chars), validate=True)
  except (binascii.Error, ValueError) as e:
    raise ValueError(f"{where} is not valid base64 ({e}); send the image file's bytes base64-encoded "
                     "or as a data URL (data:image/png;base64,...).") from None
  if not data:
    raise ValueError(f"{where} is empty; send the image file's bytes base64-encoded.")
  if max_bytes is not None and len(data) > max_bytes:
    raise ValueError(f"image is {len(data) / 1e6:.1f} MB, more than the server's limit of "
                     f"{max_bytes / 1e6:.1f} MB per image (config.serving.max_image_bytes); send a "
                     "smaller or more compressed image.")
  return data


_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
          (b"GIF89a", "image/gif"))


def sniff_media_type(data: str) -> str | None:
  """The media type base64 image data starts with (PNG, JPEG, GIF or WebP signature), or None when
  its first bytes are none of them or are not base64 (decoding then says what is wrong)."""
  try:
    raw = base64.b64decode(_padded(_b64_chars(data[:256])[:16]), validate=True)
  except (binascii.Error, ValueError):
    return None
  if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
    return "image/webp"
  return next((mime for magic, mime in _MAGIC if raw.startswith(magic)), None)


def image_bytes(source: str | bytes, max_bytes: int | None = None) -> bytes:
  """The encoded image file inside a data URL, raw base64 text, or bytes (at most max_bytes)."""
  if isinstance(source, bytes | bytearray | memoryview):
    if max_bytes is not None and len(source) > max_bytes:
      raise ValueError(f"image is {len(source) / 1e6:.1f} MB, more than the limit of "
                       f"{max_bytes / 1e6:.1f} MB.")
    return bytes(source)
  if not isinstance(source, str):
    raise ValueError(f"image: expected a data URL, base64 text or bytes, got {type(source).__name__}.")
  head = source[:16].lstrip().lower()
  if head.startswith(("http://", "https://")):
    raise ValueError("image URLs are not fetched by this server (no network); send the image as "
                     "base64 data")
  if head.startswith("data:"):
    m = _DATA_URL.fullmatch(source.strip())
    if m is None:
      raise ValueError("image data URL is malformed; expected data:image/<type>;base64,<data>.")
    if ";base64" not in m["params"].lower():
      raise ValueError(f"image data URL ({m['mime'] or 'no media type'}) is not base64-encoded; "
                       "send data:image/<type>;base64,<data>.")
    if m["mime"] and not m["mime"].lower().startswith("image/"):
      raise ValueError(f"image data URL has media type {m['mime']!r}; expected image/png, image/jpeg, "
                       "image/gif or image/webp.")
    return _b64(m["data"], "image data URL payload", max_bytes)
  return _b64(source, "image data", max_bytes)


def decode_image(source: str | bytes, image_size: int, channels: int = 3, *, max_bytes: int | None = None,
                 max_pixels: int = MAX_PIXELS) -> np.ndarray:
  """Decodes and resizes one image for the vision encoder.

  The image is converted to RGB (channels=3) or grayscale (channels=1);
  transparent pixels (an alpha channel, or a palette, grey or RGB colour
  marked transparent) are composited onto white first (a transparent PNG
  logo should not turn black), and an EXIF orientation is applied (a phone
  photo is seen upright, as a browser shows it). It is then resized to
  image_size x image_size with bicubic interpolation (Pillow `Image.BICUBIC`), without keeping the
  aspect ratio -- the encoder was trained on square images of that size.
  Animated GIF/WebP: the first frame.

  Args:
    source: a data URL (`data:image/png;base64,...`), raw base64 text, or the
      file's bytes. http(s) URLs are refused (the server has no network).
    image_size: output height and width (config.model.vision.image_size).
    channels: 3 (RGB) or 1 (grayscale): config.model.vision.num_channels.
    max_bytes: most bytes of the encoded file (None: unbounded), checked before base64 decoding.
    max_pixels: most pixels (width x height), checked from the header before decoding.

  Returns:
    float32 [image_size, image_size, channels] in [0, 1].

  Raises:
    ValueError: a URL, bad base64, an undecodable or unsupported file, or an
      image over max_bytes or max_pixels; the message names the problem and the limit.
  """
  if not is_int(image_size, numpy=True) or image_size <= 0:
    raise ValueError(f"image_size={image_size!r}: expected a positive int.")
  if not is_int(channels, numpy=True) or channels not in _MODES:
    raise ValueError(f"channels={channels!r}: expected 3 (RGB) or 1 (grayscale).")
  data = image_bytes(source, max_bytes)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # checked below, before load
      img = Image.open(io.BytesIO(data), formats=FORMATS)
  except Image.DecompressionBombError:
    raise ValueError(f"image is larger than {max_pixels / 1e6:g} megapixels (config.serving."
                     "max_image_pixels); send a smaller image.") from None
  except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError, ...
    raise ValueError(f"image could not be decoded ({type(e).__name__}: {e}); supported formats are "
                     "PNG, JPEG, GIF and WebP.") from None
  w, h = img.size
  if w * h > max_pixels:
    raise ValueError(f"image is {w}x{h} = {w * h / 1e6:.1f} megapixels, more than the "
                     f"{max_pixels / 1e6:g} megapixel limit (config.serving.max_image_pixels); send a "
                     "smaller image.")
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", Image.DecompressionBombWarning)
      img.load()
      turn = _orientation(img)
      img = _flatten(img, _MODES[channels])
      if turn is not None:
        img = img.transpose(turn)
      img = img.resize((image_size, image_size), Image.BICUBIC)
  except Exception as e:  # truncated or corrupt pixel data
    raise ValueError(f"image {img.format or ''} {w}x{h} could not be decoded ({type(e).__name__}: "
                     f"{e}); the file may be truncated or corrupt.") from None
  arr = np.asarray(img, dtype=np.float32) / 255.0
  return arr.reshape(image_size, image_size, channels)


def _orientation(img: Image.Image) -> Image.Transpose | None:
  """The transpose that shows the image upright per its EXIF orientation tag (None: none or unreadable).

  Read after `load()`: a PNG's eXIf chunk may follow its pixel data. Malformed EXIF is ignored, as
  viewers do, rather than refusing an image whose pixels decoded.
  """
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)  # "Corrupt EXIF data": the client's file, not ours
      tag = img.getexif().get(0x0112)  # ExifTags.Base.Orientation
  except Exception:  # Pillow's EXIF parser raises many kinds on bad data
    return None
  return _TRANSPOSE.get(tag) if isinstance(tag, int) else None


_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
              6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}


def _flatten(img: Image.Image, mode: str) -> Image.Image:
  """Converts to `mode`, compositing any transparency onto white; 16-bit grey scaled to 8 bits.

  Pillow opens a 16-bit greyscale PNG as mode I;16 or I, and `convert` clips those values at
  255, which turned every such image white.
  """
  if img.mode.startswith("I"):
    grey = np.rint(np.asarray(img, dtype=np.float64) / 257.0)
    img = Image.fromarray(np.clip(grey, 0, 255).astype(np.uint8), "L")
  # A palette, grey or RGB image may mark one index / level / colour transparent (PNG tRNS, GIF):
  # convert("RGBA") turns that into alpha; converting straight to RGB or L would drop it.
  if img.mode in ("RGBA", "LA", "PA") or img.info.get("transparency") is not None:
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    img = Image.alpha_composite(white, rgba)
  return img.convert(mode)
