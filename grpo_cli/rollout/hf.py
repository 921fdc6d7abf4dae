"""`hf` engine: our own KV-cached decode loop (`rollout.decode`) on the policy (or a copy in another dtype), with
sampler logprobs."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from grpo_cli.config.errors import UserError
from grpo_cli.rollout.base import RolloutBatch, SamplingParams
from grpo_cli.rollout.decode import Decoded, decode
from grpo_cli.rollout.decode_step import decoder_parts
from grpo_cli.rollout.scoring import score_sequences
from grpo_cli.rollout.weight_names import parameters_by_name


class HFEngine:
    """Samples with `decode` (prefill once per prompt, KV cache shared by its n samples). With `model` the policy
    itself, weights are shared (no sync needed); with a separate copy (e.g. a bf16 rollout model), `update_weights`
    copies the trainer's tensors in."""

    def __init__(self, model, *, eos_token_ids: list[int], pad_token_id: int, shares_policy_weights: bool,
                 compile_step: bool = False) -> None:
        self.model = model
        self.compile_step = compile_step  # `rollout.compile`: the lean decode step under torch.compile
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.shares_policy_weights = shares_policy_weights
        self.weight_version = 0

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        start = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        try:
            out = decode(self.model, prompt_ids, sampling, eos_token_ids=self.eos_token_ids,
                         pad_token_id=self.pad_token_id, compile_step=self.compile_step)
        finally:
            self.model.train(was_training)
        completions, reasons, sampler = _trim(out)
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=completions,
            finish_reasons=reasons,
            sampler_logprobs=sampler,
            weight_version=self.weight_version,
            timings={"generate": time.perf_counter() - start},
        )

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return score_sequences(self.model, sequences, pad_token_id=self.pad_token_id)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if not self.shares_policy_weights:
            params = parameters_by_name(self.model)  # a tied weight arrives under each of its names
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(params[name].dtype))
        self.weight_version = version

    def sleep(self, level: int) -> None:
        """Nothing to release: the engine is the policy (or a small copy)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        self.model = None


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
