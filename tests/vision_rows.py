"""Vision-language rows the tests share: the tiny VLM's prompts with 0, 1 and 2 images, and a by-hand forward."""

from __future__ import annotations

import random

import torch

from grpo_cli.data.images import ImageProcessor
from grpo_cli.data.prompts import tokenize_prompts
from grpo_cli.data.tasks import draw_shapes


def _image(size: tuple[int, int], colour: str = "red"):
    return draw_shapes(colour, 2, "circle", random.Random(0)).resize(size)


def vlm_prompts(path: str):
    """Three prompts: no image, one 56×56 image, two images (28 wide × 56 high and 56×56)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)

    def user(*parts):
        return {"prompt": [{"role": "user", "content": list(parts)}]}

    text = {"type": "text", "text": "how many shapes are there ?"}
    rows = [user(text), user({"type": "image", "image": _image((56, 56))}, text),
            user({"type": "image", "image": _image((28, 56), "blue")}, {"type": "image", "image": _image((56, 56))},
                 text)]
    images = ImageProcessor.load(path, max_pixels=10**6)
    prompts, _ = tokenize_prompts(rows, tok, prompt_column="prompt", max_prompt_length=64, overlong_prompts="error",
                                  images=images)
    return tok, prompts


def load_vlm(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def by_hand(model, prompt, completion: list[int], *, banned: list[int] = ()) -> torch.Tensor:
    """float64 log-softmax of the full logits of one unpadded row, the model computing its own positions (`banned`
    token ids left out of the softmax, as a sampler that never draws them)."""
    ids = torch.tensor([prompt.ids + completion])
    extra = {}
    if prompt.vision is not None:
        extra = dict(pixel_values=prompt.vision.pixel_values, image_grid_thw=prompt.vision.image_grid_thw,
                     mm_token_type_ids=(ids == model.config.image_token_id).int())
    model.model.rope_deltas = None
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0].double()
    logits[:, list(banned)] = float("-inf")
    logp = logits.log_softmax(-1)
    p = len(prompt.ids)
    return torch.stack([logp[p - 1 + t, tok] for t, tok in enumerate(completion)])
