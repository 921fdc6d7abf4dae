"""The `RolloutEngine` contract (a base class with a default for every member the trainer uses), the wrapper base
of rollout loops around an engine, and the data every engine returns."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grpo_cli.config.errors import UserError

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image as PILImage

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
    token_versions: list[list[int]] | None = None
    """Stream mode: the weight version that sampled each completion token (from the server's `weight_versions`
    spans, never guessed); a completion may span several. None where one version sampled the whole batch
    (`weight_version`)."""


class RolloutError(UserError, RuntimeError):
    """A rollout engine failed in a way the user can act on (message says how)."""


class RolloutEngine:
    """What the trainer may ask of any engine (hf, vllm, server client, SGLang client, async, and the wrappers of
    `agent:`/`rollout.custom`): every member the trainer uses is declared here with its default, and an engine
    overrides what it has. Callers ask the contract (`engine.reads_weights`, `engine.is_server`, ...), never
    `hasattr`/`getattr` (tests/layout/test_engine_contract.py). `generate`, `score` and `update_weights` have no
    default: every engine defines them. A wrapper (`EngineWrapper`) passes on only what it declares."""

    weight_version: int = 0
    """Version of the weights the engine holds (0: the checkpoint it loaded); `update_weights` sets it."""
    shares_policy_weights: bool = False
    """True when the engine generates with the trainer's own parameters (no sync needed)."""
    push_from_main_only: bool = False
    """True when one copy of the weights serves the whole job (a rollout server, SGLang, the async engine's object
    store): rank 0 alone hands it the weights, the other ranks `follow_update` (train/weights/sync_ranks.py)."""
    urls: tuple[str, ...] | list[str] = ()
    """The rollout servers this engine is a client of (empty: the engine runs in this process or in Ray actors)."""
    dtype: torch.dtype | str | None = None
    """The dtype the engine holds its weights in (a torch dtype or its name), where it says: weight sync casts to it
    and it bounds the sync probe's tolerance; None: not reported."""
    eos_token_ids: list[int] | None = None
    """Token ids generation stops at, for an engine whose `generate` reads them (hf, vllm: a server sets the
    client's stop ids here for one call); None: the engine's own."""
    model = None
    """The Hugging Face module the engine generates with, where it has one (hf): `grpo diagnose` reads its dtype."""
    accepts_images: bool = False
    """True when `generate` and `score` take `images=` (one list of RGB `PIL.Image.Image` per prompt/sequence, in
    the order of the prompt's image placeholders) and generate with them: a run whose prompts carry images refuses
    an engine without it (`config.rules`, `train/run.py`). Callers pass `images=` only to such an engine, and only
    when some prompt has images, so an engine without it keeps its text-only signature."""
    last_probe: dict[str, float] | None = None
    """The last sync's probe figures when the engine scored them later (`probe_when_awake`); the loop takes them
    once (`train/loop.take_deferred_probe`)."""

    @property
    def is_server(self) -> bool:
        """Whether the engine is a client of rollout servers (`urls`): messages then name the server's model."""
        return bool(self.urls)

    @property
    def reads_weights(self) -> bool:
        """Whether `read_weights` is available (its class defines one): sync verification then compares tensors."""
        return _overrides(self, "read_weights")

    @property
    def continues_rows(self) -> bool:
        """Whether `continue_rows` is available (hf): multi-turn rollouts keep each row's KV between turns."""
        return _overrides(self, "continue_rows")

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 images: list[list[PILImage]] | None = None) -> RolloutBatch:
        """`sampling.n` completions of each prompt. `images` (`accepts_images` engines only): prompt i's images;
        its ids are then the processor-expanded ids (one `<|image_pad|>` per merged patch group, between
        `<|vision_start|>` and `<|vision_end|>`), and no completion samples an image/video placeholder token."""
        raise NotImplementedError(f"{type(self).__name__} defines no generate")

    def generate_turn(self, prompt_ids: list[list[int]], sampling: SamplingParams, first: list[int]) -> RolloutBatch:
        """A later turn of multi-turn trajectories: prompt i continues prompt `first[i]` of this thread's last
        `generate` (a server client sends it where that one went, whose prefix cache holds it). Default: `generate`."""
        return self.generate(prompt_ids, sampling)

    def score(self, sequences: list[list[int]], images: list[list[PILImage]] | None = None) -> list[list[float]]:
        """Temperature-1 logprob of each token after the first, given the tokens before it (weight-sync probes);
        `images` (`accepts_images` engines only): sequence i's images, as in `generate`. NaN where the engine
        scores another token than the sequence's (SGLang at image placeholders); the probe skips those."""
        raise NotImplementedError(f"{type(self).__name__} defines no score")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the named tensors (Hugging Face names) and hold them as `version`."""
        raise NotImplementedError(f"{type(self).__name__} defines no update_weights")

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Optional (`reads_weights`): the engine's copies of the named tensors, for exact comparison."""
        raise NotImplementedError(f"{type(self).__name__} cannot read its weights back")

    def continue_rows(self, rows: list[int], new_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """Optional (`continues_rows`): sample on after `new_ids`, from the rows' kept KV (`generate(keep_cache=)`)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no rows between calls")

    def follow_update(self, version: int) -> None:
        """On a rank that did not push (`push_from_main_only`): take note that the job's copy is now `version`
        (the async engine loads what rank 0 posted on its own actors)."""
        self.weight_version = version

    def bind_prompts(self, prompts) -> None:
        """The dataset rows of the prompts the next `generate` gets (multi-turn environments); default: unused."""

    def agree_any(self, flag: bool) -> bool:
        """Whether `flag` is true on any process that must make this engine's calls together (a colocated vLLM
        engine's tensor-parallel group, whose every `generate` gathers the group's prompts): a multi-turn loop asks
        it before each turn, and a process with nothing left joins the turn with an empty `generate` (it returns an
        empty batch). Collective over that group; default (an engine no other process calls with): `flag`."""
        return flag

    def probe_when_awake(self, check: Callable[[], dict]) -> bool:
        """Whether the engine runs the sync probe `check` itself later: at its next wake-up (a sleeping colocated
        vLLM engine; its figures then go to `last_probe`), or in the background until `settle_checks` (stream mode's
        `vllm serve` client); default False: the caller probes now."""
        return False

    def settle_checks(self) -> dict[str, float]:
        """Wait for the sync checks the engine runs in the background (stream mode: `stream.DeferredChecks`) and
        return their figures, or raise their failure; default: none run, {}. Callers go through
        `weight_sync.settle_deferred`, which makes every rank agree."""
        return {}

    def keeping_weights(self) -> AbstractContextManager[None]:
        """A block after which the engine must still hold its weights (no weight sync follows: evaluation)."""
        return nullcontext()

    def hold_awake(self) -> AbstractContextManager[None]:
        """Keep the engine awake across the `generate` calls of a block, the turns of one multi-turn rollout; an
        engine that sleeps after each generation (colocated vLLM) then sleeps once, when the block ends. Default:
        a block that changes nothing (an engine that never sleeps between calls)."""
        return nullcontext()

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (their KV belongs to old weights); default: nothing cached."""

    def sleep(self, level: int) -> None:
        """Free memory for training (level 1: weights to host, KV freed; 2: both freed); default: nothing."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what `sleep` freed (`tags`: only those parts); default: nothing."""

    def close(self) -> None:
        """Free the engine's resources; default: nothing."""


def _overrides(engine: RolloutEngine, name: str) -> bool:
    return getattr(type(engine), name) is not getattr(RolloutEngine, name)


def generate_with_images(engine: RolloutEngine, prompt_ids: list[list[int]], sampling: SamplingParams,
                         images: list[list[PILImage]] | None) -> RolloutBatch:
    """`engine.generate`, passing `images=` only when some prompt has images (`data.prompts.images_of`), so an
    engine without `accepts_images` keeps its text-only signature."""
    if images is None:
        return engine.generate(prompt_ids, sampling)
    return engine.generate(prompt_ids, sampling, images=images)


def held_awake(engine) -> AbstractContextManager[None]:
    """The block during which `engine` stays awake between generations: its `hold_awake()` (the contract's default
    changes nothing), or that default for an object outside the contract. Looked up on the class, so a wrapper
    passes it on only by declaring it (as `EngineWrapper` does)."""
    hold = getattr(type(engine), "hold_awake", None)
    return hold(engine) if hold is not None else nullcontext()


class EngineWrapper(RolloutEngine):
    """A rollout loop around an engine (`agent:`, `rollout.custom`): it defines `generate` itself and passes on,
    explicitly, the members below; what it does not list (`continue_rows`, `bind_prompts`, `eos_token_ids`)
    is the contract's default unless the subclass defines it, so a wrapper never claims its inner engine's
    capabilities by accident."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.engine.weight_version = version

    @property
    def last_probe(self) -> dict[str, float] | None:
        return self.engine.last_probe

    @last_probe.setter
    def last_probe(self, figures: dict[str, float] | None) -> None:
        self.engine.last_probe = figures

    @property
    def shares_policy_weights(self) -> bool:
        return self.engine.shares_policy_weights

    @property
    def push_from_main_only(self) -> bool:
        return self.engine.push_from_main_only

    @property
    def urls(self):
        return self.engine.urls

    @property
    def dtype(self):
        return self.engine.dtype

    @property
    def model(self):
        return self.engine.model

    @property
    def reads_weights(self) -> bool:
        return self.engine.reads_weights

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        return self.engine.read_weights(names)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.engine.score(sequences)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def follow_update(self, version: int) -> None:
        self.engine.follow_update(version)

    def probe_when_awake(self, check: Callable[[], dict]) -> bool:
        return self.engine.probe_when_awake(check)

    def settle_checks(self) -> dict[str, float]:
        return self.engine.settle_checks()

    def agree_any(self, flag: bool) -> bool:
        return self.engine.agree_any(flag)

    def keeping_weights(self) -> AbstractContextManager[None]:
        return self.engine.keeping_weights()

    def hold_awake(self) -> AbstractContextManager[None]:
        return self.engine.hold_awake()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def close(self) -> None:
        self.engine.close()


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
