"""Tokenised prompts with a resumable, seeded cursor over epochs."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grpo_cli.data.images import ImageProcessor, as_user_message, row_images, with_image_parts
from grpo_cli.data.sources import DataError

if TYPE_CHECKING:
    from grpo_cli.models.vision import VisionInputs


@dataclass
class Prompt:
    """One prompt: its text (as the reward functions see it), token ids and the row's other columns."""

    text: str
    ids: list[int]
    columns: dict
    messages: list | None = None
    """The chat messages the text was rendered from (None for a plain-string prompt, except one of a row with an
    `images`/`image` column, which is a user message: `data.images.as_user_message`): a reward model renders them
    with its own template."""
    images: list | None = None
    """A vision-language model's prompt: its images (RGB `PIL.Image`s, size-capped), in placeholder order; then
    `ids` are the processor-expanded ids (one `<|image_pad|>` per merged patch group). None: a text model."""
    vision: VisionInputs | None = None
    """The image processor's outputs for `images` (one row; none when the prompt has no image)."""


def render(tokenizer, value, column: str, *, tools: list[dict] | None = None) -> str:
    """Chat messages through the tokenizer's chat template (with the tool schemas, `agent:`); plain strings as
    they are."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True, tools=tools)
    raise DataError(f"data.prompt_column '{column}' must hold a string or a list of chat messages "
                    f"({{role, content}}); got {type(value).__name__}.")


def tokenize_prompts(rows: list[dict], tokenizer, *, prompt_column: str, max_prompt_length: int,
                     overlong_prompts: str, tools: list[dict] | None = None,
                     images: ImageProcessor | None = None) -> tuple[list[Prompt], int]:
    """Tokenise every row; prompts longer than `max_prompt_length` (image tokens included) are dropped (`filter`)
    or rejected (`error`). With `images` (a vision-language model's processor) each row's images are read
    (`data.images.row_images`), put before the first user message's text where the messages have no image part (a
    plain string with an image column is that user message), processed, and the prompt's placeholders expanded.
    Returns the prompts kept and the number dropped."""
    if rows and prompt_column not in rows[0]:
        raise DataError(f"data.prompt_column '{prompt_column}' is not a column of the data (columns: "
                        f"{sorted(rows[0])}); set data.prompt_column to the one holding the prompt.")
    kept, dropped = [], 0
    for i, row in enumerate(rows):
        value, pics, vision = row[prompt_column], None, None
        if images is not None:
            pics = row_images(row, prompt_column, where=f"data row {i}", max_pixels=images.max_pixels)
            value = with_image_parts(as_user_message(value, row), len(pics))
        text = render(tokenizer, value, prompt_column, tools=tools)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if images is not None:
            vision = images.encode(pics) if pics else None
            ids = images.expand(ids, vision, where=f"data row {i}") if pics else ids
        if len(ids) > max_prompt_length:
            if overlong_prompts == "error":
                raise DataError(f"prompt {i} has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}; "
                                "raise the limit or set data.overlong_prompts=filter.")
            dropped += 1
            continue
        messages = value if isinstance(value, list) else None
        kept.append(Prompt(text=text, ids=ids, columns={k: v for k, v in row.items() if k != prompt_column},
                           messages=messages, images=pics, vision=vision))
    if not kept:
        raise DataError(f"no prompt fits data.max_prompt_length={max_prompt_length} ({dropped} dropped); raise it.")
    return kept, dropped


def images_of(prompts: list[Prompt]) -> list[list] | None:
    """Each prompt's images (`[]` for one without) for an engine's `generate(images=)`; None when no prompt has an
    image (a text-only batch: engines are then called without images)."""
    if not any(p.images for p in prompts):
        return None
    return [list(p.images or []) for p in prompts]


def vision_of(prompts: list[Prompt]) -> list | None:
    """Each prompt's processor outputs (`Prompt.vision`, None for one without images) for `build_batch`; None when
    no prompt has an image."""
    return None if all(p.vision is None for p in prompts) else [p.vision for p in prompts]


@dataclass
class PromptCursor:
    """Yields `take(k)` prompts in a per-epoch shuffled order; (epoch, index) is all its state (checkpointed)."""

    prompts: list[Prompt]
    seed: int
    shuffle: bool
    epoch: int = 0
    index: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[Prompt]:
        out = []
        while len(out) < k:
            if not self._order:
                self._order = self._epoch_order()
            if self.index >= len(self._order):
                self.epoch, self.index, self._order = self.epoch + 1, 0, []
                continue
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self._order = state["epoch"], state["index"], []
