"""Weight sync: stream the trainer's parameters (gathered from ZeRO-3/FSDP shards in size-capped buckets, LoRA
merged) to a rollout engine under Hugging Face names, then verify the engine holds them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from grpo_cli.runtime.dist import DistInfo
from grpo_cli.rollout.base import RolloutError
from grpo_cli.rollout.flat_weights import byte_buckets
from grpo_cli.rollout.scoring import score_sequences
from grpo_cli.rollout.weight_names import tied_aliases
from grpo_cli.train.weights.lora import merged_tensor
from grpo_cli.train.weights.shard_gather import GatheredBucket, row_sharded
from grpo_cli.train.weights.sync_ranks import agree, attempt, follow, pushes_from_main

PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}
"""Largest mean |engine − trainer| probe logprob (nats/token) accepted, by the less precise of the two dtypes.
fp32 kernels agree to ~1e-6; the bound only has to separate "same weights" from "other weights"."""
CHECKSUM_TENSORS = 4
SAMPLED_ROWS = 8
"""Rows of the embedding and output projection kept at each verified sync, read back when a check fails."""
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP/DeepSpeed engine wrappers (their parameter names carry a `module.` prefix)."""
    while type(model).__name__ in _WRAPPERS and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def is_peft(model) -> bool:
    return all(hasattr(model, a) for a in ("peft_config", "disable_adapter", "get_base_model"))


def is_zero3(param: torch.nn.Parameter) -> bool:
    """DeepSpeed ZeRO-3 partitions parameters and tags them with `ds_id`."""
    return hasattr(param, "ds_id")


def is_dtensor(tensor: torch.Tensor) -> bool:
    """FSDP2 (`fully_shard`) parameters are DTensors; `full_tensor()` all-gathers one."""
    return hasattr(tensor, "full_tensor") and hasattr(tensor, "placements")


def _is_fsdp1(model: torch.nn.Module) -> bool:
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())


def hf_name(name: str, *, peft: bool) -> str | None:
    """Checkpoint name of a trainer parameter, or None when it is not a base-model weight (LoRA A/B, the
    frozen copy of a `modules_to_save` module)."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    if peft:
        if "lora_" in name or "original_module" in name:
            return None
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        name = name.replace("modules_to_save.default.", "")
    return name


def checkpoint_names(model: torch.nn.Module, *, peft: bool) -> dict[str, list[str]]:
    """{trainer parameter name, as `named_parameters()` lists it: every checkpoint name it stands for}, its own
    first, then its tied names (`weight_names.tied_aliases`: e.g. `lm_head.weight` for a tied
    `model.embed_tokens.weight`). Parameters that are not base-model weights (LoRA A/B) are left out."""
    aliases = tied_aliases(model)
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        own = hf_name(name, peft=peft)
        if own is not None:
            tied = (hf_name(a, peft=peft) for a in aliases.get(name, []))
            out[name] = list(dict.fromkeys([own, *(t for t in tied if t is not None)]))
    return out


def projection_names(model: torch.nn.Module, *, peft: bool) -> list[str]:
    """Checkpoint names of the input embedding's and the output projection's weights (each name of a tied one)."""
    names = checkpoint_names(model, peft=peft)
    wanted = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if isinstance(getattr(module, "weight", None), torch.Tensor):
            wanted.add(id(module.weight))
    return [c for n, p in model.named_parameters() if id(p) in wanted for c in names.get(n, [])]


def describe_ties(model: torch.nn.Module) -> str | None:
    """One line naming the tied weights a sync sends under several names, or None when there are none."""
    model = unwrap(model)
    tied = {k: v[1:] for k, v in checkpoint_names(model, peft=is_peft(model)).items() if len(v) > 1}
    if not tied:
        return None
    return "weight sync: tied weights, sent under each checkpoint name: " + "; ".join(
        f"{hf_name(k, peft=is_peft(model))} also as {', '.join(v)}" for k, v in tied.items())


def _full_numel(param: torch.nn.Parameter) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


def buckets(named: list[tuple[str, torch.nn.Parameter]], cap_bytes: int) -> Iterator[list]:
    """Consecutive groups of parameters whose full (unsharded) size stays under `cap_bytes`; a single larger
    tensor is a bucket of its own. A bucket is gathered at once (ZeRO-3: `GatheredParameters`; FSDP2: one
    all-gather per dtype, `shard_gather`), so the cap bounds what a sync holds and sets how many collectives run."""
    return byte_buckets(named, cap_bytes, nbytes=lambda p: _full_numel(p) * p.element_size())


@contextlib.contextmanager
def _gathered(params: list[torch.nn.Parameter]):
    """Materialise a bucket (all ranks take part): ZeRO-3 partitions in place; FSDP2's row-sharded DTensors into
    one buffer per dtype (`shard_gather.GatheredBucket`, yielded; empty without any). Others pass through."""
    ds = [p for p in params if is_zero3(p)]
    rows = GatheredBucket([p for p in params if is_dtensor(p) and row_sharded(p)])
    if not ds:
        yield rows
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(ds, modifier_rank=None):
        yield rows


def _full_tensor(param: torch.nn.Parameter, gathered: GatheredBucket) -> torch.Tensor:
    if param in gathered:
        return gathered.full(param)
    if is_dtensor(param):
        return param.full_tensor().detach()
    if is_zero3(param):
        return param.data.detach().clone()  # the gathered storage is released when the bucket's context exits
    return param.detach()


def stream_named_tensors(
    model: torch.nn.Module, *, bucket_mb: int, peft: bool, stats: dict, keep_copies: set[str],
    keep_rows: set[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(checkpoint name, full tensor)` for every name of every base-model parameter (`checkpoint_names`:
    a tied weight once per name), gathering one bucket at a time. Counts tensors/bytes into `stats`, keeps CPU
    copies of the names in `keep_copies` in `stats["copies"]` and (shape, first `SAMPLED_ROWS` rows) of those in
    `keep_rows` in `stats["rows"]`."""
    names = checkpoint_names(model, peft=peft)
    named = [(n, p) for n, p in model.named_parameters() if n in names]
    for bucket in buckets(named, bucket_mb * 2**20):
        with _gathered([p for _, p in bucket]) as gathered:
            for name, param in bucket:
                tensor = _full_tensor(param, gathered)
                if peft:
                    tensor = merged_tensor(model, name, tensor)  # W + (α/r)·B·A, the trained tensors untouched
                for out in names[name]:
                    stats["tensors"] += 1
                    stats["bytes"] += tensor.numel() * tensor.element_size()
                    if out in keep_copies:
                        stats["copies"][out] = tensor.to("cpu", copy=True)
                    if out in keep_rows:
                        stats["rows"][out] = (tuple(tensor.shape), tensor[:SAMPLED_ROWS].to("cpu", copy=True))
                    yield out, tensor


@contextlib.contextmanager
def _sync_context(model: torch.nn.Module, *, peft: bool):
    """FSDP1 needs `summon_full_params` (the full model) while streaming. LoRA is never merged in place: each
    base weight is sent as W + scaling·B·A (`lora.merged_tensor`), so the trained tensors stay bit-exact."""
    with contextlib.ExitStack() as stack:
        if _is_fsdp1(model):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            stack.enter_context(FSDP.summon_full_params(model, writeback=False, rank0_only=False))
        yield


def checksum_names(model: torch.nn.Module, *, peft: bool, count: int = CHECKSUM_TENSORS) -> list[str]:
    """A few small 1-D weights (norms, biases), spread over the depth: cheap to read back exactly, and they
    change at every full-parameter optimizer step."""
    names = [hf_name(n, peft=peft) for n, p in model.named_parameters() if len(getattr(p, "ds_shape", p.shape)) == 1]
    names = [n for n in names if n is not None]
    if len(names) <= count:
        return names
    return [names[round(i * (len(names) - 1) / (count - 1))] for i in range(count)]


def sync_weights(
    engine, model: torch.nn.Module, *, version: int, bucket_mb: int, verify: bool, probe: list[list[int]] | None,
    info: DistInfo = DistInfo(),
) -> dict[str, float]:
    """Load the trainer's current weights into `engine` as `version`, then (with `verify`) check the engine
    holds them: exact equality of a few small tensors read back (engines offering `read_weights`) and the
    probe sequences' logprobs against the trainer's own within `PROBE_TOLERANCE`. Raises `RolloutError` when
    a check fails. Every rank calls it (gathers and TP engines are collective).

    An engine with `push_from_main_only` (server mode, SGLang, async) gets the tensors on rank 0 only
    (`sync_ranks`): the other ranks drain the stream (taking part in the gathers), then follow rank 0
    (`sync_ranks.follow`); every rank returns rank 0's metrics, and a failure on any rank raises on all."""
    start = time.perf_counter()
    model = unwrap(model)
    peft = is_peft(model)
    main_only = pushes_from_main(engine, info)
    pushes = not main_only or info.is_main
    readback = verify and pushes and hasattr(engine, "read_weights")
    wanted = set(checksum_names(model, peft=peft)) if readback else set()
    rows = set(projection_names(model, peft=peft)) if readback else set()
    stats: dict = {"tensors": 0, "bytes": 0, "copies": {}, "rows": {}}
    error = None
    with _sync_context(model, peft=peft):
        stream = stream_named_tensors(model, bucket_mb=bucket_mb, peft=peft, stats=stats, keep_copies=wanted,
                                      keep_rows=rows)
        if pushes:
            _, error = attempt(lambda: engine.update_weights(cast_stream(stream, _engine_dtype(engine)), version))
        for _ in stream:  # what the engine left unread (all of it on a rank that does not push): collective gathers
            pass
    if main_only:
        agree(None, error, info)  # rank 0's push failed: every rank raises
        error = None if info.is_main else attempt(lambda: follow(engine, version))[1]
    elif error is not None:
        raise error
    metrics = {"sync/seconds": time.perf_counter() - start, "sync/megabytes": stats["bytes"] / 2**20,
               "sync/tensors": float(stats["tensors"])}
    if verify:
        verify_start = time.perf_counter()
        metrics.update(verify_sync(engine, model, version=version, sent=stats["copies"], probe=probe,
                                   sent_rows=stats["rows"], info=info))
        metrics["sync/verify_seconds"] = time.perf_counter() - verify_start
    return agree(metrics, error, info) if main_only else metrics


def _engine_dtype(engine) -> torch.dtype | None:
    """The dtype the engine holds its weights in, when it says (a torch dtype or its name)."""
    dtype = getattr(engine, "dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if isinstance(dtype, torch.dtype) else None


def cast_stream(stream: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None):
    """Floating tensors cast to the engine's dtype on the way (float32 masters → a bf16 engine: half the bytes)."""
    for name, tensor in stream:
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def _dtype_of(engine, model: torch.nn.Module) -> torch.dtype:
    """The less precise of the engine's and the trainer's dtypes (the one that bounds the probe agreement)."""
    trainer = next(model.parameters()).dtype
    engine_dtype = _engine_dtype(engine)
    candidates = [d for d in (trainer, engine_dtype) if isinstance(d, torch.dtype)]
    return max(candidates, key=lambda d: PROBE_TOLERANCE.get(d, 1e-3))


def verify_sync(engine, model: torch.nn.Module, *, version: int, sent: dict[str, torch.Tensor],
                probe: list[list[int]] | None, sent_rows: dict | None = None,
                info: DistInfo = DistInfo()) -> dict[str, float]:
    """The checks of `sync_weights` (see there); returns `sync/max_probe_diff`, `sync/mean_probe_diff`,
    `sync/checked_tensors`. On failure the engine's embedding/output projection rows (`sent_rows`, from
    `stream_named_tensors`) are read back to name the tensors that disagree. The trainer's probe logprobs come
    first, on every rank (a collective forward under fsdp2/ZeRO-3); an engine with `push_from_main_only` is then
    asked on rank 0 only, and every rank returns rank 0's figures or raises its failure (`sync_ranks.agree`)."""
    probe = [list(s) for s in (probe or []) if len(s) >= 2]
    trainer_lp = _trainer_logprobs(model, probe) if probe else []
    if not pushes_from_main(engine, info):
        return _check_engine(engine, model, version, sent, probe, trainer_lp, sent_rows)
    result, error = attempt(lambda: _check_engine(engine, model, version, sent, probe, trainer_lp, sent_rows)) \
        if info.is_main else ({}, None)
    return agree(result, error, info)


def _check_engine(engine, model: torch.nn.Module, version: int, sent: dict[str, torch.Tensor],
                  probe: list[list[int]], trainer_lp: list[list[float]], sent_rows: dict | None) -> dict[str, float]:
    """`verify_sync`'s questions to the engine, judged against the trainer's `trainer_lp` of `probe`."""
    problems: list[str] = []
    if getattr(engine, "weight_version", version) != version:
        problems.append(f"engine reports weight version {engine.weight_version}, expected {version}")
    checked_what = ["the weight version the engine reports"]
    checked, mismatched = _compare_readback(engine, sent)
    problems += mismatched
    if checked:
        checked_what.append(f"{len(checked)} small tensors read back for exact equality ({', '.join(checked)})")
    out = {"sync/checked_tensors": float(len(checked))}
    defer = getattr(engine, "probe_when_awake", None)  # a sleeping colocated engine probes when awake anyway
    if probe and defer is not None and defer(lambda p=probe: _check_engine(engine, model, version, {}, p,
                                                                            trainer_lp, sent_rows)):
        probe, out["sync/probe_deferred"] = [], 1.0
    if probe:
        out.update(_probe_diffs(engine.score(probe), trainer_lp))
        dtype = _dtype_of(engine, model)
        tol = PROBE_TOLERANCE.get(dtype, 1e-3)
        checked_what.append(f"the logprobs of {sum(len(s) - 1 for s in probe)} probe tokens against the "
                            f"trainer's (mean |diff| ≤ {tol:g} nats/token for {dtype})")
        if out["sync/mean_probe_diff"] > tol:
            problems.append(
                f"probe logprobs differ from the trainer's by {out['sync/mean_probe_diff']:.3g} nats/token on "
                f"average (max {out['sync/max_probe_diff']:.3g}; tolerance {tol:g} for {dtype})"
            )
    if problems:
        raise RolloutError(_failure_message(engine, version, problems, checked_what,
                                            _projection_report(engine, sent_rows or {})))
    return out


def _compare_readback(engine, sent: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(names compared, problems): the engine's copies of `sent` must equal the trainer's exactly."""
    if not sent:
        return [], []
    checked, problems = [], []
    for name, tensor in engine.read_weights(sorted(sent)).items():
        ref = sent[name]
        if tensor.shape != ref.shape:
            continue  # sharded or fused in the engine: not comparable
        checked.append(name)
        diff = (tensor.float() - ref.to(tensor.dtype).float()).abs().max().item()
        if diff > 0:
            problems.append(f"{name} differs from the trainer's by up to {diff:.3g}")
    return checked, problems


def _trainer_logprobs(model: torch.nn.Module, probe: list[list[int]]) -> list[list[float]]:
    was_training = model.training
    model.eval()
    try:
        return score_sequences(model, probe, pad_token_id=0)
    finally:
        model.train(was_training)


def _probe_diffs(engine_lp: list[list[float]], trainer_lp: list[list[float]]) -> dict[str, float]:
    diffs = torch.tensor([abs(a - b) for e, t in zip(engine_lp, trainer_lp, strict=True)
                          for a, b in zip(e, t, strict=True)])
    return {"sync/max_probe_diff": float(diffs.max()), "sync/mean_probe_diff": float(diffs.mean())}


def _projection_report(engine, sent_rows: dict) -> str:
    """What reading back the first rows of the embedding and the output projection shows (on failure only:
    reading them costs a copy of the full tensors)."""
    if not sent_rows or not hasattr(engine, "read_weights"):
        return "This engine cannot read its weights back, so the tensors that disagree cannot be named."
    held = engine.read_weights(sorted(sent_rows))
    same, differ, unseen = [], [], []
    for name, (shape, ref) in sorted(sent_rows.items()):
        t = held.get(name)
        if t is None or tuple(t.shape[1:]) != shape[1:] or t.shape[0] < shape[0]:
            unseen.append(name)  # not held under that name, or sharded over the vocabulary
            continue
        diff = (t[: len(ref)].float() - ref.to(t.dtype).float()).abs().max().item()
        (differ if diff > 0 else same).append(f"{name} (by up to {diff:.3g})" if diff > 0 else name)
    parts = []
    if differ:
        parts.append(f"Read back, the engine's {', '.join(differ)} differ from what the trainer sent.")
    if same:
        parts.append(f"The engine's {', '.join(same)} read back equal to the trainer's, so the stale weights are "
                     "a copy the readback cannot see: a fused or repacked tensor (e.g. an output projection kept "
                     "apart from a tied embedding) or a layer not read back.")
    if unseen:
        parts.append(f"Not comparable: {', '.join(unseen)} (not held under that name, or sharded).")
    return " ".join(parts)


def _failure_message(engine, version: int, problems: list[str], checked: list[str], report: str) -> str:
    server = hasattr(engine, "urls")
    key = "`rollout.vllm.verify_sync: false`" + (" (that key also governs the check in server mode)" if server else "")
    model = "the server's --model" if server else "the engine's model"
    return (
        f"weight sync to version {version} did not take: {'; '.join(problems)}. The engine is generating with "
        f"other weights than the trainer's. Checked: {'; '.join(checked)}. {report} Check that {model} matches "
        "model.name_or_path and that nothing between the optimizer step and the sync changed the weights; if it "
        f"persists, report it with this message. Only as a last resort: {key} turns these checks off. Then "
        "nothing confirms that the engine samples from the trainer's weights: a sync that does not take goes "
        "unnoticed, and the run trains on samples of another policy, which importance correction does not repair."
    )
