"""`hf` engine: our own KV-cached decode loop (`rollout.decode`) on the policy (or a copy in another dtype), with
sampler logprobs."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Iterable

import torch

from grpo_cli.config.errors import UserError
from grpo_cli.data.images import ImageProcessor
from grpo_cli.models.vision import VisionInputs, placeholder_ids
from grpo_cli.rollout.base import RolloutBatch, RolloutEngine, RolloutError, SamplingParams
from grpo_cli.rollout.hf.decode import Decoded, decode, decode_continue
from grpo_cli.rollout.hf.decode_step import decoder_parts
from grpo_cli.rollout.hf.static_step import StepStore
from grpo_cli.rollout.seeds import request_seed
from grpo_cli.models.logprobs import score_sequences
from grpo_cli.models.weight_names import parameters_by_name


class HFEngine(RolloutEngine):
    """Samples with `decode` (prefill once per prompt, KV cache shared by its n samples). With `model` the policy
    itself, weights are shared (no sync needed); with a separate copy (e.g. a bf16 rollout model), `update_weights`
    copies the trainer's tensors in."""

    accepts_images = True

    def __init__(self, model, *, eos_token_ids: list[int], pad_token_id: int, shares_policy_weights: bool,
                 compile_step: bool = False, images: ImageProcessor | None = None, rank: int = 0) -> None:
        self.model = model
        self.rank = rank  # the training process (or Ray actor) this engine samples for: it keys the seeds
        self.images = images  # a vision-language model's image processor (`generate(images=)`)
        self.compile_step = compile_step  # `rollout.compile`: the lean decode step under torch.compile
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.shares_policy_weights = shares_policy_weights
        self.weight_version = 0
        self._kept = None  # the last call's rows' KV (`keep_cache`), for `continue_rows`
        self._copy: GenerationCopy | None = None  # the weights in autocast's dtype (`generation_model`)
        self._steps = StepStore()  # the last decode's CUDA graphs, replayed by the next decode of its shape

    def _run(self, fn, *args, refresh: bool = True, **kwargs) -> Decoded:
        model, context = self.generation_model(refresh=refresh)
        was_training = model.training
        model.eval()
        try:
            with context:
                return fn(model, *args, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
                          compile_step=self.compile_step, steps_store=self._steps, **kwargs)
        finally:
            model.train(was_training)

    def generation_model(self, *, refresh: bool = True):
        """(model to decode with, context to decode in). Under autocast over float32 weights (ddp's mixed precision,
        which the trainer enters around generation), a copy of the weights in autocast's dtype, decoded with autocast
        off: in one dtype the decode takes the preallocated cache and the lean step (`decode.new_cache`), where
        autocast's mixed dtypes fell back to the growing cache and the full forward. The copy is refreshed from the
        policy at every `generate` (`refresh`), so it holds the weights of the last optimizer step whatever the
        optimizer (a fused AdamW's step bumps no tensor version counter, so nothing cheaper says they changed); a
        multi-turn continuation keeps the weights its kept KV came from. Otherwise the model itself, in the caller's
        context."""
        dtype = autocast_dtype(self.model) if self.shares_policy_weights else None
        if dtype is None or not copyable(self.model):
            return self.model, contextlib.nullcontext()
        if self._copy is None or self._copy.dtype != dtype:
            self._copy = None  # drop the old copy before building one in another dtype
            self._copy = GenerationCopy(self.model, dtype)
        elif refresh:
            self._copy.refresh()
        return self._copy.model, torch.autocast(next(self.model.parameters()).device.type, enabled=False)

    def _seeded(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with the seed of this rank's batch (`rollout/seeds.py`): one generator draws every row's noise,
        so the rows of a call differ, and the ranks of a step, seeded alike, must not draw the same noise."""
        if sampling.seed is None:
            return sampling
        return dataclasses.replace(sampling, seed=request_seed(sampling.seed, rank=self.rank, prompt=0))

    def _batch(self, out: Decoded, prompt_ids: list[list[int]], start: float) -> RolloutBatch:
        completions, reasons, sampler = _trim(out)
        self._kept = out.kept
        return RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completions,
                            finish_reasons=reasons, sampler_logprobs=sampler, weight_version=self.weight_version,
                            timings={"generate": time.perf_counter() - start})

    def vision_inputs(self, images: list[list] | None) -> VisionInputs | None:
        """The image processor's outputs for one list of images per row (None without images)."""
        if images is None or not any(images):
            return None
        if self.images is None:
            raise RolloutError(f"images were given to the hf engine, but {type(self.model).__name__} is not a "
                               "vision-language model")
        return VisionInputs.cat([self.images.encode(list(row)) for row in images])

    def banned_ids(self) -> list[int] | None:
        """Ids never sampled: a vision-language model's image/video placeholders (the forward counts them over the
        whole sequence, so one in a completion would not match the images)."""
        return placeholder_ids(self.model.config) if self.images is not None else None

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 images: list[list] | None = None, *, keep_cache: bool = False) -> RolloutBatch:
        """Sample; `images`: each prompt's images (a vision-language model); with `keep_cache`, each completion
        row's KV stays here for `continue_rows` (multi-turn)."""
        start = time.perf_counter()
        self._kept = None
        out = self._run(decode, prompt_ids, self._seeded(sampling), keep=keep_cache, vision=self.vision_inputs(images),
                        banned=self.banned_ids())
        return self._batch(out, prompt_ids, start)

    def can_continue(self) -> bool:
        """Whether the last call kept its rows' KV (a model whose cache layers are all plain full attention)."""
        return bool(self._kept) and all(row is not None for row in self._kept)

    def continue_rows(self, rows: list[int], new_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """One more completion for rows `rows` of the last call, after `new_ids[i]` more tokens each, reading only
        those (and each row's last sampled token) on top of the kept KV; equal, up to float rounding, to
        generating from the whole sequence. The new rows' KV is kept in turn (`drop_cache` ends it)."""
        start = time.perf_counter()
        kept = [self._kept[r] for r in rows]
        self._kept = None
        out = self._run(decode_continue, kept, new_ids, self._seeded(sampling), refresh=False)
        return self._batch(out, [[] for _ in rows], start)

    def drop_cache(self) -> None:
        self._kept = None

    def score(self, sequences: list[list[int]], images: list[list] | None = None) -> list[list[float]]:
        return score_sequences(self.model, sequences, pad_token_id=self.pad_token_id,
                               vision=self.vision_inputs(images))

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._kept = None  # KV of the old weights
        if not self.shares_policy_weights:
            params = parameters_by_name(self.model)  # a tied weight arrives under each of its names
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(params[name].dtype))
        self.weight_version = version

    def sleep(self, level: int) -> None:
        """Release the last decode's kept graphs and KV buffers (`StepStore`); the weights are the policy's (or a
        small copy) and stay."""
        self._steps.clear()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        self.model = None
        self._kept = None
        self._copy = None
        self._steps.clear()


def image_processor(cfg, ctx):
    """The checkpoint's image processor when it is a vision-language model (None otherwise): the hf engine turns
    the images it is given into the model's inputs with it."""
    return ImageProcessor.load(ctx.model_path, max_pixels=cfg.data.max_image_pixels)


def autocast_dtype(model) -> torch.dtype | None:
    """The dtype autocast computes `model`'s matmuls in when autocast is on for its device and that differs from
    its weights' dtype; None otherwise."""
    weight = next(model.parameters())
    kind = weight.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    return dtype if dtype != weight.dtype else None


def copyable(model) -> bool:
    """Whether `GenerationCopy` can mirror `model` parameter by parameter: plain tensors (not DTensor shards) and no
    PEFT wrapper (whose adapters would have to be merged again after every step)."""
    return not hasattr(model, "get_base_model") and all(
        type(p) in (torch.Tensor, torch.nn.Parameter) for p in model.parameters())


class GenerationCopy:
    """The policy's module with every parameter held in `dtype` (buffers, e.g. RoPE's float32 frequencies, as they
    are): `grpo plan`'s `hf_generation_copy` row, P · 2 bytes in bf16. Built without a float32 copy of the weights
    (the parameters are swapped in `deepcopy`'s memo); `refresh` copies the policy's weights in (cast)."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        self.dtype = dtype
        sources = list(model.parameters())
        memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in sources}
        self.pairs = [(p, memo[id(p)]) for p in sources]
        self.model = copy.deepcopy(model, memo).eval()

    @torch.no_grad()
    def refresh(self) -> None:
        for source, target in self.pairs:
            target.copy_(source)


def require_compilable(model, *, setting: str = "rollout.compile") -> None:
    """Refuse `setting` (a compiled decode step) where it would change nothing or cannot build: a model whose decode
    runs the full forward (not a Llama/Qwen2/Qwen3 decoder `decode_step` reproduces), or no C++ compiler."""
    from grpo_cli.runtime.compiler import require_compiler, turn_off

    if decoder_parts(model) is None:
        raise UserError(f"{setting} compiles the lean decode step of Llama, Qwen2 and Qwen3 decoders; "
                        f"{type(model).__name__} decodes through its full forward, which it would leave as it is: "
                        f"{turn_off(setting)}.")
    require_compiler(next(model.parameters()).device, setting=setting)


def _trim(out: Decoded) -> tuple[list[list[int]], list[str], list[list[float]]]:
    """Rows cut at their length (stop token included), finish reasons and sampler logprobs as lists."""
    lengths = out.lengths.tolist()
    tokens, logprobs = out.tokens.cpu().tolist(), out.logprobs.cpu().tolist()
    completions = [row[:n] for row, n in zip(tokens, lengths, strict=True)]
    sampler = [row[:n] for row, n in zip(logprobs, lengths, strict=True)]
    reasons = ["stop" if s else "length" for s in out.stopped.tolist()]
    return completions, reasons, sampler
