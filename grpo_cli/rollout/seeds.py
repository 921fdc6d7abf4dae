"""Every sampling seed of a run, as one hash of where it is used (train seed, step, round, turn, rank, prompt): no
two requests of a run share noise, and a resumed run draws the same seeds as an uninterrupted one."""

from __future__ import annotations

import hashlib

SEED_BITS = 62
"""Seeds lie in [0, 2^62): an engine that adds the child index itself (vLLM gives child j of an `n`-sample request
`seed + j`) stays below 2^63, the int64 that vLLM's V2 sampler and SGLang's `sampling_seed` hold."""


def derive_seed(*parts: int | str) -> int:
    """A seed in [0, 2^SEED_BITS) that is a hash (BLAKE2b) of `parts`: equal parts give equal seeds in every
    process and Python version, and different parts give seeds that are independent draws. Two requests whose
    children take `s, s+1, …, s+n−1` then overlap with probability about 2n / 2^62 (1e-17 at n = 64)."""
    text = ":".join(["grpo-cli", *(str(p) for p in parts)]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> (64 - SEED_BITS)


def step_seed(train_seed: int, step: int) -> int:
    """Sampling seed of a training step: a function of (`train.seed`, step) only, so a resumed run samples the
    same batches."""
    return derive_seed("step", train_seed, step)


def eval_seed(train_seed: int) -> int:
    """Sampling seed of every evaluation of a run (the same for each, so evaluations compare weights, not noise)."""
    return derive_seed("eval", train_seed)


def round_seed(seed: int, round_index: int) -> int:
    """Dynamic sampling: extra round r of a step samples with this seed; round 0 is the step's own seed."""
    return seed if round_index == 0 else derive_seed("round", seed, round_index)


def turn_seed(seed: int, turn: int) -> int:
    """Multi-turn rollouts: turn t samples with this seed; turn 0 is the call's own seed (a one-turn rollout samples
    what a plain `generate` does)."""
    return seed if turn == 0 else derive_seed("turn", seed, turn)


def request_seed(seed: int, *, rank: int, prompt: int) -> int:
    """Seed of the request that samples prompt `prompt` (its index in the `generate` call, or the first prompt of a
    request that carries several) for the training process `rank`, in a call seeded `seed`. Child j of an
    `n`-sample request samples with `request_seed + j` (`child_seed`): vLLM's own rule, which SGLang's client, one
    request per child, repeats."""
    return derive_seed("request", seed, rank, prompt)


def child_seed(seed: int, *, rank: int, prompt: int, child: int) -> int:
    """Seed of completion `child` of prompt `prompt` (see `request_seed`)."""
    return request_seed(seed, rank=rank, prompt=prompt) + child


def group_seed(train_seed: int, group: int) -> int:
    """Stream mode: seed of prompt group `group` (its place in the pool's submission order), so a group regenerated
    after a resume samples with the seed it had."""
    return derive_seed("group", train_seed, group)
