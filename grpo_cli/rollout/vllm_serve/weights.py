"""Weight pushes to stock `vllm serve` servers through vLLM's RL API (dev mode), one round per sync on every server:

    POST /start_weight_update → POST /update_weights {"update_info": ...} (once per bucket) →
    POST /finish_weight_update {"weight_version": "V"}

`ShmPush` (backend `grpo_shm`, our plugin engine): the frames are written once to an owner-only /dev/shm file and
one update names it. `NcclPush` (vLLM's own `nccl` backend, CUDA on both sides): vLLM's trainer endpoint joins
every server's workers in one NCCL group (server i's workers at rank offset 1 + the workers before it), then each
bucket of ≤ `weight_chunk_mb` is announced (`names`, `dtype_names`, `shapes`) and broadcast from rank 0, unpacked.
Both are `WeightTransport`s of the client `vllm-serve` in the transport registry (`transport/base.py`), which
`VLLMServeEngine` builds them through; `Sent.replies` is empty (the client reads the version back from
`/weight_info` and checks checksums, `client.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.transport.base import Link, NamedTensors, WeightTransport

if TYPE_CHECKING:
    import torch

    from grpo_cli.rollout.transport.shm import ShmFile


class RLRoutes:
    """vLLM's RL control plane on every server of `link`, called concurrently (on the link's pool)."""

    def __init__(self, link: Link) -> None:
        self.http, self.urls, self.pool = link.http, link.urls, link.pool

    def post_all(self, path: str, bodies: list[dict | None] | dict | None = None) -> list[dict]:
        """POST `path` to every server at once (one body each, or the same body), not retried: an update step
        repeated would fail ("already active") or load a bucket twice."""
        per_url = bodies if isinstance(bodies, list) else [bodies] * len(self.urls)
        futures = [self.pool.submit(self.http.call, url, "POST", path, idempotent=False, json=body)
                   for url, body in zip(self.urls, per_url, strict=True)]
        return [f.result().json() for f in futures]

    def round(self, send, version: int) -> None:
        """start → `send()` (the update_weights calls) → finish with `version` → reset the prefix cache (its KV was
        computed with the old weights). A failed `send` still finishes the round (without a version), so the
        server's next round can start; the error is raised."""
        self.post_all("/start_weight_update")
        try:
            send()
        except BaseException:
            try:
                self.post_all("/finish_weight_update", {"weight_version": None})
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        self.post_all("/finish_weight_update", {"weight_version": str(version)})
        self.post_all("/reset_prefix_cache")


class ShmPush(WeightTransport):
    """Same host: one /dev/shm file (kept and overwritten by each sync), loaded by every server's `grpo_shm`
    engine, which checks each frame's checksum, version and the end frame's counts."""

    name = "shm"

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.routes = RLRoutes(link)
        self.file: ShmFile | None = None

    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        from grpo_cli.rollout.transport.shm import ShmFile
        from grpo_cli.rollout.transport.codec import write_stream

        if self.file is None:
            self.file = ShmFile.create()
        out = self.file.rewind()
        size = write_stream(out, named_tensors, chunk_bytes=chunk_bytes, version=version)
        out.truncate(size)
        info = {"name": self.file.path.name, "bytes": size, "version": version}
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
    """vLLM's `NCCLWeightTransferInitInfo` for each server (`workers[i]`: its TP × PP × DP workers): one group of
    1 + Σ workers ranks, the trainer at 0, server i's workers from 1 + Σ workers[:i]; unpacked broadcasts."""
    world, offsets, offset = 1 + sum(workers), [], 1
    for w in workers:
        offsets.append(offset)
        offset += w
    return [{"master_address": host, "master_port": port, "rank_offset": o, "world_size": world, "packed": False}
            for o in offsets]


class NcclPush(WeightTransport):
    """CUDA: vLLM's NCCL engine on the servers, vLLM's trainer endpoint here (needs `vllm` importable in the
    trainer). `tp_size(url)`: the workers of that server (read when the group is joined, at the first sync), whose
    answers are awaited for the link's request timeout. A failed update leaves the group unusable: it is closed and
    the next sync joins again."""

    name = "nccl"
    takes = ("tp_size",)

    def __init__(self, link: Link, *, tp_size: Callable[[str], int]) -> None:
        super().__init__(link)
        self.routes, self.tp_size = RLRoutes(link), tp_size
        self.comm = None
        self.device = None

    @property
    def timeout_s(self) -> float:
        return self.link.http.policy.request_timeout_s

    def _join(self) -> None:
        import torch

        from grpo_cli.rollout.transport.nccl import _advertised_host, _free_port, nccl_available

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
        host, port = _advertised_host(self.routes.urls[0]), _free_port()
        infos = nccl_init_infos(host, port, [self.tp_size(url) for url in self.routes.urls])
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
                                           json={"update_info": info}) for url in self.routes.urls]
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
