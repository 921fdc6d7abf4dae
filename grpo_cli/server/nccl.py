"""NCCL fast path of the weight sync (CUDA only): the trainer hosts a TCPStore, every server joins a NCCL group
through `/init_communicator`, and each update is a broadcast from rank 0 announced by `/update_weights_nccl`.

The HTTP call announcing an update runs on a thread while the trainer broadcasts, and both sides wait with
timeouts, so a dead peer surfaces as an error instead of a hang. Untested here (no CUDA on CI machines)."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from urllib.parse import urlsplit

import torch

from grpo_cli.rollout.base import RolloutError
from grpo_cli.server.codec import DTYPES

_CODES = {v: k for k, v in DTYPES.items()}


def nccl_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return False, "this torch build has no NCCL"
    return True, ""


def _group(host: str, port: int, world_size: int, rank: int, timeout_s: float):
    from torch.distributed import ProcessGroupNCCL, TCPStore

    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return ProcessGroupNCCL(store, rank, world_size, opts)


def _handshake(pg, device) -> None:
    flag = torch.ones(1, device=device)
    pg.broadcast(flag, 0).wait()


class NcclReceiver:
    """Server side: one rank of the trainer's group; receives broadcast tensors on the current CUDA device."""

    def __init__(self, pg, device) -> None:
        self.pg, self.device = pg, device

    @classmethod
    def join(cls, host: str, port: int, world_size: int, rank: int, *, timeout_s: float) -> NcclReceiver:
        device = torch.device("cuda", torch.cuda.current_device())
        pg = _group(host, port, world_size, rank, timeout_s)
        _handshake(pg, device)
        return cls(pg, device)

    def receive(self, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if dtype not in DTYPES:
                raise RolloutError(f"tensor {name!r}: unsupported dtype {dtype!r}")
            t = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            self.pg.broadcast(t, 0).wait()
            out.append((name, t))
        torch.cuda.synchronize(self.device)
        return out


def _advertised_host(server_url: str) -> str:
    """The trainer address servers can reach: loopback for a local server, else the interface routing to it
    (never 0.0.0.0, a classic cause of init_communicator timeouts)."""
    host = urlsplit(server_url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class NcclSender:
    """Trainer side (rank 0): broadcasts each tensor while a thread waits on the servers' HTTP answers."""

    def __init__(self, http, urls, pg, device, timeout_s: float) -> None:
        self.http, self.urls, self.pg, self.device, self.timeout_s = http, urls, pg, device, timeout_s
        self.pool = ThreadPoolExecutor(max_workers=len(urls))

    @classmethod
    def connect(cls, http, urls: list[str], *, timeout_s: float) -> NcclSender:
        ok, why = nccl_available()
        if not ok:
            raise RolloutError(f"rollout.server.weight_transport=nccl needs CUDA and NCCL on the trainer: {why}; "
                               "use weight_transport=http")
        host, port, world = _advertised_host(urls[0]), _free_port(), len(urls) + 1
        device = torch.device("cuda", torch.cuda.current_device())
        pool = ThreadPoolExecutor(max_workers=len(urls))
        futures = [pool.submit(http.call, url, "POST", "/init_communicator", idempotent=False,
                               json={"host": host, "port": port, "world_size": world, "rank": i + 1,
                                     "timeout_s": timeout_s})
                   for i, url in enumerate(urls)]
        pg = _group(host, port, world, 0, timeout_s)
        _handshake(pg, device)
        for f in futures:
            f.result(timeout=timeout_s)
        return cls(http, urls, pg, device, timeout_s)

    def send(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        body = {"names": [n for n, _ in named_tensors], "dtypes": [_CODES[t.dtype] for _, t in named_tensors],
                "shapes": [list(t.shape) for _, t in named_tensors], "version": version}
        futures = [self.pool.submit(self.http.call, url, "POST", "/update_weights_nccl", idempotent=False, json=body)
                   for url in self.urls]
        for _, t in named_tensors:
            work = self.pg.broadcast(t.detach().to(self.device).contiguous(), 0)
            if not work.wait(timedelta(seconds=self.timeout_s)):
                raise RolloutError(f"NCCL broadcast did not finish within {self.timeout_s:g} s")
        for url, f in zip(self.urls, futures, strict=True):
            res = f.result(timeout=self.timeout_s).json()
            if res.get("weight_version") != version:
                raise RolloutError(f"rollout server {url} did not confirm v{version} after the NCCL update: {res}")
