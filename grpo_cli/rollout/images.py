"""Images on the wire: a prompt's images as PNG data URLs (`data:image/png;base64,...`), the form the rollout
server's `/generate` and `/score` take (one list per prompt, sent once however many completions it gets) and one of
the forms SGLang's `image_data` takes. PNG is lossless, so the server's processor sees the trainer's pixels."""

from __future__ import annotations

import base64
import binascii
import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL.Image import Image

PREFIX = "data:image/"
MAX_PIXELS = 64 << 20
"""Largest decoded image (width × height) a receiver accepts: a PNG of a few kilobytes can decode to gigabytes."""


def to_data_url(image: Image) -> str:
    """`image` as an RGB PNG data URL."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def encode(images: list[list[Image]] | None) -> list[list[str]] | None:
    """Each prompt's images as data URLs (None stays None)."""
    return None if images is None else [[to_data_url(im) for im in row] for row in images]


def from_data_url(url: str, *, where: str, max_pixels: int = MAX_PIXELS) -> Image:
    """The RGB image of a `data:image/...;base64,` URL; ValueError naming `where` for anything else, an image that
    does not decode, or one over `max_pixels` pixels (checked from the header, before decoding)."""
    from PIL import Image, UnidentifiedImageError

    head, sep, payload = url.partition(",")
    if not (head.startswith(PREFIX) and head.endswith(";base64") and sep):
        raise ValueError(f"{where}: expected a data URL 'data:image/<type>;base64,<data>', got {url[:40]!r}")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    except (binascii.Error, UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{where}: the image does not decode ({type(exc).__name__}: {exc})") from exc
    if image.width * image.height > max_pixels:
        raise ValueError(f"{where}: {image.width}x{image.height} pixels is over the limit of {max_pixels}")
    return image.convert("RGB")


def decode(rows: list[list[str]] | None, *, what: str) -> list[list[Image]] | None:
    """`encode` undone; errors name `what[i][j]`."""
    if rows is None:
        return None
    return [[from_data_url(u, where=f"{what}[{i}][{j}]") for j, u in enumerate(row)] for i, row in enumerate(rows)]
