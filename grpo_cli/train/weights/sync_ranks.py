"""Which training ranks talk to the rollout engine, and how the other ranks learn what happened.

An engine that holds one copy of the weights for the whole job (a rollout server, SGLang servers, the async
engine's object store) declares `push_from_main_only = True`. Every rank still streams the tensors of a weight sync
(the fsdp2/ZeRO-3 gathers behind the stream are collective), but only rank 0 hands them to the engine: one upload,
one /dev/shm file, one NCCL group (rank 0 ↔ server), one SGLang weight-update session per sync. The ranks then
agree (`gather_outcomes`, one object all-gather): each returns rank 0's result, and a failure on any rank raises
on every rank (the failing rank its own exception, the others an equivalent), so no rank is left waiting in a
collective its peers never reach."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_cli.runtime.dist import DistInfo, all_gather_object
from grpo_cli.rollout.base import RolloutError


def pushes_from_main(engine, info: DistInfo) -> bool:
    """Whether rank 0 alone hands the weights to `engine` (a job of several ranks, an engine that asks for it)."""
    return info.world_size > 1 and engine.push_from_main_only


def attempt(fn: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """(fn(), None), or (None, the exception it raised): the caller decides when the ranks learn of it."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - handed to gather_outcomes, which raises it on every rank
        return None, exc


def describe(error: Exception) -> dict:
    """What the other ranks need to raise an equivalent of `error` (exceptions with keyword-only constructor
    arguments, such as RolloutServerDown, do not survive pickling)."""
    return {"message": str(error), "type": type(error).__name__, "rollout": isinstance(error, RolloutError),
            "recovered": getattr(error, "recovered", None), "url": getattr(error, "url", None)}


def rebuild(failure: dict, rank: int) -> RolloutError:
    """The equivalent of rank `rank`'s failure on this rank. A rollout server that went away stays a
    RolloutServerDown with the same `recovered`, so every rank takes the same path (e.g. all save a checkpoint)."""
    where = f"rank {rank}: "
    if failure["recovered"] is not None:
        from grpo_cli.rollout.transport.http_client import RolloutServerDown

        return RolloutServerDown(where + failure["message"], url=failure["url"], recovered=failure["recovered"])
    if failure["rollout"]:
        return RolloutError(where + failure["message"])
    return RolloutError(f"{where}{failure['type']}: {failure['message']} (see that rank's log for the traceback)")


def gather_outcomes(result: Any, error: Exception | None, info: DistInfo) -> list:
    """Collective: every rank's `result`, in rank order; raises on every rank when any rank passed an `error`
    (its own on a failing rank, else an equivalent of the lowest failing rank's). Single process: [result] or
    the error."""
    if info.world_size == 1:
        if error is not None:
            raise error
        return [result]
    outcomes = all_gather_object((result, None if error is None else describe(error)), info)
    if error is not None:
        raise error
    failed = [(rank, failure) for rank, (_, failure) in enumerate(outcomes) if failure is not None]
    if failed:
        raise rebuild(failed[0][1], failed[0][0])
    return [r for r, _ in outcomes]


def agree(result: Any, error: Exception | None, info: DistInfo) -> Any:
    """`gather_outcomes`, then rank 0's result on every rank (same metrics keys everywhere, as `mean_metrics`
    needs)."""
    return gather_outcomes(result, error, info)[0]


def follow(engine, version: int) -> None:
    """A rank that did not push: `engine.follow_update(version)` (the async engine loads what rank 0 posted on its
    own actors; by default the engine records the version the servers now hold: each rank's client checks the
    version in every answer against its own)."""
    engine.follow_update(version)


def generate_with_resync(engine, sync, info: DistInfo, generate: Callable[[], Any]) -> Any:
    """`generate()`; when a rollout server died and came back without our weights (an error with `recovered`
    true), push the weights again (`sync(engine.weight_version)`) and retry once. With an engine that takes pushes
    from rank 0 only, the ranks agree first (one all-gather per call: a rank's server may have restarted while the
    others' calls went elsewhere), all take part in the re-sync, and an error on any rank fails every rank."""
    collective = sync is not None and pushes_from_main(engine, info)
    rollout, error = attempt(generate)
    lost = isinstance(error, RolloutError) and getattr(error, "recovered", False) is True
    if collective:
        resync = any(gather_outcomes(lost, None if lost else error, info))
    elif error is not None and not lost:
        raise error
    else:
        resync = lost
    if not resync:
        return rollout
    if sync is not None:
        sync(engine.weight_version)
    error = None
    if lost:
        rollout, error = attempt(generate)
    if collective:
        gather_outcomes(None, error, info)
    elif error is not None:
        raise error
    return rollout
