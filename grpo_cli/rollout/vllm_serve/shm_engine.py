"""Server side of the `shm` weight transport to a stock `vllm serve` (`rollout.engine: vllm-serve`): a vLLM
weight-transfer engine, registered as backend `grpo_shm` by the `vllm.general_plugins` entry point of grpo-cli
(`plugin.register`), that runs in each vLLM worker process.

The trainer writes its weights once into an owner-only file in /dev/shm as grpo-cli's checksummed safetensors frames
(`server.codec.write_stream`, the same file `grpo serve-rollout` maps) and posts its name through vLLM's RL API:

    /start_weight_update                      → layerwise reload begins (vLLM repacks weights on CPU, fuses qkv)
    /update_weights {"update_info": {"name": NAME, "bytes": N, "version": V}}
                                              → the worker maps /dev/shm/NAME, checks every frame's XXH3-128
                                                checksum, that every frame is for V and the end frame's counts, and
                                                loads the tensors through the model's `load_weights`
    /finish_weight_update {"weight_version": "V"} → layerwise reload ends; vLLM records V

Imported only inside vLLM (it subclasses vLLM's `WeightTransferEngine`); the trainer never imports it.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_cli.rollout.transport.codec import SHM_DIR, checked_frames, read_stream

BACKEND = "grpo_shm"
MAX_FRAME_BYTES = 1 << 40
"""A frame is at most the file itself (which the trainer's own user wrote); the checksum guards its integrity."""
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the file name rides each update."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One update: the file `name` in /dev/shm, its size in `bytes`, and the `version` every frame must carry."""

    name: str
    bytes: int
    version: int

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name.startswith("."):
            raise ValueError(f"grpo_shm: {self.name!r} is not a plain file name in {SHM_DIR}")


def open_update(info: ShmUpdateInfo, folder: str = SHM_DIR) -> memoryview:
    """The update's file mapped copy-on-write (the mapping outlives the file object); refused unless it is a regular
    file of the announced size owned by this process's user."""
    path = Path(folder) / info.name
    st = path.stat() if path.is_file() else None
    if st is None or st.st_size != info.bytes or st.st_uid != os.getuid():
        raise FileNotFoundError(
            f"{path}: no file of {info.bytes} bytes owned by this user there; the shm weight transport needs "
            "`vllm serve` on the trainer's host, run by the same user (else use weight_transport=nccl on CUDA)")
    if not info.bytes:
        return memoryview(b"")
    with path.open("rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """vLLM worker-side engine: loads a grpo-cli /dev/shm weight file into the model (layerwise reload, as vLLM's
    own checkpoint-format engines, so fused and CPU-repacked weights are rebuilt)."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        """Nothing to set up."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        buffer = open_update(update_info)
        frames = checked_frames(read_stream(buffer, max_frame_bytes=MAX_FRAME_BYTES), update_info.version)
        self.model.load_weights(t for frame in frames for t in frame.tensors)

    def shutdown(self) -> None:
        """Nothing held between updates."""
