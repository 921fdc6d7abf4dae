"""CPU stand-ins for the CUDA assumptions inside megatron-core (and mbridge), so the megatron backend runs on gloo
CPU processes (CI, `--rehearse`). Imported only when the training device is CPU; nothing here changes numerics: it
only moves tensors Megatron would put on "cuda" to the CPU, keeps its RNG tracker on the CPU generator, and lets its
`tensor.type() == 'torch.cuda.FloatTensor'` checks accept the same dtypes on the CPU."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import types

import torch

ENTRY_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "mbridge",
)
"""Imported before patching; every megatron.core / mbridge module then loaded gets `_CpuTorch` as its `torch`
global (their "cuda" literals and `torch.cuda.*` calls)."""
PATCHED_PREFIXES = ("megatron.core", "mbridge")

_CPU = torch.device("cpu")
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like", "rand",
              "randn")
_installed = False


def _cpu_device(device):
    """Where Megatron asks for a CUDA device (the string, an index from `current_device()`, a cuda device): CPU."""
    if device is None or isinstance(device, int) or str(device).startswith("cuda"):
        return _CPU
    return device


class _NullStream:
    """A CUDA stream where there is none: CPU ops run in order, so waiting, recording and synchronising are no-ops,
    and there is one stream (every "new" stream is it, so the MoE token dispatcher's device-to-host side stream is
    the current stream and its copies are plain ones)."""

    _one: "_NullStream | None" = None

    def __new__(cls, *_a, **_k):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, *_a, **_k) -> None:
        pass

    def wait_event(self, *_a, **_k) -> None:
        pass

    def record_event(self, *_a, **_k) -> "_NullStream":
        return self  # an event: synchronize() and wait() are no-ops too

    def wait(self, *_a, **_k) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _CpuCuda(types.SimpleNamespace):
    """`torch.cuda` as Megatron's CPU-run modules see it: the current device is the CPU, synchronisation is a
    no-op (CPU ops are synchronous), RNG calls use the CPU generator; everything else is the real `torch.cuda`."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def synchronize(*_a, **_k) -> None:
        pass

    Stream = _NullStream

    @staticmethod
    def default_stream(*_a, **_k):
        return _NullStream()

    @staticmethod
    def current_stream(*_a, **_k):
        return _NullStream()

    @staticmethod
    def stream(*_a, **_k):
        return contextlib.nullcontext()

    @staticmethod
    def get_rng_state(*_a, **_k):
        return torch.get_rng_state()

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def empty_cache() -> None:
        pass


class _CpuTorch(types.ModuleType):
    """A stand-in for the `torch` module inside one Megatron module: tensor factories asked for "cuda" make CPU
    tensors, `torch.cuda` is `_CpuCuda`; every other attribute is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn):
        def make(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return make

    def __getattr__(self, name):
        return getattr(torch, name)


def _cuda_named_type(original):
    """`Tensor.type()` with no argument names a CPU tensor as its CUDA twin ('torch.cuda.FloatTensor'): Megatron's
    optimizers assert those names before accepting a parameter; with an argument it is the real cast."""

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    return type_


def _rng_tracker_on_cpu(random_module) -> None:
    """Megatron's model-parallel RNG tracker keeps CUDA generator states; on the CPU it keeps the CPU generator's."""
    random_module._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random_module._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _cuda_method_is_identity(fn):
    """`fn` with `Tensor.cuda()` returning the tensor itself while it runs (Megatron moves the last pipeline stage's
    copy of tied embeddings with `.cuda()` before all-reducing it from the first stage)."""

    def wrapped(*args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *_a, **_k: t
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    return wrapped


def _split_sizes_as_numpy(move):
    """megatron-core's `maybe_move_tensor_to_cpu(t, as_numpy=True)` turns the MoE dispatcher's all-to-all split sizes
    into numpy arrays, but only for CUDA tensors; on the CPU they stayed tensors, which `all_to_all_single` refuses.
    The same conversion for a CPU tensor (the values are unchanged)."""

    def moved(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return moved


def install() -> None:
    """Apply every shim once per process (idempotent)."""
    global _installed
    if _installed:
        return
    stand_in = _CpuTorch()
    for name in ENTRY_MODULES:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if name.startswith(PATCHED_PREFIXES) and getattr(module, "torch", None) is torch:
            module.torch = stand_in
    # The tracker's fork warns when the CPU generator moved inside it; on the CPU it is the tracked generator.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _rng_tracker_on_cpu(importlib.import_module("megatron.core.tensor_parallel.random"))
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.maybe_move_tensor_to_cpu = _split_sizes_as_numpy(dispatcher.maybe_move_tensor_to_cpu)
    torch.Tensor.type = _cuda_named_type(torch.Tensor.type)
    from megatron.core.models.common.language_module.language_module import (
        LanguageModule,
    )

    LanguageModule.setup_embeddings_and_output_layer = _cuda_method_is_identity(
        LanguageModule.setup_embeddings_and_output_layer)
    _installed = True
