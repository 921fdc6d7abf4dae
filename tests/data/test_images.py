"""Images in prompt rows: where they come from (files, base64, data URLs, an `images`/`image` column, PIL), the size
cap (scaled down, aspect kept), the errors that name the row and file, the placeholder expansion, and the
built-in shapes task."""

from __future__ import annotations

import base64
import io
import math

import pytest
import torch
from PIL import Image

from grpo_cli.data.images import ImageError, load_image, row_images, with_image_parts
from grpo_cli.data.sources import load_rows
from grpo_cli.data.tasks import SHAPE_COLOURS, shapes_task


def _png(path, size=(40, 30), colour=(200, 10, 10)) -> str:
    Image.new("RGB", size, colour).save(path)
    return str(path)


def _b64(size=(20, 10)) -> str:
    buf = io.BytesIO()
    Image.new("L", size, 128).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_every_kind_of_value_reads_as_rgb(tmp_path):
    path = _png(tmp_path / "a.png")
    for value in (path, _b64(), "data:image/png;base64," + _b64(), Image.new("L", (4, 4)),
                  {"bytes": base64.b64decode(_b64()), "path": None}, {"path": path}):
        image = load_image(value, where="row 0", max_pixels=10**6)
        assert image.mode == "RGB"


def test_size_cap_scales_down_keeping_the_aspect_ratio(tmp_path):
    path = _png(tmp_path / "big.png", size=(400, 100))
    image = load_image(path, where="row 0", max_pixels=10_000)
    s = math.sqrt(10_000 / 40_000)  # w', h' = ⌊w·s⌋, ⌊h·s⌋
    assert image.size == (int(400 * s), int(100 * s)) == (200, 50)
    assert load_image(path, where="row 0", max_pixels=40_000).size == (400, 100)  # at the cap: untouched


def test_missing_and_unreadable_images_name_the_row_and_file(tmp_path):
    with pytest.raises(ImageError, match=r"data row 3, image 0: image file 'nope/cat\.png' does not exist"):
        row_images({"prompt": _user({"type": "image", "image": "nope/cat.png"})}, "prompt",
                   where="data row 3", max_pixels=10**6)
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(ImageError, match=rf"data row 1, image 0: image '{bad}' could not be read"):
        row_images({"prompt": "q", "image": str(bad)}, "prompt", where="data row 1", max_pixels=10**6)
    with pytest.raises(ImageError, match="could not be read"):
        load_image("!!!not base64!!!", where="row 0", max_pixels=10**6)
    with pytest.raises(ImageError, match="2 image part"):
        row_images({"prompt": _user({"type": "image"}, {"type": "image"}), "images": [_b64()]}, "prompt",
                   where="row 0", max_pixels=10**6)


def test_a_column_fills_empty_parts_or_goes_before_the_first_user_text(tmp_path):
    a, b = _png(tmp_path / "a.png", size=(10, 10)), _png(tmp_path / "b.png", size=(20, 10))
    row = {"prompt": _user({"type": "image"}, {"type": "text", "text": "q"}, {"type": "image"}), "images": [a, b]}
    assert [i.size for i in row_images(row, "prompt", where="r", max_pixels=10**6)] == [(10, 10), (20, 10)]
    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "image": a}
    assert len(row_images(row, "prompt", where="r", max_pixels=10**6)) == 1
    messages = with_image_parts(row["prompt"], 1)
    assert messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "q"}]
    assert messages[0] == row["prompt"][0] and row["prompt"][1]["content"] == "q"  # the row is not changed


def test_prompts_get_expanded_ids_and_a_text_model_is_untouched(tiny_vlm, tiny_checkpoint):
    from transformers import AutoTokenizer

    from grpo_cli.data.images import ImageProcessor
    from grpo_cli.data.prompts import tokenize_prompts

    assert ImageProcessor.load(tiny_checkpoint, max_pixels=10**6) is None
    images = ImageProcessor.load(tiny_vlm, max_pixels=10**6)
    tok = AutoTokenizer.from_pretrained(tiny_vlm)
    rows = [{"prompt": _user({"type": "image", "image": Image.new("RGB", (56, 112))},
                             {"type": "text", "text": "how many shapes are there ?"})}]
    (prompt,), _ = tokenize_prompts(rows, tok, prompt_column="prompt", max_prompt_length=64,
                                    overlong_prompts="error", images=images)
    # the tiny processor's max 56² pixels: 112 × 56 → 56 × 28, 4 × 2 patches, 2 tokens of 2 × 2
    assert prompt.vision.image_grid_thw.tolist() == [[1, 4, 2]]
    assert prompt.ids.count(images.image_token_id) == 2 and prompt.text.count("<|image_pad|>") == 1



def test_a_plain_string_prompt_with_an_image_column_is_a_user_message_with_its_images_first(tiny_vlm):
    """docs/vision.md: a column's images go before the first user message's text; a plain string is that message
    (it was refused: "0 image placeholder(s) for 1 image(s)"). Rows of the column without images are messages too."""
    from transformers import AutoTokenizer

    from grpo_cli.data.images import ImageProcessor
    from grpo_cli.data.prompts import tokenize_prompts

    images = ImageProcessor.load(tiny_vlm, max_pixels=10**6)
    tok = AutoTokenizer.from_pretrained(tiny_vlm)
    q, picture = "how many shapes are there ?", _b64((56, 56))

    def prompts(rows):
        return tokenize_prompts(rows, tok, prompt_column="prompt", max_prompt_length=64, overlong_prompts="error",
                                images=images)[0]

    strings = prompts([{"prompt": q, "image": picture}, {"prompt": q, "images": []}, {"prompt": q}])
    chats = prompts([{"prompt": _user({"type": "image", "image": picture}, {"type": "text", "text": q})},
                     {"prompt": [{"role": "user", "content": q}]}])
    for got, want in zip(strings, chats):
        assert (got.text, got.ids) == (want.text, want.ids)
    assert strings[0].ids.count(images.image_token_id) == 4 and strings[0].text.index("<|image_pad|>") \
        < strings[0].text.index(q)
    assert torch.equal(strings[0].vision.pixel_values, chats[0].vision.pixel_values)
    assert strings[0].messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
    assert strings[1].vision is None and strings[1].messages == [{"role": "user", "content": q}]
    assert (strings[2].text, strings[2].messages) == (q, None)  # no image column: the string as it is


def test_shapes_task_has_a_heldout_split_and_answers_what_it_draws():
    rows = load_rows("builtin:shapes")
    assert len(rows) == 256
    held = load_rows("builtin:shapes:heldout")
    key = lambda r: (r["prompt"][0]["content"][1]["text"], r["answer"])  # noqa: E731
    assert {key(r) for r in rows} | {key(r) for r in held} >= {key(r) for r in held}
    for row in rows[:20]:
        image = row["prompt"][0]["content"][0]["image"]
        if row["answer"] in SHAPE_COLOURS:  # the only non-white colour in the image is the answer's
            colours = {c for _, c in image.getcolors(4096) if c != (255, 255, 255)}
            assert max(colours, key=lambda c: sum(abs(a - b) for a, b in zip(c, (255, 255, 255)))) \
                == SHAPE_COLOURS[row["answer"]]
    assert shapes_task(4, seed=1)[0]["answer"] == shapes_task(4, seed=1)[0]["answer"]
