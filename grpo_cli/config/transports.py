"""The weight transports of server mode as plain data: the one list of their names (`WeightTransportName`, the
Literal `rollout.server.weight_transport` takes) and of each client's transports with their facts. The (engine,
mode) rows take their transports from here, the registry of implementations (`rollout/transport/base.py`) is keyed
by the same (client, name) pairs, and docs/server-mode.md's table is generated from it (`config/reference.py`)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

WeightTransportName = Literal["http", "shm", "nccl", "disk", "tensor"]
"""Every name `rollout.server.weight_transport` takes (tests/config/test_weight_transport_key.py keeps it equal to
the names in `TRANSPORTS`)."""


@dataclass(frozen=True)
class TransportFacts:
    """One transport of one client."""

    name: str
    client: str
    """The rollout client it works with: `serve-rollout` (`grpo serve-rollout`, engines hf/vllm), `sglang`, or
    `vllm-serve` (stock `vllm serve`, through vLLM's RL API)."""
    topology: str
    when: str
    same_host: bool = False
    """The server must run on the trainer's host: the config rule refuses a server URL that is not loopback."""


TRANSPORTS: tuple[TransportFacts, ...] = (
    TransportFacts("http", "serve-rollout", "any host that reaches the server",
                   "a server on another machine; the one that always works (checksummed frames)"),
    TransportFacts("shm", "serve-rollout", "same host, same user",
                   "server beside the trainer, no GPU link: one copy into /dev/shm, the server maps it",
                   same_host=True),
    TransportFacts("nccl", "serve-rollout", "CUDA on both sides, reachable TCP port",
                   "GPU trainer and GPU server: broadcast device to device, no host copy"),
    TransportFacts("disk", "sglang", "a folder both sides read (`weight_sync_dir`)",
                   "SGLang on another machine with a shared filesystem, or any SGLang: a safetensors checkpoint the "
                   "server loads"),
    TransportFacts("tensor", "sglang", "same machine, trainer on CUDA",
                   "SGLang beside the trainer: CUDA IPC handles per bucket, no copy through disk", same_host=True),
    TransportFacts("shm", "vllm-serve", "same host, same user",
                   "`vllm serve` beside the trainer: one /dev/shm file its `grpo_shm` plugin engine loads, over "
                   "vLLM's RL API", same_host=True),
    TransportFacts("nccl", "vllm-serve", "CUDA on both sides, reachable TCP port",
                   "GPU trainer and `vllm serve`: vLLM's own NCCL engine, each bucket announced and broadcast"),
)
"""Each client's transports in order (a client's first is its engines' default)."""


def names_for(client: str) -> tuple[str, ...]:
    """`client`'s transports, its default first."""
    return tuple(t.name for t in TRANSPORTS if t.client == client)


def facts(client: str, name: str) -> TransportFacts | None:
    return next((t for t in TRANSPORTS if (t.client, t.name) == (client, name)), None)


def is_loopback(url: str) -> bool:
    """The URL names this host (`localhost` or a loopback address)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
