"""Weight pushes to stock `vllm serve` servers through vLLM's RL API (dev mode), one round per sync on every server:

    POST /start_weight_update → POST /update_weights {"update_info": ...} (once per bucket) →
    POST /finish_weight_update {"weight_version": "V"} → POST /reset_prefix_cache (its body read: `success`)

`ShmPush` (backend `grpo_shm`, grpo-cli's vLLM plugin engine): the frames are written once to an owner-only /dev/shm
file and one update names it. `NcclPush` (vLLM's own `nccl` backend, CUDA on both sides): vLLM's trainer endpoint
joins every server's workers in one NCCL group (server i's workers at rank offset 1 + the workers before it, each
server's count read from `GET /get_world_size`: TP·PP·DP), then each bucket of ≤ `weight_chunk_mb` is announced
(`names`, `dtype_names`, `shapes`) and broadcast from rank 0, unpacked. Both are `WeightTransport`s of the client
`vllm-serve` in the transport registry (`base.py`); `Sent.replies` is empty (the client reads the version back from
`/weight_info` and checks checksums, `rollout/vllm_serve/client.py`).

A round that did not finish leaves the server unusable: `/start_weight_update` moves every layer to the meta device
and only `/finish_weight_update` restores it, and vLLM 0.32 drops its "round active" flag when an update fails
without restoring anything (a generate then kills its engine). So the first round of a transport, and the one after
a failed round, first closes whatever is open (`RLRoutes.close_open_round`), and the round after it sends every
tensor: the client generates nothing before such a full round has finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.transport.base import Link, NamedTensors, WeightTransport

if TYPE_CHECKING:
    import torch

    from grpo_cli.rollout.transport.shm import ShmFile

NO_ROUND_OPEN = "without a matching start_weight_update"
"""vLLM's answer (500) to `/finish_weight_update` when no round is open (`gpu_worker.finish_weight_update`)."""
FRESH_CONNECTION = {"Connection": "close"}
"""On every RL call: vLLM answers a failed one with 500 and its server then drops the keep-alive connection, so the
next call on a pooled connection would fail with "connection reset" (seen on vLLM 0.32)."""
RESET_TRIES = 5
RESET_BACKOFF_S = 0.2


class RLRoutes:
    """vLLM's RL control plane on every server of `link`, called concurrently (on the link's pool)."""

    def __init__(self, link: Link) -> None:
        self.http, self.urls, self.pool = link.http, link.urls, link.pool
        self.unsure = True
        """Whether a round may be open on a server (none finished by this transport yet, or the last one failed)."""
        self.reset_prefix_cache = True
        """Whether a round ends with `/reset_prefix_cache`. A streaming client (`vllm_serve/stream.py`) turns it off:
        its paused requests hold KV blocks (the reset cannot succeed) and each of its requests has its own cache
        salt, so none reuses another's prefix KV."""

    def post_all(self, path: str, bodies: list[dict | None] | dict | None = None) -> list[dict]:
        """POST `path` to every server at once (one body each, or the same body), not retried: an update step
        repeated would fail ("already active") or load a bucket twice."""
        per_url = bodies if isinstance(bodies, list) else [bodies] * len(self.urls)
        futures = [self.pool.submit(self.http.call, url, "POST", path, idempotent=False, json=body,
                                    headers=FRESH_CONNECTION) for url, body in zip(self.urls, per_url, strict=True)]
        return [f.result().json() for f in futures]

    def close_open_round(self) -> list[bool]:
        """`/finish_weight_update` without a version on every server: a round left open (by a trainer that died
        between start and finish) is closed, and vLLM puts back the weights it held before it. Where none was open
        (vLLM's "without a matching start" answer, also after an update that failed: vLLM then drops its flag but
        keeps the layers it had begun loading), an empty round (start, finish) clears what a failed update left
        buffered, so the next round loads every layer afresh. Per server, whether a round was open. The model is
        not read: the round after this one must send every tensor."""
        def finish(url: str) -> None:
            self.http.call(url, "POST", "/finish_weight_update", idempotent=False, json={"weight_version": None},
                           headers=FRESH_CONNECTION)

        def close(url: str) -> bool:
            try:
                finish(url)
            except RolloutError as exc:
                if NO_ROUND_OPEN not in str(exc):
                    raise
                self.http.call(url, "POST", "/start_weight_update", idempotent=False, headers=FRESH_CONNECTION)
                finish(url)
                return False
            return True

        return [f.result() for f in [self.pool.submit(close, url) for url in self.urls]]

    def round(self, send: Callable[[], None], version: int) -> None:
        """start → `send()` (the update_weights calls) → finish with `version` → reset the prefix cache (its KV was
        computed with the old weights). Closes an open round first while `unsure`. A failed `send` still finishes
        the round (without a version) where vLLM kept it open, and leaves the transport `unsure`; the error is
        raised."""
        if self.unsure:
            self.close_open_round()
        self.unsure = True
        self.post_all("/start_weight_update")
        try:
            send()
        except BaseException:
            try:
                self.close_open_round()
            except Exception:  # noqa: BLE001 - the first error is the one to report; the next round closes it
                pass
            raise
        self.post_all("/finish_weight_update", {"weight_version": str(version)})
        self.unsure = False
        if self.reset_prefix_cache:
            reset_prefix_caches(self.http, self.urls)


def reset_prefix_caches(http, urls: list[str], *, tries: int = RESET_TRIES, backoff_s: float = RESET_BACKOFF_S) -> None:
    """`/reset_prefix_cache` on every server, read: vLLM answers 200 `{"success": false}` while KV blocks are still
    held (requests running), and then keeps the cached prefixes of the old weights. Retried `tries` times with a
    growing pause; still refused, RolloutError (the step stops rather than sample from stale KV)."""
    for url in urls:
        for attempt in range(tries):
            if http.call(url, "POST", "/reset_prefix_cache").json().get("success") is True:
                break
            if attempt + 1 < tries:
                time.sleep(backoff_s * 2**attempt)
        else:
            raise RolloutError(
                f"vllm serve at {url} refused to reset its prefix cache {tries} times (`{{\"success\": false}}`: KV "
                "blocks are held by running requests). Its cached prefixes hold the old weights' KV; is another "
                "client sending requests to it? Give the trainer its own server.")


class ShmPush(WeightTransport):
    """Same host: one /dev/shm file (kept and overwritten by each sync), loaded by every server's `grpo_shm`
    engine, which checks each frame's checksum, version and the end frame's counts."""

    name = "shm"
    stages_first = True

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.routes = RLRoutes(link)
        self.file: ShmFile | None = None

    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        from grpo_cli.rollout.transport.codec import write_stream
        from grpo_cli.rollout.transport.shm import ShmFile

        if self.file is None:
            self.file = ShmFile.create()
        out = self.file.rewind()
        size = write_stream(out, named_tensors, chunk_bytes=chunk_bytes, version=version)
        out.truncate(size)
        info = {"name": self.file.path.name, "bytes": size, "version": version}
        self._loading()  # written while the servers generate: stream mode pauses them only for the load
        self.routes.round(lambda: self.routes.post_all("/update_weights", {"update_info": info}), version)
        return []

    def close(self) -> None:
        if self.file is not None:
            self.file.remove()
            self.file = None


def bucket_update_info(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    """vLLM's `NCCLWeightTransferUpdateInfo` of one bucket, as JSON."""
    return {"names": [n for n, _ in bucket], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def nccl_init_infos(host: str, port: int, workers: list[int]) -> list[dict]:
    """vLLM's `NCCLWeightTransferInitInfo` for each server (`workers[i]`: its TP·PP·DP workers, `/get_world_size`):
    one group of 1 + Σ workers ranks, the trainer at 0, server i's workers from 1 + Σ workers[:i]; unpacked
    broadcasts. vLLM's worker joins at `rank_offset + dp_index·TP·PP + rank` (`worker_rank`)."""
    world, offsets, offset = 1 + sum(workers), [], 1
    for w in workers:
        offsets.append(offset)
        offset += w
    return [{"master_address": host, "master_port": port, "rank_offset": o, "world_size": world, "packed": False}
            for o in offsets]


def worker_rank(rank_offset: int, *, dp_index: int, tp_pp: int, rank: int) -> int:
    """A vLLM worker's rank in the trainer's group, as vLLM 0.32 computes it (`nccl_common.worker_init_process_group`:
    `data_parallel_index × world_size (TP·PP) + rank`, plus the server's offset)."""
    return rank_offset + dp_index * tp_pp + rank


class NcclPush(WeightTransport):
    """CUDA: vLLM's NCCL engine on the servers, vLLM's trainer endpoint here (needs `vllm` importable in the
    trainer). `world_size(url)`: the workers of that server (TP·PP·DP, read when the group is joined, at the first
    sync), whose answers are awaited for the link's request timeout. A failed update leaves the group unusable: it
    is closed and the next sync joins again."""

    name = "nccl"
    takes = ("world_size",)

    def __init__(self, link: Link, *, world_size: Callable[[str], int]) -> None:
        super().__init__(link)
        self.routes, self.world_size = RLRoutes(link), world_size
        self.comm = None
        self.device = None

    @property
    def timeout_s(self) -> float:
        return self.link.http.policy.request_timeout_s

    def _join(self) -> None:
        import torch

        from grpo_cli.rollout.transport.nccl import advertised_host, free_port, nccl_available

        ok, why = nccl_available()
        if not ok:
            raise RolloutError(f"rollout.server.weight_transport=nccl needs CUDA and NCCL on the trainer: {why}; "
                               "with `vllm serve` on this host use weight_transport=shm")
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        except ImportError as exc:
            raise RolloutError(f"weight_transport=nccl to `vllm serve` uses vLLM's NCCL endpoint, and vllm could not "
                               f"be imported in the trainer ({exc}): pip install vllm, or use weight_transport=shm"
                               ) from exc
        host, port = advertised_host(self.routes.urls[0]), free_port()
        infos = nccl_init_infos(host, port, [self.world_size(url) for url in self.routes.urls])
        futures = [self.routes.pool.submit(self.routes.http.call, url, "POST", "/init_weight_transfer_engine",
                                           idempotent=False, json={"init_info": info})
                   for url, info in zip(self.routes.urls, infos, strict=True)]
        self.comm = trainer_init(infos[0], rank=0)
        for f in futures:
            f.result(timeout=self.timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device())

    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        from grpo_cli.rollout.transport.codec import size_buckets

        if self.comm is None:
            self._join()

        def each_bucket() -> None:
            for bucket, _ in size_buckets(named_tensors, chunk_bytes=chunk_bytes, prepare=self._on_device):
                self._broadcast(bucket)
                bucket.clear()

        try:
            self.routes.round(each_bucket, version)
        except BaseException:
            self.close()
            raise
        return []

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.device).contiguous()

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Announce the bucket to every server (their workers enter the matching broadcasts), broadcast it, and wait
        for every server's answer before the stream: vLLM's communicator has no watchdog, so a server that stops
        answering mid-bucket left `synchronize` waiting forever. The answer wait is bounded by the HTTP path's worst
        case (`nccl.answer_wait_s`); a missing answer raises RolloutServerDown and `_send` aborts the group."""
        import concurrent.futures

        import torch

        from grpo_cli.rollout.transport.http_client import RolloutServerDown
        from grpo_cli.rollout.transport.nccl import answer_wait_s

        if not bucket:
            return
        info = bucket_update_info(bucket)
        futures = [self.routes.pool.submit(self.routes.http.call, url, "POST", "/update_weights", idempotent=False,
                                           json={"update_info": info}, headers=FRESH_CONNECTION)
                   for url in self.routes.urls]
        stream = torch.cuda.current_stream()
        for _, t in bucket:
            self.comm.broadcast(t, src=0, stream=stream)
        wait = answer_wait_s(self.routes.http.policy)
        for url, f in zip(self.routes.urls, futures, strict=True):
            try:
                f.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                raise RolloutServerDown(f"rollout server {url} did not confirm a NCCL bucket within {wait:g} s; save "
                                        "a checkpoint and stop (restart the server and resume)", url=url) from None
        stream.synchronize()  # every server has the bucket: the broadcast is done or about to be

    def close(self) -> None:
        if self.comm is not None:
            try:
                self.comm.destroy()
            except Exception:  # noqa: BLE001 - an aborted group may refuse; it is dropped either way
                pass
            self.comm = None
