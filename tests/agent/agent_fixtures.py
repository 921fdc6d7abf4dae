"""Scripted engines and tokenizers for the agent tests (no model): an engine that answers each generate call with
the next scripted turn of each request, recording what it was asked."""

from __future__ import annotations

from grpo_cli.rollout.base import RolloutBatch, RolloutEngine


class ScriptedEngine(RolloutEngine):
    """`turns[k]` is the list of id lists returned for the k-th generate call (one per request × n)."""

    shares_policy_weights = True
    weight_version = 0

    def __init__(self, turns: list[list[list[int]]], eos: int, finish: list[list[str]] | None = None):
        self.turns, self.eos, self.finish = turns, eos, finish
        self.calls: list[tuple[list[list[int]], int, int]] = []
        self.seeds: list[int | None] = []  # each call's sampling seed
        self.firsts: list[list[int]] = []  # each later turn's `first` (generate_turn)

    def generate(self, prompt_ids, sampling):
        k = len(self.calls)
        self.calls.append(([list(p) for p in prompt_ids], sampling.n, sampling.max_tokens))
        self.seeds.append(sampling.seed)
        out = [ids[: sampling.max_tokens] for ids in self.turns[k]]
        reasons = (self.finish[k] if self.finish else
                   ["stop" if ids and ids[-1] == self.eos else "length" for ids in out])
        return RolloutBatch(prompt_ids=[list(p) for p in prompt_ids], completion_ids=out, finish_reasons=reasons,
                            sampler_logprobs=[[-0.5] * len(ids) for ids in out], weight_version=3,
                            metrics={"rollout/server_load/max": float(len(prompt_ids) * sampling.n)})

    def generate_turn(self, prompt_ids, sampling, first):
        self.firsts.append(list(first))
        return self.generate(prompt_ids, sampling)
