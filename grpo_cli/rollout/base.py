"""The `RolloutEngine` protocol and the data every engine returns."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from grpo_cli.config.errors import UserError

if TYPE_CHECKING:
    import torch

    from grpo_cli.config.schema import GRPOConfig


@dataclass(frozen=True)
class SamplingParams:
    """What to sample: `n` completions per prompt of at most `max_tokens` tokens; `top_k=0` disables top-k."""

    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class RolloutBatch:
    """Completions of P prompts × n samples, group-contiguous: completion j belongs to prompt j // n.

    `completion_ids` include the stop token when the sequence stopped (finish reason `stop`);
    `sampler_logprobs[j][t]` is the engine's logprob of `completion_ids[j][t]` after temperature/top-k/top-p
    processing (None when the engine cannot report them); `weight_version` is the version of the weights that
    sampled the batch.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    finish_reasons: list[str]
    sampler_logprobs: list[list[float]] | None = None
    weight_version: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    loss_masks: list[list[int]] | None = None
    """Multi-turn rollouts (`agent`): 1 for each sampled token, 0 for the environment's (tool results and the
    template around them), which then take no part in the loss, KL, entropy, ratios or length metrics."""
    trajectories: list[list[dict]] | None = None
    """Multi-turn rollouts: each completion as chat messages (assistant turns and tool results)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Step metrics the rollout measured (`tools/*`)."""
    environment_rewards: list[float | None] | None = None
    """Multi-turn rollouts with `agent.environment`: each instance's `reward()` (None without one)."""


class RolloutError(UserError, RuntimeError):
    """A rollout engine failed in a way the user can act on (message says how)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from any engine (hf, vllm, server client, sglang client)."""

    weight_version: int
    shares_policy_weights: bool
    """True when the engine generates with the trainer's own parameters (no sync needed)."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch: ...

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Temperature-1 logprob of each token after the first, given the tokens before it (weight-sync probes)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def close(self) -> None: ...

    def hold_awake(self) -> AbstractContextManager[None]:
        """Optional (callers use `held_awake(engine)`): keep the engine awake across the `generate` calls of a block,
        the turns of one multi-turn rollout; an engine that sleeps after each generation (colocated vLLM) then
        sleeps once, when the block ends. A wrapper declares it, passing it on to the engine it wraps."""
        ...


def held_awake(engine) -> AbstractContextManager[None]:
    """The block during which `engine` stays awake between generations: its own `hold_awake()` where its class
    declares one, else the contract's default, a block that changes nothing (an engine that never sleeps between
    calls). Looked up on the class, so a wrapper passes it on only by declaring it."""
    hold = getattr(type(engine), "hold_awake", None)
    return hold(engine) if hold is not None else nullcontext()


@dataclass(frozen=True)
class EngineContext:
    """What an engine needs to know about the training side."""

    model_path: str
    eos_token_ids: list[int]
    pad_token_id: int
    rank: int = 0
    world_size: int = 1


def engine_dtype(cfg: GRPOConfig) -> str:
    """The rollout engine's dtype name: `rollout.dtype`, or `model.dtype` when it is `auto`."""
    return cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
