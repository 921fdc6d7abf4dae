"""SGLang's `/update_weights_from_tensor` payload, written here: the named tensors pickled with torch's
multiprocessing reductions, as SGLang's MultiprocessingSerializer does (a CUDA tensor travels as an IPC handle of its
allocation: same machine only), base64 text, the tensors' GPU named by its UUID rather than by this process's index.

Why the UUID (sglang 0.5.23 wheel): torch's reduction records the sender's device *index*, which names another GPU
in a server started under another CUDA_VISIBLE_DEVICES (its scheduler then opens the handle on the wrong device and
dies). SGLang's own sender therefore patches torch's reductions before serializing (`srt/weight_sync/utils.py` calls
`srt/utils/patch_torch.py: monkey_patch_torch_reductions`, which rewrites argument 6, the device, to
`str(get_device_properties(i).uuid)`), and every receiving TP worker applies the same patch before deserializing
(`srt/managers/tp_worker.py: deserialize_own_rank`), so its `rebuild_cuda_tensor` maps a UUID back to its own
index (an int passes unchanged). Here the UUID goes in through this pickler's own reduction table: torch is not
patched for the whole process, and the payload references only `torch.multiprocessing.reductions.rebuild_cuda_tensor`,
which SGLang's restricted unpickler admits (`srt/utils/common.py: SafeUnpickler.ALLOWED_GLOBALS`)."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterable
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

from grpo_cli.runtime.accel import device_uuid
from grpo_cli.rollout.base import RolloutError

CUDA_DEVICE_ARG = 6
"""Position of the device index among the arguments `reduce_tensor` returns for `rebuild_cuda_tensor` (the one
SGLang's patch rewrites, `_REDUCE_TENSOR_ARG_DEVICE_INDEX`)."""

Reduction = Callable[[torch.Tensor], tuple]


def uuid_reduction(reduce_tensor: Reduction | None = None, uuid_of: Callable[[int], str] = device_uuid) -> Reduction:
    """A tensor reduction: `reduce_tensor`'s (torch's by default) with the CUDA device index replaced by
    `uuid_of(index)`. A tensor torch would not send as a CUDA IPC handle (host memory goes as a file descriptor of
    this process, which the server cannot open over HTTP) is refused with what to use instead."""

    def reduce(tensor: torch.Tensor) -> tuple:
        rebuild, args = (reduce_tensor or reductions.reduce_tensor)(tensor)
        if rebuild is not reductions.rebuild_cuda_tensor:
            raise RolloutError(
                f"rollout.server.weight_transport=tensor hands SGLang CUDA IPC handles, but the trainer "
                f"streams {tensor.device} tensors: train on the GPUs of the server's machine, or use "
                "rollout.server.weight_transport: disk")
        device = args[CUDA_DEVICE_ARG]
        if isinstance(device, int):  # a str: torch already patched in this process (SGLang imported here)
            args = (*args[:CUDA_DEVICE_ARG], uuid_of(device), *args[CUDA_DEVICE_ARG + 1:])
        return rebuild, args

    return reduce


class _Pickler(ForkingPickler):
    """ForkingPickler (torch's reductions registered on it) with `reduce` for every tensor type."""

    def __init__(self, file, reduce: Reduction) -> None:
        super().__init__(file)
        for cls in (*torch._tensor_classes, torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[cls] = reduce


def sglang_serializer(named_tensors: Iterable[tuple[str, torch.Tensor]], *, reduce: Reduction | None = None) -> str:
    """`MultiprocessingSerializer.serialize(named_tensors, output_str=True)` with the device sent as its UUID (see
    the module docstring); `reduce` defaults to `uuid_reduction()`."""
    buf = io.BytesIO()
    _Pickler(buf, reduce or uuid_reduction()).dump(list(named_tensors))
    return base64.b64encode(buf.getvalue()).decode()
