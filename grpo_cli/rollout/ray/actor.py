"""One rollout engine (hf or vllm) inside a Ray actor process: generates, takes weight pushes, answers probes.

Ray runs an actor's calls one at a time in submission order, so a weight push queued behind a generation
lands after it, and a generation queued behind a push samples with the pushed weights: the version stamped
on each batch is exactly the version of the weights that sampled it. `WeightBoard` hands rank 0's pushed
buffers to the other training ranks.
"""

from __future__ import annotations

import asyncio
import math
import os

from grpo_cli.rollout.base import RolloutBatch, SamplingParams


def build_actor_engine(cfg_dump: dict, ctx_fields: dict, wrap=None):
    """The engine of one actor, from the config (JSON dump) and the `EngineContext` fields. It owns its weights:
    `hf` loads a copy of the checkpoint in the rollout dtype, `vllm` runs a single-process `vllm.LLM`. With
    `agent:` it runs the whole multi-turn loop (`agent.rollout.AgentEngine`, tools executed in the actor), so a
    batch's every turn samples with the one weight version stamped on it: Ray runs the actor's calls in order and a
    weight push waits behind the generation. `rollout.custom` runs in the actor the same way, on the actor's engine.
    `wrap(engine, cfg, tokenizer)` builds that loop: the trainer hands it down (`agent.wrap.wrap_rollout`, pickled
    by reference), so rollout/ does not import agent/."""
    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.base import EngineContext

    cfg = GRPOConfig.model_validate(cfg_dump)
    ctx = EngineContext(**ctx_fields)
    engine = _single_turn_engine(cfg, ctx)
    if wrap is None or (cfg.agent is None and not cfg.rollout.custom):
        return engine
    from transformers import AutoTokenizer

    return wrap(engine, cfg, AutoTokenizer.from_pretrained(ctx.model_path))


def _single_turn_engine(cfg, ctx):
    """The engine its async row of `config/engine_modes.MODES` names for an actor (`actor_build`)."""
    from grpo_cli.rollout.factory import resolve

    return resolve(cfg.rollout.layout.actor_build)(cfg, ctx)


def vllm_actor_engine(cfg, ctx):
    """A single-process `vllm.LLM` sized for one actor's share of the step."""
    if cfg.rollout.vllm.max_num_seqs is None:  # the engine's default would size for the whole step
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
            "vllm": cfg.rollout.vllm.model_copy(update={"max_num_seqs": sequences_per_actor(cfg)})})})
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    return VLLMEngine.from_config(cfg, ctx)


def hf_actor_engine(cfg, ctx):
    """An hf copy of the checkpoint on the actor's GPU (Ray set its CUDA_VISIBLE_DEVICES), else on CPU."""
    import torch

    from grpo_cli.rollout.hf.generation_copy import hf_copy_engine

    device = "cuda" if cfg.distributed.device != "cpu" and torch.cuda.is_available() else "cpu"
    return hf_copy_engine(cfg, ctx, device=device)


def sequences_per_actor(cfg) -> int:
    """The most sequences one actor generates per step: a rank's `P / processes` prompts split over its
    `num_actors / processes` actors (the larger chunk), times G. vLLM's `max_num_seqs` default in an actor."""
    d, r = cfg.distributed, cfg.rollout.ray
    world = d.num_processes * d.num_machines
    prompts = math.ceil(cfg.train.prompts_per_step // world / max(1, r.num_actors // world))
    return prompts * cfg.train.generations_per_prompt


class RolloutActor:
    """The Ray actor body (made remote by `grpo_cli.rollout.ray.engine`). `threads` caps torch's intra-op
    threads to the cores Ray reserved for it."""

    def __init__(self, cfg_dump: dict, ctx_fields: dict, threads: int, wrap=None) -> None:
        import torch

        from grpo_cli.runtime.quiet import quiet_hf_stack

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # no INFO line per weight push in the trainer's log
        torch.set_num_threads(threads)
        quiet_hf_stack()
        self.engine = build_actor_engine(cfg_dump, ctx_fields, wrap)

    def ready(self) -> dict:
        """The process id, the GPUs Ray gave it (`CUDA_VISIBLE_DEVICES`) and its node's address, once the engine is
        built (the manager waits on it with a timeout)."""
        import ray

        return {"pid": os.getpid(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "node": ray.util.get_node_ip_address()}

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 rows: list[dict] | None = None, images: list[list] | None = None) -> RolloutBatch:
        """`rows`: the prompts' dataset rows, for an `agent.environment`'s `reset(**row)`; `images`: the prompts'
        images (a vision-language model; the engine's `generate(images=)`)."""
        if rows is not None:
            self.engine.bind_rows(rows)
        return self.engine.generate(prompt_ids, sampling, **({} if images is None else {"images": images}))

    def update_weights(self, parts: list, version: int) -> int:
        """Load `[(layout, buffer ref), ...]` (`flat_weights` buckets in the object store), fetching one bucket
        at a time, as `version`."""
        import ray

        from grpo_cli.rollout.flat_weights import unflatten

        def stream():
            for layout, ref in parts:
                yield from unflatten(layout, ray.get(ref))

        self.engine.update_weights(stream(), version)
        return self.engine.weight_version

    def score(self, sequences: list[list[int]], images: list[list] | None = None) -> list[list[float]]:
        return self.engine.score(sequences, **({} if images is None else {"images": images}))

    def read_weights(self, names: list[str]) -> dict:
        if self.engine.reads_weights:
            return self.engine.read_weights(names)
        from grpo_cli.models.weight_names import parameters_by_name

        params = parameters_by_name(self.engine.model)
        return {n: params[n].detach().cpu().clone() for n in names if n in params}


class WeightBoard:
    """A named async actor through which rank 0 hands one weight push to the other training ranks: rank 0 posts
    the push's `[(layout, ObjectRef), ...]` (sync number n), each other rank takes the n-th post and queues the
    load on its own actors. The refs travel nested in call arguments and return values, so Ray counts the board
    and every taker as borrowers (refs pickled out of band, e.g. through torch.distributed, would pin the buffers
    for good). The board drops a post once all `followers` took it; from then on the buffers live only as long
    as the loads queued with them, so the object store holds one copy of the weights per job and sync."""

    def __init__(self, followers: int) -> None:
        self.followers = followers
        self.seq, self.version, self.parts, self.left = 0, None, None, 0
        self._posted = asyncio.Condition()

    async def post(self, seq: int, version: int, parts: list) -> None:
        async with self._posted:
            self.seq, self.version, self.parts, self.left = seq, version, parts, self.followers
            self._posted.notify_all()

    async def take(self, seq: int) -> tuple[int, list]:
        """(version, parts) of post `seq`, once rank 0 has posted it."""
        async with self._posted:
            await self._posted.wait_for(lambda: self.seq >= seq)
            if self.seq != seq or self.parts is None:
                raise RuntimeError(f"weight board: sync {seq} asked for, but the board holds sync {self.seq} "
                                   f"({'taken by every rank' if self.parts is None else 'a later one'})")
            version, parts = self.version, self.parts
            self.left -= 1
            if self.left == 0:
                self.parts = None
            return version, parts

    async def held(self) -> int:
        """Buffers the board still holds (0 once every rank has taken the last post)."""
        return 0 if self.parts is None else len(self.parts)
