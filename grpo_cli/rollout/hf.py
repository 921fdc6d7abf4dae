"""`hf` engine: transformers `generate` on the policy (or a copy in another dtype), with sampler logprobs."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo_cli.rollout.base import RolloutBatch, SamplingParams
from grpo_cli.rollout.scoring import score_sequences


class _LogprobRecorder(LogitsProcessor):
    """Last processor in the chain: keeps the processed scores of one step and their logsumexp and, at the next
    step, computes logprob = score[sampled] − logsumexp(scores) of the token sampled from them. No (B, V)
    log-softmax is materialised; the scores tensor is only referenced."""

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.collected: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.flush(input_ids[:, -1])
        self.pending = (scores, torch.logsumexp(scores.float(), dim=-1))
        return scores

    def flush(self, sampled: torch.Tensor) -> None:
        if self.pending is not None:
            scores, lse = self.pending
            self.collected.append(scores.gather(-1, sampled[:, None]).squeeze(-1).float() - lse)
            self.pending = None


def _processors(sampling: SamplingParams, recorder: _LogprobRecorder) -> LogitsProcessorList:
    procs: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        procs.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        procs.append(TopPLogitsWarper(sampling.top_p))
    return LogitsProcessorList([*procs, recorder])


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (ids, attention_mask) of shape (N, max_len)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


class HFEngine:
    """Samples with `model.generate`. With `model` the policy itself, weights are shared (no sync needed);
    with a separate copy (e.g. a bf16 rollout model), `update_weights` copies the trainer's tensors in."""

    def __init__(self, model, *, eos_token_ids: list[int], pad_token_id: int, shares_policy_weights: bool) -> None:
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.shares_policy_weights = shares_policy_weights
        self.weight_version = 0

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        start = time.perf_counter()
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompt_ids, self.pad_token_id)
        recorder = _LogprobRecorder()
        was_training = self.model.training
        self.model.eval()
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                logits_processor=_processors(sampling, recorder),
                max_new_tokens=sampling.max_tokens,
                num_return_sequences=sampling.n,
                eos_token_id=self.eos_token_ids,
                pad_token_id=self.pad_token_id,
                use_cache=True,
            )
        self.model.train(was_training)
        new = out[:, ids.shape[1] :].cpu()
        recorder.flush(new[:, -1].to(device))
        logps = torch.stack(recorder.collected, dim=1).cpu() if recorder.collected else torch.zeros(len(new), 0)
        completions, reasons, sampler = self._trim(new, logps)
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=completions,
            finish_reasons=reasons,
            sampler_logprobs=sampler,
            weight_version=self.weight_version,
            timings={"generate": time.perf_counter() - start},
        )

    def _trim(self, new: torch.Tensor, logps: torch.Tensor):
        completions, reasons, sampler = [], [], []
        eos = set(self.eos_token_ids)
        for row, lp in zip(new.tolist(), logps.tolist(), strict=True):
            hits = [t for t, tok in enumerate(row) if tok in eos]
            end = hits[0] + 1 if hits else len(row)
            completions.append(row[:end])
            sampler.append(lp[:end])
            reasons.append("stop" if hits else "length")
        return completions, reasons, sampler

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return score_sequences(self.model, sequences, pad_token_id=self.pad_token_id)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if not self.shares_policy_weights:
            params = dict(self.model.named_parameters())
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(params[name].dtype))
        self.weight_version = version

    def sleep(self, level: int) -> None:
        """Nothing to release: the engine is the policy (or a small copy)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        self.model = None
