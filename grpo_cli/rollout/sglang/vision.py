"""How a vision-language model's requests go to SGLang (sglang 0.5.23's source): one image placeholder per image in
`input_ids`, a `logit_bias` that bans the placeholder tokens, and no score at image positions."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from grpo_cli.models.vision import placeholder_ids
from grpo_cli.rollout.base import RolloutError

BAN_BIAS = -1e9
"""Added to a banned token's logit. JSON has no -inf, and SGLang's `logit_bias` values are floats
(`api/v1/api_types.py`); -1e9 leaves the token a probability of exactly 0 after softmax in float32 and bf16, as
the hf engine's -inf does."""


@dataclass(frozen=True)
class Placeholders:
    """A vision-language checkpoint's placeholder token ids (none for a text model)."""

    image: int | None = None
    banned: tuple[int, ...] = ()
    """The image and video placeholders: no completion may sample them (the hf engine bans the same ids)."""

    @classmethod
    def of(cls, model_path: str | None) -> Placeholders:
        """From the checkpoint's config.json (Qwen2-VL's `image_token_id` / `video_token_id`); none without one."""
        cfg_file = Path(model_path) / "config.json" if model_path else None
        if cfg_file is None or not cfg_file.is_file():
            return cls()
        cfg = json.loads(cfg_file.read_text())
        return cls(cfg.get("image_token_id"), tuple(placeholder_ids(SimpleNamespace(**cfg))))

    def logit_bias(self) -> dict[str, float] | None:
        """SGLang's `sampling_params.logit_bias`: token id as a decimal string -> bias (`srt/sampling/
        sampling_params.py` `Dict[str, float]`, keys checked in [0, vocab_size); `sampling_batch_info.py` adds the
        biases to the logits before sampling, and the returned logprobs come from the biased logits)."""
        return {str(t): BAN_BIAS for t in self.banned} or None

    def collapse(self, ids: list[int]) -> list[int]:
        """`ids` with each run of image placeholders cut to one. SGLang decodes `input_ids` to text and runs the HF
        processor on it (`srt/multimodal/processors/base_processor.py` load_mm_data), which expands every
        `<|image_pad|>` it finds into a whole image: the trainer's expanded run would read as one image per pad.
        From one pad per image, `_expand_input_ids` rebuilds exactly the trainer's ids."""
        if self.image is None:
            raise RolloutError("images for SGLang need the trainer's model folder (its config.json names the image "
                               "placeholder): give SGLangEngine model_path")
        return [t for k, t in enumerate(ids) if not (t == self.image and k and ids[k - 1] == self.image)]

    def unscored(self, seq: list[int], logprobs: list[float]) -> list[float]:
        """Prompt logprobs of the expanded `seq` (after its first token) with NaN where the token is a placeholder:
        there SGLang scores a clamped pad-hash id (`srt/managers/schedule_batch.py` clamps the image positions'
        pad values to vocab_size − 1), not the placeholder. A weight-sync probe compares the other positions."""
        return [math.nan if t in self.banned else lp for t, lp in zip(seq[1:], logprobs, strict=True)]
