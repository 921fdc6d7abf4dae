"""`nccl` weight transport, both sides (CUDA only; the server imports `NcclReceiver` from here): the trainer hosts a
TCPStore, every server joins a NCCL group through `/init_communicator`, and each update goes bucket by bucket
(`rollout.server.weight_chunk_mb`, as the HTTP frames do): a `/update_weights_nccl` request announces one bucket
(names, dtypes, shapes, its index; `last` on the final one), the trainer broadcasts that bucket's tensors, and the
server answers once it has received them and the engine has taken them. Neither side holds more
than one bucket; the server commits the version after the last.

The trainer waits on those HTTP answers, never on `Work.wait`: a NCCL work's wait only makes the current CUDA stream
wait and returns at once on the host (seen on an H100), so a dead server went unnoticed until NCCL's watchdog aborted
the trainer, with no checkpoint. A missing answer raises RolloutServerDown (the loop saves a checkpoint and stops),
and the group is aborted. The group's timeout exceeds the longest the HTTP wait can take (`group_timeout_s`:
retries, `on_failure: wait`'s recovery and retried request included), and a NCCL group that times out all the same
aborts its communicators and fails its work, never the process (`RAISE_ON_TIMEOUT`).

One code path on both devices: the group is NCCL on CUDA and gloo on CPU (`_group`), which is how the CPU tests run
this transport (trainer and server threads of one process); `nccl_available` keeps users to CUDA."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from urllib.parse import urlsplit

import torch

from grpo_cli.rollout.base import RolloutError
from grpo_cli.runtime import accel
from grpo_cli.rollout.transport.base import Link, NamedTensors, WeightTransport
from grpo_cli.rollout.transport.codec import DTYPES, size_buckets
from grpo_cli.rollout.transport.http_client import RolloutServerDown

_CODES = {v: k for k, v in DTYPES.items()}
GROUP_GRACE_S = 60.0
"""The group's timeout is the HTTP wait's longest plus this: the trainer's HTTP wait gives up first and aborts it."""
ANSWER_BACKSTOP_S = 30.0
"""How much longer than its HTTP call may take the trainer waits for a server's answer (the thread's own backstop)."""
RAISE_ON_TIMEOUT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
"""Set while a ProcessGroupNCCL is built (torch reads it in the constructor, per group; no Options field holds it):
2 is `CleanUpOnly`, a timed-out or failed collective aborts the group's communicators and its work raises. torch's
default, 3 (`SkipCleanUp`), takes the whole process down, the trainer with its unsaved steps or the server."""


def answer_wait_s(policy) -> float:
    """The longest the trainer waits for one server's answer to a bucket: its HTTP call's worst case (the call is not
    idempotent: no retries; `on_failure: wait` adds the recovery wait and one retried request) plus a backstop."""
    return policy.worst_case_s(idempotent=False) + ANSWER_BACKSTOP_S


def group_timeout_s(policy) -> float:
    """The NCCL group's timeout: the longest answer wait plus `GROUP_GRACE_S`, so the HTTP path always gives up (and
    aborts the group) before the group's watchdog acts. 1617 s under `on_failure: wait`'s defaults (it was 660)."""
    return answer_wait_s(policy) + GROUP_GRACE_S


def nccl_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return False, "this torch build has no NCCL"
    return True, ""


def transport_device() -> torch.device:
    """The device the broadcasts run on: this process's current GPU, or the CPU (gloo, the tests' stand-in)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _group(host: str, port: int, world_size: int, rank: int, timeout_s: float, device: torch.device):
    from torch.distributed import TCPStore

    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    if device.type != "cuda":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    with _environment(RAISE_ON_TIMEOUT):
        return ProcessGroupNCCL(store, rank, world_size, opts)


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """`values` in this process's environment for the block (a group built inside reads them), then as before."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _handshake(pg, device) -> None:
    flag = torch.ones(1, device=device)
    pg.broadcast(flag, 0).wait()


def _abort(pg) -> None:
    """Abort the group's pending work (NCCL: its communicators, so the watchdog has nothing left to time out)."""
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 - best effort: without abort, pending work fails at the group's timeout
        pass


class NcclReceiver:
    """Server side: one rank of the trainer's group; receives one bucket of broadcast tensors at a time."""

    def __init__(self, pg, device, timeout_s: float) -> None:
        self.pg, self.device, self.timeout_s = pg, device, timeout_s

    @classmethod
    def join(cls, host: str, port: int, world_size: int, rank: int, *, timeout_s: float) -> NcclReceiver:
        device = transport_device()
        pg = _group(host, port, world_size, rank, timeout_s, device)
        _handshake(pg, device)
        return cls(pg, device, timeout_s)

    def receive(self, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
        """The tensors of one bucket, allocated as they are received."""
        out = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if dtype not in DTYPES:
                raise RolloutError(f"tensor {name!r}: unsupported dtype {dtype!r}")
            t = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            self.pg.broadcast(t, 0).wait()
            out.append((name, t))
        accel.synchronize(self.device)
        return out

    def close(self) -> None:
        _abort(self.pg)


def advertised_host(server_url: str) -> str:
    """The trainer address servers can reach: loopback for a local server, else the interface routing to it
    (never 0.0.0.0, a classic cause of init_communicator timeouts)."""
    host = urlsplit(server_url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class NcclSender:
    """Trainer side (rank 0): per bucket, announces it to every server over HTTP, broadcasts its tensors, and waits
    for every server's answer (bounded by the HTTP timeout) before reading the next bucket."""

    def __init__(self, http, urls, pg, device, timeout_s: float) -> None:
        self.http, self.urls, self.pg, self.device, self.timeout_s = http, urls, pg, device, timeout_s
        self.pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="nccl-http")
        self.last_buckets: list[int] = []
        """Bytes of each bucket of the last update (what a test or a log reads back)."""

    @classmethod
    def connect(cls, http, urls: list[str], *, timeout_s: float) -> NcclSender:
        ok, why = nccl_available()
        if not ok:
            raise RolloutError(f"rollout.server.weight_transport=nccl needs CUDA and NCCL on the trainer: {why}; "
                               "use weight_transport=http")
        host, port, world = advertised_host(urls[0]), free_port(), len(urls) + 1
        device, group_timeout = transport_device(), group_timeout_s(http.policy)
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            futures = [pool.submit(http.call, url, "POST", "/init_communicator", idempotent=False,
                                   json={"host": host, "port": port, "world_size": world, "rank": i + 1,
                                         "timeout_s": group_timeout})
                       for i, url in enumerate(urls)]
            pg = _group(host, port, world, 0, group_timeout, device)
            _handshake(pg, device)
            for f in futures:
                f.result(timeout=timeout_s)
        return cls(http, urls, pg, device, timeout_s)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, chunk_bytes: int) -> list[dict]:
        """Stream `named_tensors` bucket by bucket; returns each server's answer to the last bucket. Any failure
        aborts the group, and with it the broadcasts no server will receive (NCCL; gloo's fail at the group's
        timeout); the caller joins the servers again at the next update."""
        self.last_buckets = []
        try:
            for index, (bucket, last) in enumerate(size_buckets(named_tensors, chunk_bytes=chunk_bytes,
                                                                prepare=self._on_device)):
                replies = self._send_bucket(bucket, index, last, version)
                self.last_buckets.append(sum(t.nbytes for _, t in bucket))
                bucket.clear()  # the generator reads the next bucket while the loop still names this list
            for url, res in zip(self.urls, replies, strict=True):
                if res.get("weight_version") != version:
                    raise RolloutError(f"rollout server {url} did not confirm v{version} after the NCCL update: {res}")
        except BaseException:
            self.close()
            raise
        return replies

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.device).contiguous()

    def _send_bucket(self, bucket, index: int, last: bool, version: int) -> list[dict]:
        body = {"names": [n for n, _ in bucket], "dtypes": [_CODES[t.dtype] for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "version": version, "bucket": index, "last": last}
        futures = [self.pool.submit(self.http.call, url, "POST", "/update_weights_nccl", idempotent=False,
                                    json=body) for url in self.urls]
        works = [self.pg.broadcast(t, 0) for _, t in bucket]
        replies = [self._answer(url, f, index, version) for url, f in zip(self.urls, futures, strict=True)]
        for work in works:  # every server has the bucket: NCCL orders the stream after it, gloo returns at once
            work.wait()
        return replies

    def _answer(self, url: str, future, index: int, version: int) -> dict:
        """A server's answer to one bucket. The HTTP call is bounded (`Policy.worst_case_s`; then the transport raises
        RolloutServerDown); the wait here is a backstop in case its thread never returns."""
        backstop = answer_wait_s(self.http.policy)
        try:
            return future.result(timeout=backstop).json()
        except concurrent.futures.TimeoutError:
            raise RolloutServerDown(f"rollout server {url} did not confirm NCCL bucket {index} of v{version} within "
                                    f"{backstop:g} s; save a checkpoint and stop (restart the server and resume)",
                                    url=url) from None

    def close(self) -> None:
        _abort(self.pg)
        self.pool.shutdown(wait=False, cancel_futures=True)


class NcclTransport(WeightTransport):
    """`nccl`: the servers join the trainer's group at the first sync (`NcclSender.connect`); a failed sync aborts
    the group and the next one joins them again."""

    name = "nccl"

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.sender: NcclSender | None = None

    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        if self.sender is None:
            self.sender = NcclSender.connect(self.link.http, self.link.urls,
                                             timeout_s=self.link.http.policy.request_timeout_s)
        try:
            return self.sender.send(named_tensors, version, chunk_bytes=chunk_bytes)
        except BaseException:
            self.sender = None  # the sender aborted its group
            raise

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
