"""Async mode's rollout manager: rollout engine actors on a Ray placement group, fed without blocking.

`submit` splits a step's prompts over the actors and returns at once; `collect` waits for that step's batch.
`update_weights` (rank 0) puts the trainer's tensors in Ray's object store once per job and queues a load on its
actors; the other ranks take the same object refs from a small named actor (`ray_actor.WeightBoard`) in
`follow_update` and queue the load on theirs. Each call returns as soon as its load is queued, and each actor
applies it after the generations queued before it. Together with the trainer's pipeline
(`grpo_cli.train.pipeline`) this runs generation for step k+1 while step k trains. Each training process owns
`rollout.ray.num_actors / processes` actors (its own placement group), one GPU each on CUDA; the local cluster
rank 0 starts sees only the machine's rollout GPUs (`rollout_gpu_ids`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from grpo_cli.rollout.base import RolloutBatch, RolloutEngine, RolloutError, SamplingParams, engine_dtype
from grpo_cli.rollout.ray.batches import merge_batches, split_evenly

if TYPE_CHECKING:
    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.base import EngineContext

BOARD_NAMESPACE = "grpo_cli"
"""Ray namespace of the weight board (named actors are looked up by namespace + name)."""


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RolloutError(
            "rollout.mode 'async' places rollout actors with Ray, which is not installed: pip install "
            "'grpo-cli[ray]' (or set rollout.mode=colocate)."
        ) from exc
    return ray


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


def trainer_gpu_ids(env=None, device_count: int | None = None) -> list[str]:
    """This machine's GPUs in the order the training processes number them (local rank i trains on entry i):
    the entries of `CUDA_VISIBLE_DEVICES` (indices or UUIDs) when it is set, else 0 .. device_count − 1."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()]
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count()
    return [str(i) for i in range(device_count)]


def rollout_gpu_ids(visible: list[str], *, num_processes: int, rollout_gpus: int) -> list[str]:
    """The GPUs of this machine the rollout actors may use: the `rollout_gpus` entries after the `num_processes`
    the training processes take (`visible[:num_processes]`, one per local rank)."""
    if rollout_gpus == 0:
        raise RolloutError(
            "async mode on CUDA gives each rollout actor a GPU of its own, but distributed.rollout_gpus is 0; set "
            "distributed.rollout_gpus to the GPUs per machine left for rollouts (e.g. rollout.ray.num_actors), or "
            "distributed.device=cpu."
        )
    need = num_processes + rollout_gpus
    if len(visible) < need:
        raise RolloutError(
            f"async mode trains on {num_processes} GPU(s) (distributed.num_processes) and generates on "
            f"{rollout_gpus} more (distributed.rollout_gpus) = {need}, but this machine shows {len(visible)} "
            f"({visible}); lower one of them, or expose more GPUs with CUDA_VISIBLE_DEVICES."
        )
    return visible[num_processes:need]


def local_cluster(cfg: GRPOConfig, gpu_ids: list[str]) -> tuple[dict, dict[str, str]]:
    """(`ray.init` arguments, environment of the processes it starts) for the local cluster rank 0 starts: every
    core, and only the GPUs `gpu_ids`. Ray counts a node's GPUs as `num_gpus` slots 0..n−1 and turns the slot a
    worker is given into a device id through the `CUDA_VISIBLE_DEVICES` that worker inherited from the raylet
    (ray/_private/worker.py, `get_accelerator_ids_for_accelerator_resource`), and `ray.init` starts the raylet
    with a copy of `os.environ` (ray/_private/services.py): so the raylet must see `CUDA_VISIBLE_DEVICES=gpu_ids`,
    or Ray hands out GPUs 0.. (the trainer's) to the actors. Without GPUs it is empty: actors see no device."""
    rc = cfg.rollout.ray
    options = {"num_cpus": max(os.cpu_count() or 1, rc.num_actors * rc.cpus_per_actor), "num_gpus": len(gpu_ids)}
    return options, {"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids)}


@contextlib.contextmanager
def _environ(updates: dict[str, str]):
    """`os.environ` with `updates` while the block runs (what the processes started in it inherit), restored
    after: this process's own CUDA context was created before and does not read it again."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def uses_cuda(cfg: GRPOConfig) -> bool:
    """Whether this training process runs on CUDA (`distributed.device`, `auto` resolved as everywhere else);
    then each rollout actor takes one GPU of `distributed.rollout_gpus`."""
    from grpo_cli.runtime.accel import is_cuda, local_rank_from_env, resolve_device

    return is_cuda(resolve_device(cfg.distributed.device, local_rank_from_env()))


def connect(cfg: GRPOConfig, ctx: EngineContext, *, broadcast=None) -> None:
    """Join (or start) the Ray cluster. Rank 0 starts a local one when `rollout.ray.address` is null (holding the
    rollout GPUs of its machine only, `local_cluster`) and `broadcast(obj)` hands its address and auth settings
    to the other ranks (a `torch.distributed` object broadcast inside the training job)."""
    address = cfg.rollout.ray.address
    if address is None and ctx.rank != 0:
        address, auth = broadcast(None)
        os.environ.update(auth)  # before Ray is imported: it reads its auth mode once
    ray = import_ray()
    starts_cluster = address is None and ctx.rank == 0
    if not ray.is_initialized():
        kwargs = dict(include_dashboard=False, configure_logging=True, logging_level="ERROR", log_to_driver=True)
        if starts_cluster:
            d = cfg.distributed
            gpus = rollout_gpu_ids(trainer_gpu_ids(), num_processes=d.num_processes,
                                   rollout_gpus=d.rollout_gpus) if uses_cuda(cfg) else []
            options, env = local_cluster(cfg, gpus)
            with _environ(env):
                ray.init(**options, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    if starts_cluster and broadcast is not None:  # also when Ray was already up here: the other ranks wait for it
        broadcast((ray.get_runtime_context().gcs_address, _auth_env()))


class AsyncRolloutEngine(RolloutEngine):
    """This process's rollout actors. Implements the `RolloutEngine` protocol (`generate` = submit + collect)
    plus `submit`/`collect` for one-step-ahead pipelining."""

    shares_policy_weights = False
    push_from_main_only = True
    accepts_images = True
    """Each prompt's images go to the actor that generates it (Ray pickles the PIL images): the hf actor engine
    generates with them; the vllm rows of async mode refuse a VLM in the config rules."""
    """`sync_weights` streams the weights into `update_weights` on rank 0 only (one object-store copy per job);
    every other rank takes part in the gathers, drops what it gathered and calls `follow_update`."""

    def __init__(self, cfg: GRPOConfig, ctx: EngineContext, *, broadcast=None, wrap=None) -> None:
        connect(cfg, ctx, broadcast=broadcast)
        self._ray = import_ray()
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.bucket_bytes = cfg.distributed.weight_sync_bucket_mb * 2**20
        self.weight_version = 0
        self.dtype = engine_dtype(cfg)  # the actors' dtype bounds the sync probe's tolerance (trainer masters are fp32)
        self.follow_timeout_s = cfg.distributed.timeout_minutes * 60.0
        self._tickets: dict[object, list] = {}
        self.sends_rows = cfg.agent is not None and cfg.agent.environment is not None
        self._rows: list[dict] | None = None
        self._pushes: list = []
        self._syncs = 0  # weight syncs so far: rank 0's n-th post is every other rank's n-th take
        self.actors, self.pg, self.board = [], None, None
        self.board = self._open_board(broadcast)
        self._place_actors(cfg, ctx, wrap)

    def _open_board(self, broadcast):
        """The job's weight board (`ray_actor.WeightBoard`): rank 0 creates it as a named actor that reserves no
        core (it fits beside full placement groups) and hands its name to the other ranks. None with one process."""
        if self.world_size == 1:
            return None
        if broadcast is None:
            raise RolloutError("async mode with several training processes needs `broadcast` to share the weight "
                               "board's name between them.")
        from grpo_cli.rollout.ray.actor import WeightBoard

        ray = self._ray
        if self.rank != 0:
            return ray.get_actor(broadcast(None), namespace=BOARD_NAMESPACE)
        name = f"weight-board-{uuid.uuid4().hex[:12]}"
        board = ray.remote(num_cpus=0)(WeightBoard).options(name=name, namespace=BOARD_NAMESPACE).remote(
            self.world_size - 1)
        ray.get(board.held.remote())  # registered before the other ranks look it up
        broadcast(name)
        return board

    def _place_actors(self, cfg: GRPOConfig, ctx: EngineContext, wrap) -> None:
        """This rank's `num_actors / processes` actors on its own placement group: `cpus_per_actor` cores each,
        plus one GPU on CUDA (tensor parallelism inside an actor is refused by the config rules)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from grpo_cli.rollout.ray.actor import RolloutActor

        ray, rc = self._ray, cfg.rollout.ray
        count = rc.num_actors // ctx.world_size
        gpus = 1 if uses_cuda(cfg) else 0
        bundle = {"CPU": rc.cpus_per_actor, **({"GPU": gpus} if gpus else {})}
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
                rc.cpus_per_actor, wrap)
            for i in range(count)
        ]
        try:
            ready = ray.get([a.ready.remote() for a in self.actors], timeout=rc.start_timeout_s)
        except Exception as exc:
            self.close()
            raise RolloutError(f"a rollout actor failed to start its {cfg.rollout.engine} engine: {exc}. Check "
                               "model.name_or_path and the engine settings (the actor's log is above).") from exc
        self.pids = [r["pid"] for r in ready]
        self.gpu_ids = [r["gpus"] for r in ready]  # each actor's CUDA_VISIBLE_DEVICES as Ray set it ('' or None: none)
        self.nodes = [r["node"] for r in ready]  # the address of each actor's Ray node

    @classmethod
    def from_config(cls, cfg: GRPOConfig, ctx: EngineContext, *, broadcast=None, wrap=None) -> AsyncRolloutEngine:
        return cls(cfg, ctx, broadcast=broadcast, wrap=wrap)

    # ---- generation ------------------------------------------------------------------------------------

    def submit(self, key, prompt_ids: list[list[int]], sampling: SamplingParams,
               rows: list[dict] | None = None, images: list[list] | None = None) -> None:
        """Queue the generation of `prompt_ids` under `key` (returns at once). `rows`: the prompts' dataset rows,
        sent along when the actors reset an `agent.environment` with them; `images`: each prompt's images (a
        vision-language model), sent with that prompt to the actor that generates it."""
        refs = []
        count = len(self.actors)
        row_chunks = split_evenly(rows, count) if rows is not None and self.sends_rows else [None] * count
        image_chunks = split_evenly(images, count) if images is not None else [None] * count
        for i, (actor, chunk, chunk_rows, chunk_images) in enumerate(zip(
                self.actors, split_evenly(prompt_ids, count), row_chunks, image_chunks, strict=True)):
            if chunk:
                # The step's seed as it is: actor i's engine keys its seeds by its rank, its number over all
                # training processes (`rollout/seeds.py`), as a training process's engine does.
                refs.append(actor.generate.remote(chunk, sampling, chunk_rows, chunk_images))
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

    def bind_prompts(self, prompts) -> None:
        """The prompts of the next `generate` (an extra dynamic-sampling round, an evaluation): their rows go to
        the actors with it (multi-turn rollouts with an `agent.environment`)."""
        self._rows = [dict(p.columns) for p in prompts]

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, images=None) -> RolloutBatch:
        rows, self._rows = self._rows, None
        self.submit("_now", prompt_ids, sampling, rows, images)
        return self.collect("_now")

    # ---- weights ---------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, object]], version: int) -> None:
        """Rank 0: snapshot the tensors into the object store, one flat buffer (`flat_weights`) per bucket of at
        most `distributed.weight_sync_bucket_mb`, post their refs on the weight board for the other ranks, and
        queue their load on this rank's actors (one call, so a layer's tensors may land in any bucket). The trainer
        holds one bucket at a time; the object store holds one copy of the weights per job until every actor has
        loaded it. On another rank (a caller streaming on every rank) the stream is drained and rank 0 followed."""
        if self.rank != 0:
            for _ in named_tensors:  # its gathers are collective: take part, keep nothing
                pass
            self.follow_update(version)
            return
        from grpo_cli.rollout.flat_weights import byte_buckets, flatten

        parts = [(layout, self._ray.put(buffer))
                 for layout, buffer in map(flatten, byte_buckets(named_tensors, self.bucket_bytes))]
        self._syncs += 1
        if self.board is not None:  # the refs go nested in the arguments: Ray counts the board as a borrower
            self._pushes.append(self.board.post.remote(self._syncs, version, parts))
        self._queue_load(parts, version)

    def follow_update(self, version: int) -> None:
        """Ranks other than 0, after rank 0's `update_weights` of the same sync: take the buffers rank 0 posted
        from the weight board (waiting for the post up to `distributed.timeout_minutes`) and queue their load on
        this rank's actors, behind the generations this rank queued before (Ray keeps one caller's order)."""
        self._syncs += 1
        try:
            posted, parts = self._ray.get(self.board.take.remote(self._syncs), timeout=self.follow_timeout_s)
        except self._ray.exceptions.RayError as exc:
            raise RolloutError(
                f"rank {self.rank} did not receive rank 0's weights for version {version} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:300]}); rank 0 may have failed during the sync (see its log)."
            ) from exc
        if posted != version:
            raise RolloutError(f"rank 0 pushed weight version {posted} while rank {self.rank} syncs version "
                               f"{version}: the ranks' weight syncs are out of step.")
        self._queue_load(parts, version)

    def _queue_load(self, parts: list, version: int) -> None:
        self._pushes += [a.update_weights.remote(parts, version) for a in self.actors]
        self.weight_version = version

    def _check_pushes(self) -> None:
        """Surface errors of weight pushes that have finished (without waiting for the others)."""
        if not self._pushes:
            return
        done, self._pushes = self._ray.wait(self._pushes, num_returns=len(self._pushes), timeout=0)
        self._ray.get(done)

    def score(self, sequences: list[list[int]], images=None) -> list[list[float]]:
        return self._ray.get(self.actors[0].score.remote(sequences, images))

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
        if getattr(self, "board", None) is not None and self.rank == 0:
            ray.kill(self.board)
        self.board = None
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
