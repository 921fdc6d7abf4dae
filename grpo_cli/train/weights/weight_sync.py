"""Weight sync: stream the trainer's weights (a backend's `WeightSource`: gathered from shards in size-capped
buckets, LoRA merged, under Hugging Face names) to a rollout engine, then verify the engine holds them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import torch

from grpo_cli.runtime.dist import DistInfo
from grpo_cli.rollout.base import RolloutError
from grpo_cli.train.weights.hf_module import as_source
from grpo_cli.train.weights.source import WeightSource
from grpo_cli.train.weights.sync_ranks import agree, attempt, follow, pushes_from_main

PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}
"""Largest mean |engine − trainer| probe logprob (nats/token) accepted, by the less precise of the engine's dtype and
the trainer's compute dtype (bf16 compute over float32 masters is judged as bf16).
fp32 kernels agree to ~1e-6; the bound only has to separate "same weights" from "other weights"."""


def sync_weights(
    engine, model: WeightSource | torch.nn.Module, *, version: int, bucket_mb: int, verify: bool,
    probe: list[list[int]] | None, info: DistInfo = DistInfo(), skip: Callable[[str], bool] | None = None,
    probe_images: list | None = None, probe_vision=None,
) -> dict[str, float]:
    """Load the trainer's current weights (`model`: a backend's `weight_source()`, or a Hugging Face module) into
    `engine` as `version`, then (with `verify`) check the engine
    holds them: exact equality of a few small tensors read back (engines offering `read_weights`) and the
    probe sequences' logprobs against the trainer's own within `PROBE_TOLERANCE`. Raises `RolloutError` when
    a check fails. Every rank calls it (gathers and TP engines are collective).

    An engine with `push_from_main_only` (server mode, SGLang, async) gets the tensors on rank 0 only
    (`sync_ranks`): the other ranks drain the stream (taking part in the gathers), then follow rank 0
    (`sync_ranks.follow`); every rank returns rank 0's metrics, and a failure on any rank raises on all."""
    start = time.perf_counter()
    source = as_source(model)
    main_only = pushes_from_main(engine, info)
    pushes = not main_only or info.is_main
    readback = verify and pushes and engine.reads_weights
    wanted = set(source.checksum_names()) if readback else set()
    rows = set(source.projection_names()) if readback else set()
    stats: dict = {"tensors": 0, "bytes": 0, "copies": {}, "rows": {}}
    error = None
    dtype = _engine_dtype(engine)  # the source casts its shards before gathering them where it can
    stream = source.named_tensors(bucket_mb=bucket_mb, stats=stats, keep_copies=wanted, keep_rows=rows, dtype=dtype)
    skipped = {"tensors": 0, "bytes": 0}

    def sent() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in cast_stream(stream, dtype):
            if skip is not None and skip(name):
                skipped["tensors"] += 1
                skipped["bytes"] += tensor.numel() * tensor.element_size()
                continue
            yield name, tensor

    settled: dict[str, float] = {}

    def push() -> None:  # the last round's background checks pass first; a failure is the push's, agreed below
        settled.update(engine.settle_checks())
        engine.update_weights(sent(), version)

    if pushes:
        _, error = attempt(push)
    for _ in stream:  # what the engine left unread (all of it on a rank that does not push): collective gathers
        pass
    if main_only:
        agree(None, error, info)  # rank 0's push failed: every rank raises
        error = None if info.is_main else attempt(lambda: follow(engine, version))[1]
    elif error is not None:
        raise error
    metrics = {"sync/seconds": time.perf_counter() - start,
               "sync/megabytes": (stats["bytes"] - skipped["bytes"]) / 2**20,
               "sync/tensors": float(stats["tensors"] - skipped["tensors"])}
    if skip is not None:
        metrics["sync/skipped_tensors"] = float(skipped["tensors"])
    if verify:
        verify_start = time.perf_counter()
        metrics.update(verify_sync(engine, source, version=version, sent=stats["copies"], probe=probe,
                                   sent_rows=stats["rows"], info=info, probe_images=probe_images,
                                   probe_vision=probe_vision))
        metrics["sync/verify_seconds"] = time.perf_counter() - verify_start
    metrics.update(settled)  # on rank 0 alone under main_only: the agree hands its metrics to every rank
    return agree(metrics, error, info) if main_only else metrics


def settle_deferred(engine, info: DistInfo = DistInfo()) -> dict[str, float]:
    """The figures of the sync checks `engine` ran in the background (`settle_checks`: stream mode's probe, one
    sync late), or their failure raised on every rank. Every rank calls it at the same point (each checkpoint, the
    run's end; `sync_weights` settles inside its push, agreed with it): an engine with `push_from_main_only` ran them
    on rank 0, whose outcome every rank takes."""
    main_only = pushes_from_main(engine, info)
    if not main_only:
        return engine.settle_checks()
    figures, error = attempt(engine.settle_checks) if info.is_main else ({}, None)
    return agree(figures, error, info)


class FrozenVision:
    """`model.freeze_vision` on a vision-language model: what each sync leaves out (`sync_weights(skip=)`): nothing
    at the first (the engine may hold other weights than the trainer's), the vision tower at every later one (the
    trainer's copy never changes, so the engine's stays equal to it)."""

    def __init__(self, frozen: bool) -> None:
        self.frozen, self.synced = frozen, False

    def skip(self) -> Callable[[str], bool] | None:
        from grpo_cli.models.vision import is_vision_parameter

        skip = is_vision_parameter if self.frozen and self.synced else None
        self.synced = True
        return skip


def probe_of(prompt) -> dict:
    """`sync_weights`' probe arguments for one dataset prompt (`data.prompts.Prompt`): its ids, and where it has
    images, them (for the engine) and its processor outputs (for the trainer's forward)."""
    if not prompt.images:
        return {"probe": [prompt.ids]}
    return {"probe": [prompt.ids], "probe_images": [list(prompt.images)], "probe_vision": prompt.vision}


def _engine_dtype(engine) -> torch.dtype | None:
    """The dtype the engine holds its weights in, when it says (a torch dtype or its name)."""
    dtype = engine.dtype
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if isinstance(dtype, torch.dtype) else None


def cast_stream(stream: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None):
    """Floating tensors cast to the engine's dtype on the way (float32 masters → a bf16 engine: half the bytes);
    FSDP2 shards arrive cast already (cast before their all-gather, `shard_gather`), the others are cast here."""
    for name, tensor in stream:
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def _dtype_of(engine, trainer: torch.dtype) -> tuple[torch.dtype, str]:
    """The less precise of the engine's dtype and the trainer's compute dtype `trainer` (the one that bounds the
    probe agreement: under mixed precision the probe is computed in bf16 over float32 masters, DESIGN.md 4b), and
    a phrase naming the two compared."""
    engine_dtype = _engine_dtype(engine)
    candidates = [d for d in (trainer, engine_dtype) if isinstance(d, torch.dtype)]
    held = _dtype_name(engine_dtype) if engine_dtype is not None else "dtype, which it does not report"
    compared = f"the less precise of the trainer's compute dtype {_dtype_name(trainer)} and the engine's {held}"
    return max(candidates, key=lambda d: PROBE_TOLERANCE.get(d, 1e-3)), compared


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _compute_dtype(source: WeightSource) -> torch.dtype:
    """The dtype the source's probe logprobs are computed in (a source without `compute_dtype` computes in the
    dtype of its weights)."""
    return getattr(source, "compute_dtype", None) or source.dtype


def verify_sync(engine, source: WeightSource, *, version: int, sent: dict[str, torch.Tensor],
                probe: list[list[int]] | None, sent_rows: dict | None = None,
                info: DistInfo = DistInfo(), probe_images: list | None = None, probe_vision=None) -> dict[str, float]:
    """The checks of `sync_weights` (see there); returns `sync/max_probe_diff`, `sync/mean_probe_diff`,
    `sync/checked_tensors`. On failure the engine's embedding/output projection rows (`sent_rows`, recorded while
    streaming) are read back to name the tensors that disagree. The trainer's probe logprobs come
    first, on every rank (a collective forward under fsdp2/ZeRO-3); an engine with `push_from_main_only` is then
    asked on rank 0 only, and every rank returns rank 0's figures or raises its failure (`sync_ranks.agree`)."""
    keep = [i for i, s in enumerate(probe or []) if len(s) >= 2]
    probe = [list(probe[i]) for i in keep]
    if probe_images is not None:  # the images of the sequences kept, for the engine and for the trainer's forward
        probe_images = [probe_images[i] for i in keep]
        probe_vision = probe_vision.select(keep) if probe_vision is not None else None
    vision = {} if probe_vision is None else {"vision": probe_vision}
    trainer_lp = source.probe_logprobs(probe, **vision) if probe else []

    def check() -> dict[str, float]:
        return _check_engine(engine, _compute_dtype(source), version, sent, probe, trainer_lp, sent_rows,
                             probe_images)

    if not pushes_from_main(engine, info):
        return check()
    result, error = attempt(check) if info.is_main else ({}, None)
    return agree(result, error, info)


def _check_engine(engine, trainer_dtype: torch.dtype, version: int, sent: dict[str, torch.Tensor],
                  probe: list[list[int]], trainer_lp: list[list[float]], sent_rows: dict | None,
                  probe_images: list | None = None) -> dict[str, float]:
    """`verify_sync`'s questions to the engine, judged against the trainer's `trainer_lp` of `probe`, computed in
    `trainer_dtype` (the trainer's compute dtype, not its master weights')."""
    problems: list[str] = []
    if engine.weight_version != version:
        problems.append(f"engine reports weight version {engine.weight_version}, expected {version}")
    checked_what = ["the weight version the engine reports"]
    checked, mismatched = _compare_readback(engine, sent)
    problems += mismatched
    if checked:
        checked_what.append(f"{len(checked)} small tensors read back for exact equality ({', '.join(checked)})")
    out = {"sync/checked_tensors": float(len(checked))}
    # a sleeping colocated engine probes when awake anyway
    if probe and engine.probe_when_awake(lambda p=probe: _check_engine(engine, trainer_dtype, version, {}, p,
                                                                        trainer_lp, sent_rows, probe_images)):
        probe, out["sync/probe_deferred"] = [], 1.0
    if probe:
        images = {} if probe_images is None else {"images": probe_images}
        diffs, scored = _probe_diffs(engine.score(probe, **images), trainer_lp)
        out.update(diffs)
        dtype, compared = _dtype_of(engine, trainer_dtype)
        tol = PROBE_TOLERANCE.get(dtype, 1e-3)
        checked_what.append(f"the logprobs of {scored} probe tokens against the "
                            f"trainer's (mean |diff| ≤ {tol:g} nats/token for {_dtype_name(dtype)})")
        if not scored:  # NaN everywhere: weights that compute NaN, not an engine that skips a few positions
            problems.append("the engine's probe logprobs are all NaN")
        elif out["sync/mean_probe_diff"] > tol:
            problems.append(
                f"probe logprobs differ from the trainer's by {out['sync/mean_probe_diff']:.3g} nats/token on "
                f"average (max {out['sync/max_probe_diff']:.3g}; tolerance {tol:g} for {_dtype_name(dtype)}, "
                f"{compared})"
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


def _probe_diffs(engine_lp: list[list[float]], trainer_lp: list[list[float]]) -> tuple[dict[str, float], int]:
    """Max and mean |engine − trainer| over the positions the engine scored, and how many: an engine answers NaN
    where it scores another token than the sequence's (SGLang at image placeholders, `rollout/sglang/vision.py`)."""
    diffs = torch.tensor([abs(a - b) for e, t in zip(engine_lp, trainer_lp, strict=True)
                          for a, b in zip(e, t, strict=True) if not math.isnan(a)] or [0.0])
    scored = sum(not math.isnan(a) for e in engine_lp for a in e)
    return {"sync/max_probe_diff": float(diffs.max()), "sync/mean_probe_diff": float(diffs.mean())}, scored


def _projection_report(engine, sent_rows: dict) -> str:
    """What reading back the first rows of the embedding and the output projection shows (on failure only:
    reading them costs a copy of the full tensors)."""
    if not sent_rows or not engine.reads_weights:
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
    server = engine.is_server
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
