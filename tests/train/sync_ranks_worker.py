"""Worker for test_sync_ranks: one rank of a 2-process gloo job running `sync_weights` and `generate_with_resync`
against fake engines that count what each rank asks of them; writes `OUT/rank{r}.json`.

Run as `RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python sync_ranks_worker.py CKPT OUT`."""

from __future__ import annotations

import copy
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from grpo_cli.runtime.dist import DistInfo
from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.hf.engine import HFEngine
from grpo_cli.rollout.transport.http_client import RolloutServerDown
from grpo_cli.rollout.vllm_serve.stream import DeferredChecks
from grpo_cli.train.weights.sync_ranks import generate_with_resync
from grpo_cli.train.weights.weight_sync import settle_deferred, sync_weights

PROBE = [[3, 4, 6, 7, 8, 5]]


class Counting(HFEngine):
    """A separate copy of the policy as the engine; counts the calls this rank makes to it."""

    push_from_main_only = True

    def __init__(self, model, fail_push: Exception | None = None, lossy: bool = False) -> None:
        super().__init__(copy.deepcopy(model).eval(), eos_token_ids=[1], pad_token_id=0, shares_policy_weights=False)
        self.calls = {"update_weights": 0, "score": 0, "read_weights": 0}
        self.fail_push, self.lossy = fail_push, lossy

    def update_weights(self, named_tensors, version):
        self.calls["update_weights"] += 1
        if self.fail_push is not None:
            next(iter(named_tensors))  # fails after the stream started: the gathers must still complete
            raise self.fail_push
        if self.lossy:
            list(named_tensors)
            self.weight_version = version
            return
        super().update_weights(named_tensors, version)

    def score(self, sequences):
        self.calls["score"] += 1
        return super().score(sequences)

    def read_weights(self, names):
        self.calls["read_weights"] += 1
        params = dict(self.model.named_parameters())
        return {n: params[n].detach().clone() for n in names if n in params}


class Following(Counting):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.followed: list[int] = []

    def follow_update(self, version: int) -> None:
        self.followed.append(version)
        self.weight_version = version


class Deferring(Counting):
    """Stream mode's `vllm serve` client's way: the probe runs on a background thread until settled (no read-back,
    so a lossy push shows in the probe alone)."""

    reads_weights = False

    def __init__(self, model, lossy: bool = False) -> None:
        super().__init__(model, lossy=lossy)
        self.deferred = DeferredChecks()

    def probe_when_awake(self, check) -> bool:
        return self.deferred.defer(check)

    def settle_checks(self) -> dict:
        return self.deferred.settle()


def failure(fn) -> dict | None:
    try:
        fn()
    except RolloutError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "recovered": getattr(exc, "recovered", None)}
    return None


def main(ckpt: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    info = DistInfo(dist.get_rank(), dist.get_world_size(), dist.get_rank())
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # trained: differs from the engines' starting weights
    forwards = []
    model.register_forward_hook(lambda m, *_: forwards.append(1) if m is model else None)  # not the engines' copies
    res: dict = {}

    engine = Counting(model)
    metrics = sync_weights(engine, model, version=3, bucket_mb=1, verify=True, probe=PROBE, info=info)
    res["plain"] = {"calls": engine.calls, "version": engine.weight_version, "metrics": metrics,
                    "forwards": len(forwards)}

    following = Following(model)
    sync_weights(following, model, version=4, bucket_mb=1, verify=False, probe=None, info=info)
    res["follow"] = {"calls": following.calls, "followed": following.followed, "version": following.weight_version}

    down = RolloutServerDown("rollout server http://x stopped answering", url="http://x", recovered=False)
    broken = Counting(model, fail_push=down)
    res["push_fails"] = failure(lambda: sync_weights(broken, model, version=5, bucket_mb=1, verify=True,
                                                     probe=PROBE, info=info))

    lossy = Counting(model, lossy=True)
    with torch.no_grad():
        for p in lossy.model.parameters():
            p.add_(0.05)  # stale weights the lossy push leaves in place
    res["verify_fails"] = failure(lambda: sync_weights(lossy, model, version=6, bucket_mb=1, verify=True,
                                                       probe=PROBE, info=info))

    res["resync"] = resync_case(Counting(model), info)
    res["deferred"] = deferred_case(model, info)
    (out / f"rank{info.rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def deferred_case(model, info: DistInfo) -> dict:
    """Probes deferred to rank 0's background thread: each sync returns the last one's figures; a lossy push
    passes its sync and fails when settled, on every rank."""
    engine = Deferring(model)
    first = sync_weights(engine, model, version=8, bucket_mb=1, verify=True, probe=PROBE, info=info)
    second = sync_weights(engine, model, version=9, bucket_mb=1, verify=True, probe=PROBE, info=info)
    settled = settle_deferred(engine, info)
    lossy, again = stale(Deferring(model, lossy=True)), stale(Deferring(model, lossy=True))
    passed = sync_weights(lossy, model, version=10, bucket_mb=1, verify=True, probe=PROBE, info=info)
    sync_weights(again, model, version=11, bucket_mb=1, verify=True, probe=PROBE, info=info)
    return {"first": first, "second": second, "settled": settled, "calls": engine.calls, "lossy_sync": passed,
            "lossy_settle": failure(lambda: settle_deferred(lossy, info)), "after": settle_deferred(lossy, info),
            "next_sync": failure(lambda: sync_weights(again, model, version=12, bucket_mb=1, verify=True,
                                                      probe=PROBE, info=info))}


def stale(engine: Deferring) -> Deferring:
    """`engine` with weights the trainer never had, which its lossy pushes leave in place."""
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(0.05)
    return engine


def resync_case(engine, info: DistInfo) -> dict:
    """Rank 1's server came back without our weights; rank 0's answered: both ranks re-sync, rank 1 retries."""
    engine.weight_version = 7
    syncs, generated = [], []

    def generate():
        generated.append(1)
        if info.rank == 1 and len(generated) == 1:
            raise RolloutServerDown("came back", url="http://x", recovered=True)
        return f"rollout of rank {info.rank}"

    rollout = generate_with_resync(engine, syncs.append, info, generate)
    return {"rollout": rollout, "syncs": syncs, "generated": len(generated)}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], Path(sys.argv[2]))
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
