"""The SGLang contract server's Qwen-VL request path, from sglang 0.5.23's source (NOT SGLang): the request's ids
decoded and run through transformers' own Qwen2-VL processor, the ids SGLang then runs, its prompt logprobs at image
positions, and its `logit_bias` checks."""

from __future__ import annotations

import torch


class ContractError(Exception):
    """What SGLang answers instead of generating: an HTTP status and its body."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body)
        self.status, self.body = status, body


def qwen_vl_processor(model_path: str):
    """transformers' processor of the checkpoint's model type (Qwen2VLProcessor, Qwen2_5_VLProcessor) over its
    tokenizer and image processor (PIL backend), as SGLang's `AutoProcessor` builds it, less the video processor:
    transformers' Qwen-VL video processor needs torchvision, which is not installed here, and no video is sent."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[AutoConfig.from_pretrained(model_path).model_type])

    class _NoVideoProcessor(processor_class):
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return _NoVideoProcessor(image_processor=AutoImageProcessor.from_pretrained(model_path, backend="pil"),
                             tokenizer=AutoTokenizer.from_pretrained(model_path), video_processor=None)


def placeholder_runs(ids: list[int], start: int, pad: int, end: int) -> int:
    """How many `start pad+ end` runs `ids` holds: what `qwen_vl.py`'s image_token_regex
    `<|vision_start|>(?:<|image_pad|>)+<|vision_end|>` matches in the decoded text. Counted on the ids because the
    tiny tokenizer's decode puts spaces between tokens, which Qwen's byte-level decode does not."""
    count, i = 0, 0
    while i < len(ids):
        if ids[i] == start:
            j = i + 1
            while j < len(ids) and ids[j] == pad:
                j += 1
            if j > i + 1 and j < len(ids) and ids[j] == end:
                count, i = count + 1, j
        i += 1
    return count


def expanded_ids(processor, cfg, ids: list[int], images: list) -> list[int]:
    """The ids SGLang runs for one Qwen-VL input with `images` (`srt/multimodal/processors/base_processor.py`):
    - load_mm_data decodes `input_ids` with the tokenizer and counts the placeholder regex's matches; more than
      the images is `_placeholder_mismatch_error`, a ValueError (HTTP 400 from `http_server.py`'s generate). Fewer:
      SGLang's legacy path loads only the images it pairs and drops the rest; the contract refuses them (400);
    - `_call_processor` runs the HF processor on `text=[decoded]` with the images. It expands every
      `<|image_pad|>` it reads into one image's tokens, so N pads for one image raise StopIteration inside a
      coroutine: a RuntimeError that `http_server.py` does not catch, a bare HTTP 500;
    - with SGLANG_MM_AVOID_RETOKENIZE (default on, `srt/environ.py`) `_expand_input_ids` keeps the request's ids and
      repeats its k-th placeholder `_get_num_multimodal_tokens` times; where that cannot pair them (a placeholder
      count that is not the image count) SGLang warns and keeps the processor's re-tokenized ids."""
    found = placeholder_runs(ids, cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id)
    if found != len(images):
        raise ContractError(400, {"error": {"message": f"Prompt has {found} image placeholders but {len(images)} "
                                                       "image inputs were provided"}})
    text = processor.tokenizer.decode(ids)
    try:
        out = processor(text=[text], images=images, padding=True, return_tensors="pt")
    except ValueError as exc:
        raise ContractError(400, {"error": {"message": str(exc)}}) from exc
    except Exception as exc:  # StopIteration, IndexError, ...: uncaught in SGLang
        raise ContractError(500, {"error": f"Internal Server Error ({type(exc).__name__}: {exc})"}) from exc
    processed = out["input_ids"][0].tolist()
    counts = processor._get_num_multimodal_tokens(image_sizes=[(im.height, im.width) for im in images])
    counts = [int(c) for c in counts.num_image_tokens]
    if sum(t == cfg.image_token_id for t in ids) != len(counts) or \
            sum(t == cfg.image_token_id for t in processed) != sum(counts):
        return processed
    rebuilt, k = [], 0
    for t in ids:
        rebuilt.extend([t] * counts[k] if t == cfg.image_token_id else [t])
        k += t == cfg.image_token_id
    return rebuilt


@torch.no_grad()
def prompt_logprobs(engine, ids: list[int], images: list) -> list[list]:
    """`meta_info.input_token_logprobs` of a 0-token generation of `ids` with images: `[logprob, id, None]`, the
    first logprob None. At an image position SGLang's origin_input_ids hold the image's pad-hash value, which
    `srt/managers/schedule_batch.py` clamps to vocab_size − 1 for the logprob, and `scheduler_components/
    logprob_result_processor.py` reports as id 0 (values ≥ vocab_size − 1 become 0)."""
    from grpo_cli.models.logprobs import _completion_logits

    model = engine.model
    vocab = model.config.get_text_config().vocab_size
    image = model.config.image_token_id
    seq = torch.tensor([ids])
    logits = _completion_logits(model, seq, torch.ones_like(seq), logits_to_keep=len(ids) - 1, temperature=1.0,
                                vision=engine.vision_inputs([images]))
    targets = torch.tensor([[vocab - 1 if t == image else t for t in ids[1:]]])
    lps = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[0, :, 0].tolist()
    return [[None, ids[0], None]] + [[lp, 0 if t == image else t, None] for lp, t in zip(lps, ids[1:], strict=True)]


def logit_bias_bans(bias, vocab_size: int) -> list[int]:
    """The ids a request's `sampling_params.logit_bias` bans. SGLang's form: `api/v1/api_types.py` wants a map of
    floats ("expected a map" / "expected f64": HTTP 400); `srt/sampling/sampling_params.py` verify wants every key
    an int in [0, vocab_size) (a ValueError: 400). The contract models bans only (a bias that drives the
    probability to 0, ≤ -1e4); another value is refused here, not upstream."""
    def refuse(message: str) -> ContractError:
        return ContractError(400, {"error": {"message": message}})

    if not isinstance(bias, dict):
        raise refuse(f"sampling_params.logit_bias: expected a map, got {type(bias).__name__}")
    bans = []
    for key, value in bias.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse(f"sampling_params.logit_bias[{key!r}]: expected f64, got {type(value).__name__}")
        try:
            token = int(key)
        except ValueError as exc:
            raise refuse(str(exc)) from exc
        if not 0 <= token < vocab_size:
            raise refuse(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
        if value > -1e4:
            raise refuse(f"logit_bias {value} for {key}: the contract server models bans (≤ -1e4) only")
        bans.append(token)
    return bans
