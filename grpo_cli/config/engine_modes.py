"""The (engine, mode) matrix: one row per way `rollout.engine` × `rollout.mode` can run, with its facts. Plain data
(layer 1): the config rules, `grpo plan` and `grpo train --rehearse` read the facts here, and the factory
(`rollout/factory.make_engine`) imports the builder each row names, so nothing below rollout/ imports it.

The rows (docs/rollout-modes.md shows them as a table): hf and vllm colocate, hf/vllm/sglang/vllm-serve server,
hf and vllm async, vllm-serve stream.

Adding an engine (e.g. a client of another server): write its class on `rollout.base.RolloutEngine` (in its own
folder under rollout/), with a builder `fn(cfg, ctx, **extras)` (`extras`: the `build_args` it names, out of
`policy`, `device`, `broadcast`), then declare one row per mode it runs in with `register(EngineMode(...))` in this
module's `MODES` (or, for a plugin or a test, at import time before the config is validated). `rollout.engine`
accepts every engine of the table, the rules refuse a mode it has no row for, the factory builds it, `grpo plan`
and `--rehearse` read its facts. tests/config/test_engine_modes.py declares one in a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpo_cli.config.transports import names_for

Mode = Literal["colocate", "server", "async", "stream"]
BUILD_ARGS = ("policy", "device", "broadcast", "wrap")
"""What the factory can hand a builder besides (cfg, ctx): the trainer's Hugging Face policy, the device, a
function that shares rank 0's objects with the other ranks, and the wrapper `wrap(engine, cfg, tokenizer)` that
puts the `agent:` / `rollout.custom` loop around an engine where it generates (async: in each Ray actor)."""


@dataclass(frozen=True)
class EngineMode:
    """One (engine, mode) combination and its facts."""

    engine: str
    mode: Mode
    build: str
    """`module:attr[.attr]` of the builder, called `fn(cfg, ctx, **{a: ... for a in build_args})`."""
    build_args: tuple[str, ...] = ()
    colocated: bool = False
    """The engine runs inside the training processes (shares their devices; `distributed.offload` applies)."""
    shares_policy_weights: bool = False
    """The engine may generate with the policy's own parameters, no weight sync (hf colocate, `rollout.dtype`
    auto): the trainer's sharding and parameter offload then reach generation."""
    can_sleep: bool = False
    """`rollout.vllm.sleep_level` applies: the engine frees its memory while training."""
    remote: bool = False
    """The engine is a client of rollout servers at `rollout.server.urls`, which build their engine themselves
    (engine settings of the trainer's config such as `rollout.compile` do not reach them)."""
    transports: tuple[str, ...] = ()
    """The weight transports it takes (the first is the default); a row with a `client` takes that client's
    (`config/transports.py`), which is what a row left empty here gets."""
    client: str | None = None
    """Server rows: the weight-transport client its engine is (`config.transports.TRANSPORTS`)."""
    actor_build: str | None = None
    """Async rows: `module:attr` of the builder `fn(cfg, ctx)` each Ray actor calls for its own engine."""
    rehearsal_server: str | None = None
    """The server `--rehearse` starts beside the run (`launch/rehearse_run.server_command`): `grpo-hf`,
    `grpo-vllm` or `sglang-contract`; None for an engine the trainer builds."""
    images: bool = False
    """Prompts with images (a vision-language model) run on this row: its engine takes `images=` and generates
    with them (docs/vision.md's matrix); on the other rows such a run is refused (`config/rules_vision.py`)."""
    about: str = ""

    def __post_init__(self) -> None:
        if self.client is None:
            return
        if self.transports and self.transports != names_for(self.client):
            raise ValueError(f"engine {self.engine!r}: a row of the {self.client} client takes its transports "
                             f"{names_for(self.client)}, not {self.transports} (config/transports.py)")
        object.__setattr__(self, "transports", names_for(self.client))

    @property
    def key(self) -> tuple[str, str]:
        return self.engine, self.mode


_SERVER = "grpo_cli.rollout.remote.client:ServerEngine.from_config"
_ASYNC = "grpo_cli.rollout.ray.engine:AsyncRolloutEngine.from_config"

MODES: dict[tuple[str, str], EngineMode] = {row.key: row for row in (
    EngineMode("hf", "colocate", "grpo_cli.rollout.factory:make_hf_engine", ("policy", "device"), colocated=True,
               shares_policy_weights=True, transports=("in-process",), images=True,
               about="the policy samples with grpo-cli's decode loop (a copy in another rollout.dtype)"),
    EngineMode("vllm", "colocate", "grpo_cli.rollout.vllm.engine:VLLMEngine.from_config", colocated=True,
               can_sleep=True, transports=("in-process",),
               about="vllm.LLM in every training process (tensor-parallel groups of training ranks)"),
    EngineMode("hf", "server", _SERVER, remote=True, client="serve-rollout", rehearsal_server="grpo-hf",
               images=True, about="`grpo serve-rollout --engine hf`"),
    EngineMode("vllm", "server", _SERVER, remote=True, client="serve-rollout", rehearsal_server="grpo-vllm",
               about="`grpo serve-rollout --engine vllm`"),
    EngineMode("sglang", "server", "grpo_cli.rollout.sglang.client:SGLangEngine.from_config", remote=True,
               client="sglang", rehearsal_server="sglang-contract", images=True,
               about="SGLang servers"),
    EngineMode("vllm-serve", "server", "grpo_cli.rollout.vllm_serve.client:VLLMServeEngine.from_config", remote=True,
               client="vllm-serve",
               about="a stock `vllm serve` in dev mode (vLLM's RL API; docs/server-mode.md gives its command)"),
    EngineMode("vllm-serve", "stream", "grpo_cli.rollout.vllm_serve.client:VLLMServeEngine.from_config", remote=True,
               client="vllm-serve",
               about="`vllm serve` generating without stopping; weights land in flight (docs/streaming.md)"),
    EngineMode("hf", "async", _ASYNC, ("broadcast", "wrap"), transports=("ray",), images=True,
               actor_build="grpo_cli.rollout.ray.actor:hf_actor_engine",
               about="Ray actors, each with an hf copy, one step ahead"),
    EngineMode("vllm", "async", _ASYNC, ("broadcast", "wrap"), transports=("ray",),
               actor_build="grpo_cli.rollout.ray.actor:vllm_actor_engine",
               about="Ray actors, each with a single-process vllm.LLM, one step ahead"),
)}
"""Every (engine, mode) that runs; a combination not here is refused by the config rules."""


def register(row: EngineMode) -> None:
    """Declare `row` (replacing the row of the same engine and mode)."""
    MODES[row.key] = row


def engine_mode(engine: str, mode: str) -> EngineMode | None:
    return MODES.get((engine, mode))


def engines() -> list[str]:
    """Every engine of the table, in declaration order."""
    return list(dict.fromkeys(e for e, _ in MODES))


def modes_of(engine: str) -> list[str]:
    return [m for e, m in MODES if e == engine]
