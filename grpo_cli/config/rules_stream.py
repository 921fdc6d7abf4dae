"""Rules of `rollout.mode: stream` (docs/streaming.md): the engines that stream, what the pool and the loss need."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.config.engine_modes import MODES

if TYPE_CHECKING:
    from grpo_cli.config.sections import GRPOSections


def stream_engines() -> list[str]:
    """The engines with a stream row in `config/engine_modes.MODES`."""
    return [e for e, m in MODES if m == "stream"]


def refuse_engine(engine: str) -> None:
    """`rollout.mode: stream` with an engine that has no stream row."""
    names = ", ".join(stream_engines())
    raise ValueError(
        f"rollout.mode 'stream' runs with rollout.engine {names} only (its server pauses with requests kept, takes "
        f"the weights in flight and reports the weight version of every token), not with '{engine}'; set "
        f"rollout.engine to {names} and point rollout.server.urls at the servers (docs/streaming.md), or use "
        "rollout.mode server or async with this engine.")


def check_stream(cfg: GRPOSections) -> None:
    """What stream mode needs from the rest of the config."""
    r, t = cfg.rollout, cfg.train
    world = cfg.distributed.num_processes * cfg.distributed.num_machines
    if not cfg.algorithm.is_correction.enabled:
        raise ValueError(
            "algorithm.is_correction.enabled=false, but rollout.mode 'stream' trains on tokens sampled by older "
            "weights (up to rollout.stream.max_version_lag versions behind): the per-token importance weight "
            "against the sampler's logprobs is what corrects that, so stream mode forces it on. Remove "
            "algorithm.is_correction.enabled (or set it true), or use rollout.mode server.")
    if world > 1:
        raise ValueError(
            f"rollout.mode 'stream' runs one training process (its pool and buffer live in it), but "
            f"distributed.num_processes x num_machines = {world}; set distributed.num_processes=1 or use "
            "rollout.mode server for several training processes.")
    if cfg.agent is not None or r.custom:
        what = "agent:" if cfg.agent is not None else "rollout.custom"
        raise ValueError(
            f"{what} runs its own rollout loop around engine.generate, but rollout.mode 'stream' submits single-turn "
            f"groups from its pool; remove {what} or use rollout.mode server.")
    if t.dynamic_sampling.enabled:
        raise ValueError(
            "train.dynamic_sampling draws extra rounds of prompts synchronously, which rollout.mode 'stream' does "
            "not (its pool over-provisions instead: raise rollout.stream.max_in_flight); disable "
            "train.dynamic_sampling or use rollout.mode server.")
    buffered = r.stream.max_buffered_groups
    if buffered is not None and buffered < t.prompts_per_step:
        raise ValueError(
            f"rollout.stream.max_buffered_groups={buffered} is below train.prompts_per_step={t.prompts_per_step}: "
            "a step takes that many finished groups from the buffer, so it would wait forever; set it to at least "
            f"{t.prompts_per_step} or null (one step's worth).")


def check_unused(cfg: GRPOSections) -> None:
    """`rollout.stream.*` set outside stream mode changes nothing: refused."""
    from grpo_cli.config.stream import StreamConfig

    default, s = StreamConfig(), cfg.rollout.stream
    given = [name for name in type(s).model_fields if getattr(s, name) != getattr(default, name)]
    if cfg.rollout.mode != "stream" and given:
        raise ValueError(
            f"rollout.stream.{given[0]} is set (to {getattr(s, given[0])!r}) but rollout.mode is "
            f"'{cfg.rollout.mode}': rollout.stream applies to rollout.mode stream only; remove it or set "
            "rollout.mode=stream.")
