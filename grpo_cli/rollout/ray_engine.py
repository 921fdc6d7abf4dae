"""Async mode's rollout manager: rollout engine actors on a Ray placement group, fed without blocking.

`submit` splits a step's prompts over the actors and returns at once; `collect` waits for that step's batch.
`update_weights` puts the trainer's tensors in Ray's object store once and queues a load on every actor: it
returns as soon as the snapshot is taken, and each actor applies it after the generations queued before it.
Together with the trainer's pipeline (`grpo_cli.train.pipeline`) this runs generation for step k+1 while step
k trains. Each training process owns `rollout.ray.num_actors / processes` actors (its own placement group).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from grpo_cli.rollout.base import RolloutBatch, RolloutError, SamplingParams
from grpo_cli.rollout.factory import engine_dtype

if TYPE_CHECKING:
    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.factory import EngineContext

ACTOR_SEED_STRIDE = 7919
"""Actor i (numbered over all training processes) samples its share with seed + i · stride: actor 0 uses the
step's seed, as the sync engines do, and a job samples the same tokens whatever the number of processes."""


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RolloutError(
            "rollout.mode 'async' places rollout actors with Ray, which is not installed: pip install "
            "'grpo-cli[ray]' (or set rollout.mode=colocate)."
        ) from exc
    return ray


def split_evenly(items: list, parts: int) -> list[list]:
    """Consecutive chunks whose sizes differ by at most one (empty chunks when items < parts)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out


def merge_batches(parts: list[RolloutBatch]) -> RolloutBatch:
    """Concatenate actor batches in actor order (prompt order is kept: chunks were consecutive)."""
    versions = {p.weight_version for p in parts}
    if len(versions) != 1:
        raise RolloutError(f"rollout actors sampled one step with different weight versions {sorted(versions)}; "
                           "a weight push was lost. Restart the run from its last checkpoint.")
    logprobs = None if any(p.sampler_logprobs is None for p in parts) else [
        row for p in parts for row in p.sampler_logprobs
    ]
    return RolloutBatch(
        prompt_ids=[row for p in parts for row in p.prompt_ids],
        completion_ids=[row for p in parts for row in p.completion_ids],
        finish_reasons=[r for p in parts for r in p.finish_reasons],
        sampler_logprobs=logprobs,
        weight_version=versions.pop(),
        timings={"generate": max(p.timings.get("generate", 0.0) for p in parts)},
    )


AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _auth_env() -> dict[str, str]:
    """Ray's token-auth settings of this process (a local `ray.init()` turns token auth on and writes the token
    to ~/.ray/auth_token); the other ranks need them to join."""
    env = {k: os.environ[k] for k in AUTH_ENV if k in os.environ}
    default = os.path.expanduser("~/.ray/auth_token")
    if env.get("RAY_AUTH_MODE") == "token" and "RAY_AUTH_TOKEN" not in env and os.path.isfile(default):
        with open(default) as f:
            env["RAY_AUTH_TOKEN"] = f.read().strip()
    return env


def connect(cfg: GRPOConfig, ctx: EngineContext, *, broadcast=None) -> None:
    """Join (or start) the Ray cluster. Rank 0 starts a local one when `rollout.ray.address` is null and
    `broadcast(obj)` hands its address and auth settings to the other ranks (a `torch.distributed` object
    broadcast inside the training job)."""
    address = cfg.rollout.ray.address
    if address is None and ctx.rank != 0:
        address, auth = broadcast(None)
        os.environ.update(auth)  # before Ray is imported: it reads its auth mode once
    ray = import_ray()
    starts_cluster = address is None and ctx.rank == 0
    if not ray.is_initialized():
        kwargs = dict(include_dashboard=False, configure_logging=True, logging_level="ERROR", log_to_driver=True)
        if starts_cluster:
            ray.init(num_cpus=max(os.cpu_count() or 1, cfg.rollout.ray.num_actors * cfg.rollout.ray.cpus_per_actor),
                     **kwargs)
        else:
            ray.init(address=address, **kwargs)
    if starts_cluster and broadcast is not None:  # also when Ray was already up here: the other ranks wait for it
        broadcast((ray.get_runtime_context().gcs_address, _auth_env()))


class AsyncRolloutEngine:
    """This process's rollout actors. Implements the `RolloutEngine` protocol (`generate` = submit + collect)
    plus `submit`/`collect` for one-step-ahead pipelining."""

    shares_policy_weights = False

    def __init__(self, cfg: GRPOConfig, ctx: EngineContext, *, broadcast=None) -> None:
        connect(cfg, ctx, broadcast=broadcast)
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from grpo_cli.rollout.ray_actor import RolloutActor

        rc = cfg.rollout.ray
        count = rc.num_actors // ctx.world_size
        gpus = cfg.rollout.vllm.tensor_parallel_size if cfg.distributed.device == "cuda" else 0
        bundle = {"CPU": rc.cpus_per_actor, **({"GPU": gpus} if gpus else {})}
        self._ray = ray
        self.bucket_bytes = cfg.distributed.weight_sync_bucket_mb * 2**20
        self.weight_version = 0
        self.dtype = engine_dtype(cfg)  # the actors' dtype bounds the sync probe's tolerance (trainer masters are fp32)
        self._tickets: dict[object, list] = {}
        self._pushes: list = []
        self.first_index = ctx.rank * count
        self.pg = placement_group([dict(bundle)] * count, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=rc.start_timeout_s)
        except Exception as exc:
            raise RolloutError(
                f"Ray could not place {count} rollout actor(s) of {bundle} within {rc.start_timeout_s:g} s "
                f"(cluster resources: {ray.cluster_resources()}); lower rollout.ray.num_actors or "
                "rollout.ray.cpus_per_actor, or add nodes/GPUs."
            ) from exc
        remote = ray.remote(num_cpus=rc.cpus_per_actor, num_gpus=gpus)(RolloutActor)
        cfg_dump = cfg.model_dump(mode="json")
        self.actors = [
            remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i)).remote(
                cfg_dump, dataclasses.asdict(dataclasses.replace(ctx, rank=self.first_index + i, world_size=1)),
                rc.cpus_per_actor)
            for i in range(count)
        ]
        try:
            self.pids = ray.get([a.ready.remote() for a in self.actors], timeout=rc.start_timeout_s)
        except Exception as exc:
            self.close()
            raise RolloutError(f"a rollout actor failed to start its {cfg.rollout.engine} engine: {exc}. Check "
                               "model.name_or_path and the engine settings (the actor's log is above).") from exc

    @classmethod
    def from_config(cls, cfg: GRPOConfig, ctx: EngineContext, *, broadcast=None) -> AsyncRolloutEngine:
        return cls(cfg, ctx, broadcast=broadcast)

    # ---- generation ------------------------------------------------------------------------------------

    def submit(self, key, prompt_ids: list[list[int]], sampling: SamplingParams) -> None:
        """Queue the generation of `prompt_ids` under `key` (returns at once)."""
        refs = []
        for i, (actor, chunk) in enumerate(zip(self.actors, split_evenly(prompt_ids, len(self.actors)),
                                               strict=True)):
            if chunk:
                seed = None if sampling.seed is None else sampling.seed + (self.first_index + i) * ACTOR_SEED_STRIDE
                refs.append(actor.generate.remote(chunk, dataclasses.replace(sampling, seed=seed)))
        self._tickets[key] = refs

    def collect(self, key, timeout: float | None = None) -> RolloutBatch:
        """Wait for the batch submitted under `key`; a failed weight push or generation raises `RolloutError`
        (with `recovered = False`: the trainer saves what it has and stops) and the ticket stays, so a later
        `collect` of the same key fails the same way instead of losing track of it."""
        refs = self._tickets[key]
        try:
            self._check_pushes()
            parts = self._ray.get(refs, timeout=timeout)
        except self._ray.exceptions.RayError as exc:
            err = RolloutError(
                f"a rollout actor failed ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). The trainer "
                "stops after saving a checkpoint; resume with --set checkpoint.resume=auto (new actors are "
                "started and re-synced). If it keeps failing, check the actor's log above and its memory."
            )
            err.recovered = False
            raise err from exc
        del self._tickets[key]
        return merge_batches(parts)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        self.submit("_now", prompt_ids, sampling)
        return self.collect("_now")

    # ---- weights ---------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, object]], version: int) -> None:
        """Snapshot the tensors into the object store, one flat buffer (`flat_weights`) per bucket of at most
        `distributed.weight_sync_bucket_mb`, and queue their load on every actor (one call, so a layer's tensors
        may land in any bucket). The trainer holds one bucket at a time; the object store holds a copy of the
        full weights per training process until the actors have loaded them."""
        from grpo_cli.rollout.flat_weights import byte_buckets, flatten

        parts = [(layout, self._ray.put(buffer))
                 for layout, buffer in map(flatten, byte_buckets(named_tensors, self.bucket_bytes))]
        self._pushes += [a.update_weights.remote(parts, version) for a in self.actors]
        self.weight_version = version

    def _check_pushes(self) -> None:
        """Surface errors of weight pushes that have finished (without waiting for the others)."""
        if not self._pushes:
            return
        done, self._pushes = self._ray.wait(self._pushes, num_returns=len(self._pushes), timeout=0)
        self._ray.get(done)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self._ray.get(self.actors[0].score.remote(sequences))

    def read_weights(self, names: list[str]) -> dict:
        return self._ray.get(self.actors[0].read_weights.remote(names))

    def sleep(self, level: int) -> None:
        """Actors keep their memory: they run on their own devices/cores."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        ray = self._ray
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
