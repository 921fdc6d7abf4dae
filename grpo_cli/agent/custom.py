"""`rollout.custom`: a user function produces the completions (ids, loss mask, logprobs per sample) from the
engine; this wrapper checks what it returns and hands the trainer a `RolloutBatch`."""

from __future__ import annotations

from grpo_cli.rollout.base import EngineWrapper, RolloutBatch, RolloutError, SamplingParams, held_awake


class CustomRollout(EngineWrapper):
    """An engine whose `generate` is `fn(engine=, prompt_ids=, sampling=, tokenizer=)`, with the engine held awake
    across the function's calls of it (`rollout.base.held_awake`); the weight sync, sleep and close members of
    `EngineWrapper` are the wrapped engine's, the rest the contract's defaults."""

    def __init__(self, engine, fn, tokenizer, spec: str) -> None:
        super().__init__(engine)
        self.fn, self.tokenizer, self.spec = fn, tokenizer, spec

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        with held_awake(self.engine):
            samples = self.fn(engine=self.engine, prompt_ids=prompt_ids, sampling=sampling, tokenizer=self.tokenizer)
        want = len(prompt_ids) * sampling.n
        if not isinstance(samples, list) or len(samples) != want:
            raise RolloutError(f"rollout.custom {self.spec} returned {type(samples).__name__} of "
                               f"{len(samples) if isinstance(samples, list) else '?'} samples; it must return a list "
                               f"of {want} dicts (prompts × sampling.n, group-contiguous).")
        for j, s in enumerate(samples):
            missing = {"ids", "mask", "logprobs"} - set(s)
            if missing or not len(s["ids"]) == len(s["mask"]) == len(s["logprobs"]):
                raise RolloutError(f"rollout.custom {self.spec}: sample {j} needs ids, mask and logprobs of one "
                                   f"length each (missing {sorted(missing)}, or lengths differ).")
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids], completion_ids=[list(s["ids"]) for s in samples],
            finish_reasons=[s.get("finish_reason", "stop") for s in samples],
            sampler_logprobs=[[float(x) for x in s["logprobs"]] for s in samples],
            weight_version=self.engine.weight_version, loss_masks=[[int(m) for m in s["mask"]] for s in samples])


def wrap_custom(engine, spec: str, tokenizer) -> CustomRollout:
    from grpo_cli.agent.tools import resolve_callable

    return CustomRollout(engine, resolve_callable(spec), tokenizer, spec)
