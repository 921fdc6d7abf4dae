"""What the server's app and its weight routes share: the request bodies (strict pydantic models), the errors
that become 4xx answers, the served engine's `State`, and `reset_cache`. Imports no FastAPI."""

from __future__ import annotations

import anyio
from pydantic import BaseModel, ConfigDict, Field

from grpo_cli.rollout.transport.codec import ReceiveBuffer
from grpo_cli.server.engines import Served


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingBody(_Strict):
    n: int = Field(1, ge=1, le=1024)
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None


class GenerateBody(_Strict):
    prompt_ids: list[list[int]] = Field(min_length=1, max_length=65536)
    sampling: SamplingBody
    stop_token_ids: list[int] | None = None
    images: list[list[str]] | None = None
    """Prompt i's images as data URLs (`rollout/images.py`), once per prompt: its `sampling.n` completions share
    them. Only for an engine that `accepts_images` (`/info` capability `images`)."""


class ScoreBody(_Strict):
    sequences: list[list[int]] = Field(min_length=1, max_length=65536)
    images: list[list[str]] | None = None
    """Sequence i's images, as in `GenerateBody.images`."""


class DiskBody(_Strict):
    path: str
    version: int = Field(ge=0)


class ShmBody(_Strict):
    name: str = Field(pattern=r"^grpo-weights-[A-Za-z0-9_.-]+$")
    """A file in the server's shared-memory folder (`/dev/shm`), written by `codec.write_stream`."""
    bytes: int = Field(ge=0)
    version: int = Field(ge=0)


class SleepBody(_Strict):
    level: int = Field(1, ge=0, le=2)


class WakeBody(_Strict):
    tags: list[str] | None = None


class CommBody(_Strict):
    host: str
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    rank: int = Field(ge=1)
    timeout_s: float = Field(600.0, gt=0)


class NcclUpdateBody(_Strict):
    """One bucket of an NCCL update: its tensors follow as broadcasts. Buckets count from 0; `last` commits."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    version: int = Field(ge=0)
    bucket: int = Field(0, ge=0)
    last: bool = True


class RequestError(ValueError):
    """A request the engine cannot serve as asked (400 with this message)."""


class Conflict(RequestError):
    """The server's state forbids the call right now (409): asleep, or weights inconsistent."""


class State:
    """Weight version and health of the served engine. `inconsistent` after a partial weight update:
    generation is refused (409) until a complete update arrives."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.lock = anyio.Lock()
        self.weight_version = 0
        self.state = "ready"
        self.last_error = ""
        self.comm = None
        self.receive_buffer = ReceiveBuffer()
        """The HTTP upload's frame buffer, reused by every update (`codec.ReceiveBuffer`)."""
        self.session = None
        """The NCCL update whose buckets are arriving (`weights.NcclSession`): generation is refused (409) meanwhile."""


def reset_cache(engine) -> None:
    engine.reset_prefix_cache()
