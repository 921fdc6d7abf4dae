"""Images in prompts: read them (a path, base64, a data URL, bytes or a PIL image) as RGB under a size cap, find
them in a row (`{"type": "image", "image": ...}` parts of the chat messages, or an `image`/`images` column), and
turn them into the model's inputs with its own image processor (`ImageProcessor`: pixel patches, patch grids and
the prompt's placeholder expanded to one `<|image_pad|>` per merged patch group)."""

from __future__ import annotations

import base64
import binascii
import io
import math
from pathlib import Path

from grpo_cli.config.errors import UserError
from grpo_cli.models.vision import VisionInputs, is_vision_config

PROCESSOR_FILES = ("preprocessor_config.json",)
"""What a saved folder needs beside the weights and tokenizer to load as a vision-language model again (the image
processor's settings)."""
IMAGE_COLUMNS = ("images", "image")
"""Dataset columns that hold a row's images (one image or a list), in the order of its image placeholders."""


class ImageError(UserError):
    """A prompt's image is missing, unreadable or malformed; the message names the row and the file."""


def _decode(value, where: str):
    """A PIL image from a path, a base64 string (a `data:image/...;base64,` URL or bare), bytes, a `datasets`
    Image dict ({bytes, path}) or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, (bytes, bytearray)):
            return Image.open(io.BytesIO(value))
        if not isinstance(value, str) or not value:
            raise ImageError(f"{where}: an image must be a file path or base64 text; got {type(value).__name__}.")
        if value.startswith("data:"):
            return Image.open(io.BytesIO(base64.b64decode(value.partition(",")[2], validate=True)))
        path = Path(value)
        if len(value) < 4096 and path.suffix and not path.exists():
            raise ImageError(f"{where}: image file '{value}' does not exist (relative paths are read from the "
                             "current directory); fix the path or give the image as base64.")
        if len(value) < 4096 and path.is_file():
            return Image.open(path)
        return Image.open(io.BytesIO(base64.b64decode(value, validate=True)))
    except (UnidentifiedImageError, OSError, binascii.Error, ValueError) as exc:
        shown = value if isinstance(value, str) and len(value) < 200 else f"{type(value).__name__} data"
        raise ImageError(f"{where}: image '{shown}' could not be read ({exc}); give an image file (PNG, JPEG, ...) "
                         "path or its base64 text.") from None


def load_image(value, *, where: str, max_pixels: int):
    """The image `value` as RGB, scaled down (aspect ratio kept, bicubic) when it has more than `max_pixels`
    pixels: w', h' = ⌊w·s⌋, ⌊h·s⌋ with s = √(max_pixels / (w·h)). `where` names the row in errors."""
    image = _decode(value, where)
    try:
        image = image.convert("RGB")
    except OSError as exc:
        raise ImageError(f"{where}: image could not be decoded ({exc}).") from None
    w, h = image.size
    if w * h > max_pixels:
        s = math.sqrt(max_pixels / (w * h))
        image = image.resize((max(1, int(w * s)), max(1, int(h * s))), resample=3)  # 3: BICUBIC
    return image


def row_images(row: dict, prompt_column: str, *, where: str, max_pixels: int) -> list:
    """The row's images in placeholder order: the `{"type": "image", "image": X}` parts of its chat messages, or
    those of its `images`/`image` column filling the parts without a value (and, where the messages have no image
    part, one part per column image put before the first user message's text — done by `with_image_parts`)."""
    values = []
    column = next((c for c in IMAGE_COLUMNS if c in row and row[c] is not None), None)
    if column is not None:
        values = row[column] if isinstance(row[column], list) else [row[column]]
    parts = image_parts(row.get(prompt_column))
    given = [p.get("image") for p in parts]
    if parts and any(v is not None for v in given):
        if column is not None and any(v is None for v in given):
            raise ImageError(f"{where}: some image parts name their image and some do not; name all of them or "
                             f"none (then column '{column}' fills them).")
        if all(v is not None for v in given):
            values = given
    elif parts and len(parts) != len(values):
        raise ImageError(f"{where}: {len(parts)} image part(s) in the messages but {len(values)} image(s) in "
                         f"column '{column}'.")
    return [load_image(v, where=f"{where}, image {i}", max_pixels=max_pixels) for i, v in enumerate(values)]


def image_parts(messages) -> list[dict]:
    """The `{"type": "image", ...}` content parts of chat messages, in order ([] for a plain-string prompt)."""
    if not isinstance(messages, list):
        return []
    return [part for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


def as_user_message(value, row: dict):
    """A plain-string prompt of a row with an `images`/`image` column (its value may be empty) as one user message,
    which `with_image_parts` then gives the row's images before its text and the chat template renders with the
    vision tokens, as for chat-message prompts. Every such row, with images or not, so a dataset's rows share one
    format. Anything else as it is."""
    if isinstance(value, str) and any(c in row for c in IMAGE_COLUMNS):
        return [{"role": "user", "content": value}]
    return value


def with_image_parts(messages, count: int):
    """`messages` with `count` image parts (no value: the template renders a placeholder) put before the first user
    message's text when they have none (a dataset whose images are only in a column)."""
    if count == 0 or image_parts(messages) or not isinstance(messages, list):
        return messages
    out = [dict(m) for m in messages]
    first = next((m for m in out if m.get("role") == "user"), out[0])
    text = first["content"] if isinstance(first["content"], list) else [{"type": "text", "text": first["content"]}]
    first["content"] = [{"type": "image"} for _ in range(count)] + text
    return out


def copy_processor_files(source: str, folder: str | Path) -> None:
    """Copy the checkpoint folder `source`'s image-processor files (`PROCESSOR_FILES`, where it has them) into
    `folder` (a checkpoint or exported model of it), so that it loads as a vision-language model again."""
    import shutil

    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(folder) / name)


class ImageProcessor:
    """A vision-language checkpoint's image processor (transformers' PIL backend: torchvision is not needed) and
    the placeholder expansion Qwen2-VL's processor does: image i becomes grid_i.prod() / merge² `<|image_pad|>`s."""

    def __init__(self, processor, *, image_token_id: int, max_pixels: int) -> None:
        self.processor, self.image_token_id, self.max_pixels = processor, image_token_id, max_pixels
        self.merge = int(getattr(processor, "merge_size", 1))

    @classmethod
    def load(cls, model_path: str, *, max_pixels: int) -> ImageProcessor | None:
        """The processor of the checkpoint at `model_path`, or None when it is not a vision-language model."""
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(model_path)
        if not is_vision_config(config):
            return None
        return cls(AutoImageProcessor.from_pretrained(model_path, backend="pil"),
                   image_token_id=config.image_token_id, max_pixels=max_pixels)

    def encode(self, images: list) -> VisionInputs:
        """One row's processor outputs (`images_per_row` = [len(images)])."""
        import torch

        if not images:
            dim = 3 * self.processor.temporal_patch_size * self.processor.patch_size ** 2
            return VisionInputs.empty(1, patch_dim=dim)
        out = self.processor(images=images, return_tensors="pt")
        return VisionInputs(out["pixel_values"], out["image_grid_thw"].long(),
                            torch.tensor([len(images)], dtype=torch.long))

    def expand(self, ids: list[int], vision: VisionInputs, *, where: str) -> list[int]:
        """`ids` with its k-th `<|image_pad|>` repeated t·h·w / merge² times (image k's merged patch groups)."""
        counts = (vision.image_grid_thw.prod(-1) // self.merge ** 2).tolist()
        found = sum(t == self.image_token_id for t in ids)
        if found != len(counts):
            raise ImageError(f"{where}: the prompt has {found} image placeholder(s) for {len(counts)} image(s); "
                             "every image needs one {\"type\": \"image\"} part in the chat messages.")
        out, k = [], 0
        for t in ids:
            if t == self.image_token_id:
                out.extend([t] * counts[k])
                k += 1
            else:
                out.append(t)
        return out
