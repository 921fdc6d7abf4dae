"""sglang_payload: the `/update_weights_from_tensor` payload names the GPU by its UUID (as SGLang's own sender does,
`srt/utils/patch_torch.py`), not by the trainer's local index. The CUDA branch of the reduction is driven on CPU
with a fake torch reduction that answers what `reduce_tensor` answers for a CUDA tensor, and a fake UUID lookup;
the payload is then read back as SGLang's receiver reads it."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch
from torch.multiprocessing import reductions

from grpo_cli.runtime import accel
from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.transport.sglang_payload import CUDA_DEVICE_ARG, sglang_serializer, uuid_reduction

# The globals such a payload needs, all in SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS (srt/utils/common.py):
# anything else (e.g. a grpo_cli function) is "Blocked unsafe global" on the server.
SGLANG_ALLOWED = {("builtins", "list"), ("builtins", "tuple"), ("torch", "Tensor"), ("torch", "Size"),
                  ("torch", "float32"), ("torch", "bfloat16"), ("torch.storage", "TypedStorage"),
                  ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")}


def fake_cuda_reduce(tensor: torch.Tensor) -> tuple:
    """What torch's reduce_tensor returns for a CUDA tensor on the trainer's cuda:3 (reductions.py), with
    made-up IPC handles."""
    return reductions.rebuild_cuda_tensor, (
        type(tensor), tensor.size(), tensor.stride(), 0, torch.storage.TypedStorage, tensor.dtype, 3,
        b"ipc-handle", tensor.numel() * tensor.element_size(), 0, False, b"ref-counter", 0, b"event", True)


class SGLangReceiver(pickle.Unpickler):
    """Reads a payload as a patched SGLang TP worker does: only allowed globals, and `rebuild_cuda_tensor` resolving
    to a rebuild that maps a device UUID to the receiver's own index (its GPU is cuda:0 under its
    CUDA_VISIBLE_DEVICES) and records what it was given."""

    local_index = {"GPU-uuid-of-3": 0}

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.rebuilt: list[tuple] = []
        self.globals: set[tuple[str, str]] = set()

    def find_class(self, module, name):
        self.globals.add((module, name))
        assert (module, name) in SGLANG_ALLOWED, f"SGLang blocks {module}.{name}"
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return self.rebuild
        return super().find_class(module, name)

    def rebuild(self, *args):
        device = args[CUDA_DEVICE_ARG]
        if isinstance(device, str):
            device = self.local_index[device]  # patch_torch._device_from_maybe_uuid
        self.rebuilt.append((*args[:CUDA_DEVICE_ARG], device, *args[CUDA_DEVICE_ARG + 1:]))
        return torch.zeros(args[1], dtype=args[5])


def test_payload_names_the_gpu_by_uuid_and_loads_under_sglangs_rules():
    named = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.ones(2, 3))]
    uuids = []

    def uuid_of(index: int) -> str:
        uuids.append(index)
        return f"GPU-uuid-of-{index}"

    payload = sglang_serializer(named, reduce=uuid_reduction(fake_cuda_reduce, uuid_of))
    receiver = SGLangReceiver(base64.b64decode(payload))
    loaded = receiver.load()
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in receiver.globals
    assert [n for n, _ in loaded] == ["model.norm.weight", "lm_head.weight"]
    assert [t.shape for _, t in loaded] == [torch.Size([4]), torch.Size([2, 3])]
    assert uuids == [3, 3]
    # the receiver opened its own cuda:0, the GPU the trainer calls cuda:3; every other argument as torch wrote it
    assert [args[CUDA_DEVICE_ARG] for args in receiver.rebuilt] == [0, 0]
    assert receiver.rebuilt[1][7] == b"ipc-handle" and receiver.rebuilt[1][8] == 24


def test_plain_torch_payload_would_carry_the_local_index():
    """What the UUID replaces: serialized without it, the receiver sees index 3, which under its own
    CUDA_VISIBLE_DEVICES is another GPU (or none)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = fake_cuda_reduce
    pickler.dump([("w", torch.ones(2))])
    receiver = SGLangReceiver(buf.getvalue())
    receiver.load()
    assert receiver.rebuilt[0][CUDA_DEVICE_ARG] == 3


def test_a_device_already_sent_as_uuid_is_left_alone():
    """In a process where SGLang patched torch (sglang imported by the trainer), torch's reduction already
    writes the UUID: it is not looked up again."""
    def patched(tensor):
        rebuild, args = fake_cuda_reduce(tensor)
        return rebuild, (*args[:CUDA_DEVICE_ARG], "GPU-uuid-of-3", *args[CUDA_DEVICE_ARG + 1:])

    reduce = uuid_reduction(patched, lambda i: pytest.fail("looked up twice"))
    receiver = SGLangReceiver(base64.b64decode(sglang_serializer([("w", torch.ones(2))], reduce=reduce)))
    receiver.load()
    assert receiver.rebuilt[0][CUDA_DEVICE_ARG] == 0


def test_host_tensors_are_refused_with_the_disk_transport_named():
    """torch's own reduction of a CPU tensor passes a file descriptor of this process: useless over HTTP."""
    with pytest.raises(RolloutError, match=r"streams cpu tensors.*rollout\.server\.weight_transport: disk"):
        sglang_serializer([("w", torch.ones(2))])


def test_device_uuid_is_written_as_sglang_reads_it(monkeypatch):
    class Props:
        uuid = "e3b0c442-98fc-1c14-9afb-f4c8996fb924"

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: asked.append(i) or Props())
    assert accel.device_uuid(3) == str(Props.uuid) and asked == [3]
