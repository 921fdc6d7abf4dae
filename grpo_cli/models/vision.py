"""Vision-language models (Qwen2-VL / Qwen2.5-VL family): the processor outputs that ride with a batch's rows
(`VisionInputs`), the M-RoPE position ids of a [prompt | completion] batch, and which parameters are the vision
tower's."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from grpo_cli.config.model_shape import is_vision_config

VISION_PREFIXES = ("model.visual.", "visual.")
"""Hugging Face parameter names of the vision tower start with one of these (Qwen2-VL / Qwen2.5-VL: the patch
embedding, the vision blocks and the merger that projects into the language model's width); a PEFT wrapper adds
`base_model.model.` in front (`is_vision_parameter` strips it)."""

VISION_MODULES = r".*\bvisual\b.*"
"""PEFT's `exclude_modules` regex for the vision tower's modules: LoRA adapts the language model only."""


def placeholder_ids(config) -> list[int]:
    """A vision-language config's image and video placeholder token ids (what no completion may sample)."""
    return [i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
            if i is not None]


def causal_lm_class(config):
    """The transformers auto class that builds a generating model of `config`: `AutoModelForImageTextToText` for a
    vision-language config (`AutoModelForCausalLM` refuses Qwen2-VL's), else `AutoModelForCausalLM`."""
    import transformers

    return (transformers.AutoModelForImageTextToText if is_vision_config(config)
            else transformers.AutoModelForCausalLM)


def is_vision_parameter(name: str) -> bool:
    """Whether the Hugging Face parameter `name` belongs to the vision tower (`VISION_PREFIXES`)."""
    name = name.removeprefix("base_model.model.").removeprefix("module.")
    return name.startswith(VISION_PREFIXES)


def freeze_vision(model: torch.nn.Module) -> int:
    """`model.freeze_vision`: requires_grad False on every vision-tower parameter (so the optimizer, built from
    the parameters that require grad, never holds them); returns how many parameters were frozen."""
    count = 0
    for name, p in model.named_parameters():
        if is_vision_parameter(name):
            p.requires_grad_(False)
            count += 1
    return count


@dataclass
class VisionInputs:
    """The image processor's outputs for B rows, rows in order: row b's images are the `images_per_row[b]` rows of
    `image_grid_thw` after those of rows < b, and their patches the matching rows of `pixel_values`
    (image i has t·h·w patches, `image_grid_thw[i] = (t, h, w)`). A row may have 0 images."""

    pixel_values: torch.Tensor
    """(patches, C · temporal_patch · patch²), the flattened patches of every image of every row."""
    image_grid_thw: torch.Tensor
    """(images, 3) long: each image's (t, h, w) patch grid."""
    images_per_row: torch.Tensor
    """(B,) long."""
    dummy: bool = False
    """No row has an image, but another rank's micro-batch has one (the ranks agreed: `train.batch.take`): the
    forward runs the vision tower on a dummy image whose output enters with weight 0 (`dummy_tower`), so this rank's
    collectives (fsdp2's per-block gathers, ZeRO-3's per-module fetches) and the parameters its backward reaches
    (ddp's and ZeRO-2's reducers) are its peers'."""

    def __len__(self) -> int:
        return self.images_per_row.shape[0]

    @property
    def num_images(self) -> int:
        return self.image_grid_thw.shape[0]

    def _offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first image of each row (B + 1,), first patch of each image (images + 1,)), cumulative."""
        zero = torch.zeros(1, dtype=torch.long)
        image_at = torch.cat([zero, self.images_per_row.cpu().cumsum(0)])
        patch_at = torch.cat([zero, self.image_grid_thw.cpu().prod(-1).cumsum(0)])
        return image_at, patch_at

    def select(self, index: list[int]) -> VisionInputs:
        """Rows `index` in that order (a row may repeat: the G completions of one prompt)."""
        image_at, patch_at = self._offsets()
        images = [i for b in index for i in range(int(image_at[b]), int(image_at[b + 1]))]
        patches = [p for i in images for p in range(int(patch_at[i]), int(patch_at[i + 1]))]
        device = self.pixel_values.device
        return VisionInputs(
            self.pixel_values[torch.tensor(patches, dtype=torch.long, device=device)],
            self.image_grid_thw[torch.tensor(images, dtype=torch.long, device=self.image_grid_thw.device)],
            self.images_per_row[torch.tensor(index, dtype=torch.long, device=self.images_per_row.device)])

    def rows(self, start: int, stop: int) -> VisionInputs:
        """Rows [start, stop)."""
        return self.select(list(range(start, min(stop, len(self)))))

    def to(self, device) -> VisionInputs:
        return VisionInputs(self.pixel_values.to(device), self.image_grid_thw.to(device),
                            self.images_per_row.to(device), dummy=self.dummy)

    @classmethod
    def cat(cls, parts: list[VisionInputs]) -> VisionInputs:
        """The rows of `parts`, one after the other."""
        return cls(torch.cat([p.pixel_values for p in parts]), torch.cat([p.image_grid_thw for p in parts]),
                   torch.cat([p.images_per_row for p in parts]))

    @classmethod
    def empty(cls, rows: int, *, patch_dim: int, dtype=torch.float32) -> VisionInputs:
        """`rows` rows without images."""
        return cls(torch.zeros((0, patch_dim), dtype=dtype), torch.zeros((0, 3), dtype=torch.long),
                   torch.zeros(rows, dtype=torch.long))

    @classmethod
    def dummy_only(cls, rows: int) -> VisionInputs:
        """`rows` rows without images that still run the vision tower (`dummy`)."""
        return cls(torch.zeros((0, 0)), torch.zeros((0, 3), dtype=torch.long), torch.zeros(rows, dtype=torch.long),
                   dummy=True)

    def model_kwargs(self) -> dict:
        """What the model's forward takes: `pixel_values` and `image_grid_thw`, or nothing when no row has an
        image (the vision tower is then not run)."""
        if self.num_images == 0:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


def unwrap(model):
    """The Hugging Face module under DDP/DeepSpeed (`.module`) and PEFT (`get_base_model()`)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def dummy_tower(model):
    """Inside: every forward of `model` also runs its vision tower (`get_image_features`, the path an image takes)
    on one all-zero image of one merged patch group, right after the input embedding as with a real image, and adds
    0 × the sum of its output to the embeddings: the values do not change (x + 0 = x; the tower's output on zeros
    is finite), the gradient reaching the tower is exactly 0, and every tower module runs, so its FSDP2 / ZeRO-3
    gathers and the reducer's used parameters are those of a rank with images."""
    hf = unwrap(model)
    vision = hf.config.vision_config
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2

    def add(module, args, output):
        pixels = torch.zeros((merge * merge, width), device=output.device)
        grid = torch.tensor([[1, merge, merge]], device=output.device)
        features = hf.model.get_image_features(pixels, grid, return_dict=True).pooler_output
        zero = sum(f.sum() for f in features) * 0.0
        return output + zero.to(output.dtype)

    handle = hf.get_input_embeddings().register_forward_hook(add)
    try:
        yield
    finally:
        handle.remove()


def mrope_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    vision: VisionInputs | None) -> torch.Tensor:
    """(3, B, S) M-RoPE position ids (temporal, height, width) of a left-padded [prompt | completion] batch, from
    the model's own `get_rope_index`: text tokens at (p, p, p) for their running position p, an image's tokens on
    its merged (t, h, w) grid offset by the position it starts at, the text after it at that offset + max(h, w)/merge;
    padding at 0. Rows without an image get cumsum(mask) − 1 on all three axes (text RoPE)."""
    hf = unwrap(model)
    image_token = hf.config.image_token_id
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[None].expand(3, -1, -1).clone()
    if vision is None or vision.num_images == 0:
        return positions
    with_images = (vision.images_per_row > 0).nonzero().flatten().tolist()
    sub = input_ids[with_images]
    types = (sub == image_token).int()
    grid = vision.select(with_images).image_grid_thw
    rope, _ = hf.model.get_rope_index(sub, mm_token_type_ids=types, image_grid_thw=grid,
                                      attention_mask=attention_mask[with_images])
    positions[:, with_images] = rope.to(positions.dtype)
    return positions
