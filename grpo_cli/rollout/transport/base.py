"""The weight-transport contract and its registry.

A transport sends one weight sync to every server of a client: `send(named_tensors, version, chunk_bytes=...)`
streams the named tensors (read lazily, at most about one `chunk_bytes` bucket held at a time) and returns `Sent`:
the bytes it moved, the seconds it took, and each server's answer where the wire has one. The client checks the
version each server reports and records `last_sync`. A transport never retries: a half-received update leaves the
server refusing to generate until the next complete one, and the client pushes again.

One registry (`TRANSPORTS`), keyed by (client, name): the name is what `rollout.server.weight_transport` takes,
and two clients may each have a transport of the same name (`shm` of `grpo serve-rollout` and `shm` of `vllm serve`
are different wires). Each entry names the implementation as `module:Class` (imported when a client builds it, so
listing names imports no torch and the registry imports no client). The names and their facts (topology, when to
use it, same host) are `config/transports.py`'s list, which the (engine, mode) rows and the config rules read and
docs/server-mode.md's table is generated from; a test keeps this registry's keys equal to it. A new transport is one
`WeightTransport` subclass, one entry there and one `register` call here.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_cli.rollout.base import RolloutError

if TYPE_CHECKING:
    from grpo_cli.rollout.transport.http_client import HttpClient

NamedTensors = Iterable[tuple[str, Any]]
"""(name, torch.Tensor) pairs, read once, in order (torch is imported by the transports that need it)."""


@dataclass
class Link:
    """What a transport reaches its servers through: the client's HTTP client (auth, timeouts, retries), the
    servers' URLs and a thread pool of one worker per server (fan-out)."""

    http: HttpClient
    urls: list[str]
    pool: ThreadPoolExecutor


@dataclass
class Sent:
    """One sync as the transport saw it: the tensor bytes it read from the stream, wall seconds, and each server's
    answer in `urls` order (empty where the wire answers nothing the client checks)."""

    bytes: int
    seconds: float
    replies: list[dict] = field(default_factory=list)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9)


class WeightTransport(ABC):
    """Sends named tensors at a version to every server of `link`. A subclass's keyword options are named in `takes`;
    `create` passes it those of what the client offers (so a client builds any of its transports one way)."""

    name: str = ""
    takes: tuple[str, ...] = ()
    stages_first: bool = False
    """Whether `_send` first writes the weights where no server reads them yet (a same-host file) and calls
    `before_load` itself once they are written, right before the servers load them; else `send` calls it first."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.before_load: Callable[[], None] | None = None
        """Called once per send before any server takes the weights (stream mode pauses the servers there)."""

    def _loading(self) -> None:
        if self.before_load is not None:
            self.before_load()

    @abstractmethod
    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        """Move the tensors to every server; each server's answer."""

    def send(self, named_tensors: NamedTensors, version: int, *, chunk_bytes: int) -> Sent:
        size = 0

        def counted():
            nonlocal size
            for name, tensor in named_tensors:
                size += tensor.nbytes
                yield name, tensor

        start = time.perf_counter()
        if not self.stages_first:
            self._loading()
        replies = self._send(counted(), version, chunk_bytes)
        return Sent(size, time.perf_counter() - start, replies)

    def close(self) -> None:
        """Release what the transport holds between syncs (a file, a process group); idempotent."""


@dataclass(frozen=True)
class Entry:
    """One registered transport: its implementation (its facts are `config.transports`')."""

    name: str
    target: str
    """`module:Class` of the `WeightTransport` subclass."""
    client: str
    """The rollout client it works with (`config.transports.TransportFacts.client`)."""


TRANSPORTS: dict[tuple[str, str], Entry] = {}
"""(client, name) → entry, in registration order."""


def register(name: str, target: str, *, client: str) -> None:
    if (client, name) in TRANSPORTS:
        raise ValueError(f"weight transport {name!r} of the {client} client is registered twice")
    TRANSPORTS[(client, name)] = Entry(name, target, client)


def names_for(client: str) -> tuple[str, ...]:
    """The transports registered for `client`, in registration order."""
    return tuple(name for (owner, name) in TRANSPORTS if owner == client)


def entry(name: str, client: str) -> Entry:
    """The entry of `client`'s transport `name`; refused naming the client's own (and who has `name`, if anyone)."""
    found = TRANSPORTS.get((client, name))
    if found is not None:
        return found
    owners = [owner for (owner, other) in TRANSPORTS if other == name]
    whose = f"works with the {', '.join(owners)} client, not {client}" if owners else "is not registered"
    raise RolloutError(f"weight transport {name!r} {whose}; use one of: {', '.join(names_for(client))}")


def transport_class(name: str, client: str) -> type[WeightTransport]:
    module, _, cls = entry(name, client).target.partition(":")
    return getattr(importlib.import_module(module), cls)


def create(name: str, link: Link, *, client: str, offered: dict) -> WeightTransport:
    """Build `client`'s transport `name` over `link`, passing it the options it `takes` from `offered`."""
    cls = transport_class(name, client)
    return cls(link, **{key: offered[key] for key in cls.takes})


_PKG = "grpo_cli.rollout.transport"
register("http", f"{_PKG}.http:HttpTransport", client="serve-rollout")
register("shm", f"{_PKG}.shm:ShmTransport", client="serve-rollout")
register("nccl", f"{_PKG}.nccl:NcclTransport", client="serve-rollout")
register("disk", f"{_PKG}.sglang:DiskTransport", client="sglang")
register("tensor", f"{_PKG}.sglang:TensorTransport", client="sglang")
_VLLM = "grpo_cli.rollout.transport.vllm_rl"
register("shm", f"{_VLLM}:ShmPush", client="vllm-serve")
register("nccl", f"{_VLLM}:NcclPush", client="vllm-serve")
