"""Worker for test_megatron: one rank of a 2-process gloo job that trains tiny checkpoints with the megatron backend
at tensor_parallel 2, pipeline_parallel 2 and data parallel 2, and the same rows with single-process ddp (on rank
0's side, world size 1), then writes the differences to `OUT/rank{r}.json`.

Every case: 3 GRPO optimizer steps on one fixed batch of 8 rows (left-padded prompts of different lengths, ragged
completions, sampler logprobs, an entropy bonus and a KL term, so the reference model and the entropy gradient are
exercised); rank r holds rows [4r, 4r + 4). Compared: the old-policy and reference logprobs before the first step,
every step's loss and gradient norm, and the updated weights exported under Hugging Face names.

Run as `RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python megatron_worker.py CASES CKPTS OUT`, CASES a
comma-separated list of `arch:layout` (a key of LAYOUTS: tp2, pp2, dp2, dp2_flat = dp2 without the distributed
optimizer, vpp2, recomputation, bf16 variants, ep2 = expert parallel 2 for a MoE arch), CKPTS the folder holding one
checkpoint per arch. Each case also checkpoints after step 1 and resumes a fresh policy from it, exports a Hugging
Face folder, and compares the bucketed weight gather with mbridge's export."""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch

from grpo_cli.config.load import build_config
from grpo_cli.models.tiny import checkpoint_tensors
from grpo_cli.runtime.dist import DistInfo, init_from_env, shutdown
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.loss import trained_mask
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step

ROWS, MICRO, P, T, STEPS = 8, 2, 6, 7, 3
LAYOUTS = {
    "tp2": ["distributed.megatron.tensor_parallel=2"],
    "pp2": ["distributed.megatron.pipeline_parallel=2"],
    "dp2": [],
    "dp2_flat": ["distributed.megatron.distributed_optimizer=false"],
    "tp2_recompute": ["distributed.megatron.tensor_parallel=2", "distributed.megatron.recompute=full"],
    "pp2_selective": ["distributed.megatron.pipeline_parallel=2", "distributed.megatron.recompute=selective"],
    "vpp2": ["distributed.megatron.pipeline_parallel=2", "distributed.megatron.virtual_pipeline=2"],
    "tp2_bf16": ["distributed.megatron.tensor_parallel=2", "model.dtype=bfloat16"],
    "dp2_bf16": ["model.dtype=bfloat16"],
    "dp2_flat_bf16": ["distributed.megatron.distributed_optimizer=false", "model.dtype=bfloat16"],
    "ep2": ["distributed.megatron.expert_parallel=2"],
}


def config(ckpt: str, backend: str, processes: int, *overrides: str):
    return build_config(overrides=[
        f"model.name_or_path={ckpt}", f"distributed.backend={backend}", f"distributed.num_processes={processes}",
        "rollout.engine=vllm", f"train.micro_batch_size={MICRO}", "train.learning_rate=1e-3",
        "train.prompts_per_step=2", "train.generations_per_prompt=4", "algorithm.kl.beta=0.05",
        "algorithm.entropy_coef=0.01", "algorithm.num_iterations=2", f"train.steps={STEPS}", *overrides])


def full_batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(6, vocab, (ROWS, P + T), generator=g)
    prompt_lens = torch.tensor([6, 3, 5, 6, 2, 4, 6, 1])
    comp_lens = torch.randint(1, T + 1, (ROWS,), generator=g)
    cmask = (torch.arange(T)[None, :] < comp_lens[:, None]).float()
    pmask = (torch.arange(P)[None, :] >= (P - prompt_lens)[:, None]).long()
    attn = torch.cat([pmask, cmask.long()], dim=1)
    ids = ids * attn  # padding id 0 (masked out)
    return TrainBatch(ids, attn, cmask, advantages=torch.randn(ROWS, generator=g),
                      sampler_logprobs=-torch.rand(ROWS, T, generator=g) * cmask,
                      truncated=comp_lens == T)


def train(policy, cfg, batch: TrainBatch, *, world_items: float, world_rows: int, save_after: int | None = None,
          folder: Path | None = None) -> dict:
    """Old and reference logprobs, then STEPS optimizer steps (checkpointed into `folder` after `save_after`); the
    per-step loss is this rank's share."""
    backend = policy.backend
    batch.old_logprobs = backend.batch_logprobs(batch, micro_batch_size=MICRO, temperature=cfg.rollout.temperature)
    batch.ref_logprobs = backend.batch_logprobs(batch, micro_batch_size=MICRO, temperature=cfg.rollout.temperature,
                                                reference=True)
    logs = {"old": batch.old_logprobs.tolist(), "ref": batch.ref_logprobs.tolist(), "loss": [], "grad_norm": [],
            "entropy": [], "lr": []}
    for step in range(STEPS):
        if step == save_after and cfg.model.dtype == "float32":
            policy.backend.save_state(folder)
            if policy.backend.info.is_main:
                torch.save(policy.scheduler.state_dict(), folder / "scheduler.pt")
        out = optimizer_step(policy, batch, cfg, num_items=world_items, num_sequences=world_rows)
        logs["loss"].append(out["loss"])
        logs["grad_norm"].append(out["grad_norm"])
        logs["entropy"].append(out["entropy"])
        logs["lr"].append(out["learning_rate"])
    return logs


def items(batch: TrainBatch, cfg) -> float:
    return float(trained_mask(batch.completion_mask, batch.truncated, algorithm=cfg.algorithm).sum())


def reference(ckpt: str, *overrides: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Single-process ddp on all rows."""
    cfg = config(ckpt, "ddp", 1, *overrides)
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=DistInfo())
    batch = full_batch(policy.module.config.vocab_size)
    logs = train(policy, cfg, batch, world_items=items(batch, cfg), world_rows=ROWS)
    return logs, {n: p.detach().clone() for n, p in checkpoint_tensors(policy.module).items()}


def megatron(ckpt: str, layout: str, info, out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = config(ckpt, "megatron", info.world_size, *LAYOUTS[layout])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    masters = exact_masters(policy.backend, ckpt) if cfg.model.dtype != "float32" else None
    full = full_batch(policy.backend.vocab_size)
    share = ROWS // info.world_size
    batch = full.rows(share * info.rank, share * (info.rank + 1))
    folder = out / f"ckpt-{layout}-{Path(ckpt).name}"
    if info.is_main:
        folder.mkdir()
    torch.distributed.barrier()
    logs = train(policy, cfg, batch, world_items=items(full, cfg), world_rows=ROWS, save_after=1, folder=folder)
    logs["masters"] = masters
    logs["resume"] = resume(cfg, ckpt, info, batch, full, folder, logs["loss"][1:]) if cfg.model.dtype == "float32" \
        else None
    logs["buckets"] = bucketed_export(policy.backend)
    logs["numel"] = policy.backend.param_numel()
    export = folder / "hf"
    policy.backend.export_hf(export, dtype=torch.float32)
    weights = policy.backend.trainable_state_dict()
    logs["export_diff"] = exported_diff(export, weights) if info.is_main else 0.0
    return logs, weights


def resume(cfg, ckpt: str, info, batch: TrainBatch, full: TrainBatch, folder: Path, losses: list[float]) -> dict:
    """A fresh policy loaded from the checkpoint written after step 1 repeats steps 2 and 3 exactly."""
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    policy.backend.load_state(folder)
    policy.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    again = []
    for _ in range(STEPS - 1):
        again.append(optimizer_step(policy, batch, cfg, num_items=items(full, cfg), num_sequences=ROWS)["loss"])
    return {"loss_diff": diff(again, losses), "learning_rate": policy.backend.learning_rate()}


def bucketed_export(backend) -> dict:
    """The bucketed gather (`hf_tensor_buckets`) against mbridge's per-tensor export, at a cap smaller than most
    tensors and at the default: the same names and bit-identical tensors, one broadcast / all-gather per stage and
    bucket, and no bucket above the cap unless one tensor is."""
    reference = {}
    for name, tensor in backend.bridge.export_weights(backend.chunks):
        reference.setdefault(name, tensor.detach().clone())
    out = {}
    for cap in (0.05, 512):
        stats: dict = {}
        got = {}
        for bucket in backend.hf_tensor_buckets(bucket_mb=cap, stats=stats):
            got.update(bucket)
        out[str(cap)] = {
            "identical": sorted(got) == sorted(reference) and all(torch.equal(got[k], reference[k]) for k in got),
            "buckets": stats["buckets"], "collectives": stats.get("collectives", 0),
            "largest": stats["largest_bucket"], "largest_tensor": stats["largest_tensor"], "cap": cap * 2**20}
    return out


def exported_diff(folder: Path, weights: dict[str, torch.Tensor]) -> float:
    """The consolidated folder loads with transformers and holds the trained weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = checkpoint_tensors(model)
    return max(diff(state[k], v) for k, v in weights.items())


def exact_masters(backend, ckpt: str) -> dict:
    """bf16 runs: every float32 main weight (or this rank's shard of it) equals the checkpoint's float32 value, not
    its bf16 rounding (read through a float32 twin of the same layout)."""
    from mbridge.core.util import unwrap_model

    from grpo_cli.train.backends.megatron import build
    from grpo_cli.train.backends.megatron.bridge import make_bridge

    bridge = make_bridge(ckpt, dtype=torch.float32, vocab_multiple=None, overrides=build.transformer_overrides(
        backend.cfg))
    twin = build.build_chunks(bridge, backend.device, trainable=False)
    bridge.load_weights(twin, ckpt)
    masters = build.master_weights(backend.optimizer)
    worst, rounded, count = 0.0, 0.0, 0
    for chunk, twin_chunk in zip(backend.chunks, twin):
        values = dict(unwrap_model(twin_chunk).named_parameters())
        for name, p in unwrap_model(chunk).named_parameters():
            if id(p) not in masters:  # distributed optimizer: another data-parallel rank holds all of it
                continue
            main, (start, stop) = masters[id(p)]
            want = values[name].reshape(-1)[start:stop]
            worst = max(worst, float((main.reshape(-1) - want).abs().max()))
            rounded = max(rounded, float((main.reshape(-1) - p.detach().float().reshape(-1)[start:stop]).abs().max()))
            count += 1
    return {"max_diff": worst, "bf16_rounding": rounded, "tensors": count}


def initial_weights(ckpt: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(ckpt) / "model.safetensors"))


def diff(a, b) -> float:
    return float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())


def main(cases: str, ckpts: str, out: str) -> None:
    from grpo_cli.train.backends.megatron import logprobs as megatron_logprobs

    warnings.filterwarnings("ignore")
    # 3 head chunks per micro-batch of 14 positions (the tiny vocabulary fits one; Qwen's would not): each chunk's
    # tensor-parallel all-reduces and the float32 sum of the chunks' weight gradients face ddp's full logits
    megatron_logprobs.chunk_rows = lambda vocab, *, device: 5
    info = init_from_env(torch.device("cpu"), timeout_minutes=5)
    results: dict = {}
    refs: dict = {}
    for case in cases.split(","):
        arch, layout = case.split(":")
        ckpt = str(Path(ckpts) / arch)
        dtype = "bfloat16" if layout.endswith("bf16") else "float32"
        if (arch, dtype) not in refs:
            refs[arch, dtype] = reference(ckpt, f"model.dtype={dtype}")
        ref_logs, ref_weights = refs[arch, dtype]
        start = time.perf_counter()
        logs, weights = megatron(ckpt, layout, info, Path(out))
        share = ROWS // info.world_size
        mine = slice(share * info.rank, share * (info.rank + 1))
        losses = torch.tensor(logs["loss"], dtype=torch.float64)
        torch.distributed.all_reduce(losses)  # each rank's share → the step loss
        entropy = torch.tensor(logs["entropy"], dtype=torch.float64)
        torch.distributed.all_reduce(entropy)  # the mean over ranks, as the loop's `mean_metrics`
        initial = initial_weights(ckpt)
        tied_extra = sorted(set(ref_weights) - set(weights))
        results[case] = {
            "seconds": time.perf_counter() - start,
            "old": diff(logs["old"], torch.tensor(ref_logs["old"])[mine]),
            "ref": diff(logs["ref"], torch.tensor(ref_logs["ref"])[mine]),
            "loss": diff(losses, ref_logs["loss"]),
            "grad_norm": diff(logs["grad_norm"], ref_logs["grad_norm"]),
            "entropy": diff(entropy / info.world_size, ref_logs["entropy"]),
            "weights": max(diff(weights[k], ref_weights[k]) for k in weights),
            "moved": min(diff(weights[k], initial[k]) for k in weights),
            "names_missing": [k for k in tied_extra if k != "lm_head.weight"],
            "names_extra": sorted(set(weights) - set(ref_weights)),
            "losses": logs["loss"],
            "norms": [logs["grad_norm"], ref_logs["grad_norm"]],
            "masters": logs["masters"],
            "resume": logs["resume"],
            "export_diff": logs["export_diff"],
            "buckets": logs["buckets"],
            "lr": diff(logs["lr"], ref_logs["lr"]),
            "numel": [*logs["numel"], sum(t.numel() for t in weights.values())],
        }
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps(results))
    shutdown(info)


if __name__ == "__main__":
    main(*sys.argv[1:])
