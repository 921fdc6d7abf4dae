"""Worker for test_hsdp: one rank of a 4-process gloo job (1-minute collective timeout) that trains the tiny model
under plain fsdp2 (a 1-D mesh of 4) and under HSDP (`distributed.fsdp2.replicate=2`: 2 replicas x 2 shard ranks) and
writes what it measured to `OUT/rank{r}.json`.

- parity: two optimizer steps (2 micro-batches each, gradient clipping active) on per-rank batches, the HSDP run's
  training state offloaded to fresh host storage and back between them (`distributed.offload`, forced on CPU); the
  losses, gradient norms and full parameters of both, and the same for a LoRA adapter (one step).
- sync: `stream_named_tensors` of the HSDP policy against `full_tensor()`, all-gathers counted (one per bucket) and
  run in the shard group (2 ranks).
- resume: a checkpoint written at R=2 is loaded at R=1 and one written at R=1 is loaded at R=2 (`save_checkpoint` /
  `load_checkpoint`); the loaded weights and AdamW state against the writer's.
- export: the HSDP policy's consolidated Hugging Face folder (`export_hf`) against its full parameters.

Run as `RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python hsdp_worker.py CKPT OUT`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from grpo_cli.config.load import build_config
from grpo_cli.runtime.dist import all_reduce_sum, init_from_env, shutdown
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.checkpoint import load_checkpoint, save_checkpoint
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step
from grpo_cli.train.weights.hf_module import buckets, stream_named_tensors
from grpo_cli.train.weights.offload import TrainingStateOffload

WORLD, ROWS, MICRO, P, T = 4, 4, 2, 5, 7  # per rank: 2 micro-batches of 2
# lr 1e-3: AdamW normalises each gradient, so a weight whose gradient is near 0 moves by ~lr whatever the gradient's
# last bits; the two meshes sum the ranks' gradients in different orders (4 at once vs 2 then 2), and at lr 1e-2 that
# rounding reached 9e-7 on a few weights. At 1e-3 the steps still move weights by ~1e-3, far above the 1e-6 bound.
LORA = "model.lora={r: 4, alpha: 8.0}"


def config(ckpt: str, replicate: int, *overrides: str):
    return build_config(overrides=[
        f"model.name_or_path={ckpt}", "distributed.backend=fsdp2", "rollout.engine=vllm",
        f"distributed.num_processes={WORLD}", f"distributed.fsdp2.replicate={replicate}",
        "distributed.timeout_minutes=1", f"train.micro_batch_size={MICRO}", "train.learning_rate=1e-3",
        "train.max_grad_norm=0.05", "train.prompts_per_step=4", f"train.generations_per_prompt={ROWS}", *overrides])


def batch_for(rank: int, vocab: int, step: int) -> TrainBatch:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(6, vocab, (ROWS, P + T), generator=g)
    cmask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (ROWS,), generator=g)[:, None]).float()
    attn = torch.cat([torch.ones(ROWS, P, dtype=torch.long), cmask.long()], dim=1)
    return TrainBatch(ids, attn, cmask, advantages=torch.randn(ROWS, generator=g),
                      sampler_logprobs=-torch.rand(ROWS, T, generator=g) * cmask)


def step(policy, cfg, rank: int, n: int) -> dict[str, float]:
    batch = batch_for(rank, policy.module.config.vocab_size, n)
    num_items = all_reduce_sum(float(batch.completion_mask.sum()), policy.backend.info)
    out = optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=WORLD * ROWS)
    return {"loss": out["loss"], "grad_norm": out["grad_norm"]}


def full(tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def state_of(policy) -> dict[str, torch.Tensor]:
    """Full parameters (trained ones) and AdamW state, by parameter name."""
    out = {}
    for n, p in policy.module.named_parameters():
        if p.requires_grad:
            out[f"param:{n}"] = full(p)
            out.update({f"opt:{n}:{k}": full(v) for k, v in policy.optimizer.state[p].items()})
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def train(ckpt: str, rank: int, info, replicate: int, *extra: str, steps: int = 2, offload: bool = False):
    cfg = config(ckpt, replicate, *extra)
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    initial = {k: v for k, v in state_of(policy).items() if k.startswith("param:")}
    stats = [step(policy, cfg, rank, 0)]
    if offload:  # fresh host storage and back: what a GPU run does around generation
        mover = TrainingStateOffload(policy.model, policy.optimizer, optimizer_state=True, grads=True, params=True,
                                     force=True)
        mover.offload()
        mover.reload()
    stats += [step(policy, cfg, rank, n) for n in range(1, steps)]
    moved = max_diff(initial, {k: v for k, v in state_of(policy).items() if k.startswith("param:")})
    return cfg, policy, {"steps": stats, "moved": moved}


def parity(ckpt: str, rank: int, info) -> tuple[dict, tuple]:
    _, plain, plain_stats = train(ckpt, rank, info, 1)
    cfg, hsdp, hsdp_stats = train(ckpt, rank, info, 2, offload=True)
    param = next(hsdp.module.parameters())
    out = {"plain": plain_stats, "hsdp": hsdp_stats, "placements": [str(p) for p in param.placements],
           "mesh": param.device_mesh.mesh.tolist(), "local_rows": param.to_local().shape[0],
           "rows": param.shape[0], "diff": max_diff(state_of(plain), state_of(hsdp))}
    _, lora_plain, lora_plain_stats = train(ckpt, rank, info, 1, LORA, steps=1)
    _, lora_hsdp, lora_hsdp_stats = train(ckpt, rank, info, 2, LORA, steps=1)
    out["lora"] = {"plain": lora_plain_stats, "hsdp": lora_hsdp_stats,
                   "diff": max_diff(state_of(lora_plain), state_of(lora_hsdp))}
    return out, (cfg, hsdp, plain)


def sync(policy) -> dict:
    """One cap (0.05 MB: several buckets); all-gathers counted with the size of their group."""
    reference = {n: full(p) for n, p in policy.module.named_parameters()}
    calls, real = [], dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
    name = real.__name__

    def counted(output, input, *args, group=None, **kw):
        calls.append(dist.get_world_size(group))
        return real(output, input, *args, group=group, **kw)

    setattr(dist, name, counted)
    try:
        got = dict(stream_named_tensors(policy.module, bucket_mb=0.05, peft=False, stats={"tensors": 0, "bytes": 0,
                                        "copies": {}}, keep_copies=set()))
    finally:
        setattr(dist, name, real)
    named = list(policy.module.named_parameters())
    return {"identical": all(torch.equal(got[n], reference[n]) for n in reference), "group_sizes": calls,
            "buckets": len(list(buckets(named, int(0.05 * 2**20))))}


def export(policy, folder: Path, rank: int) -> dict:
    """The final-model export (`export_hf`, float32: the masters exactly) of the HSDP policy, read back on rank 0."""
    from safetensors.torch import load_file

    policy.backend.export_hf(folder, dtype=torch.float32)
    params = {n: full(p) for n, p in policy.module.named_parameters()}  # collective: every rank
    if rank != 0:
        return {}
    saved = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    return {"tensors": len(saved), "identical": all(torch.equal(saved[n], t) for n, t in params.items() if n in saved),
            "missing": sorted(n for n in params if n not in saved and n != "lm_head.weight")}


def resume(ckpt: str, rank: int, info, written: tuple, root: Path) -> dict:
    """Each writer's checkpoint loaded into a fresh policy of the other R."""
    cfg_hsdp, hsdp, plain = written
    cfg_plain = config(ckpt, 1)
    out = {}
    for name, (writer, cfg_w, cfg_r) in {"2to1": (hsdp, cfg_hsdp, cfg_plain), "1to2": (plain, cfg_plain, cfg_hsdp)}.items():
        path = save_checkpoint(root / name, step=2, cfg=cfg_w, policy=writer, trainer_state={}, keep_last=1)
        reader = load_policy(cfg_r, ckpt, device=torch.device("cpu"), info=info)
        load_checkpoint(path, cfg=cfg_r, policy=reader)
        out[name] = {"diff": max_diff(state_of(writer), state_of(reader)),
                     "reader_mesh": next(reader.module.parameters()).device_mesh.ndim,
                     "steps": sorted({int(s["step"]) for s in reader.optimizer.state.values()})}
    return out


def main(ckpt: str, out: str) -> None:
    info = init_from_env(torch.device("cpu"), timeout_minutes=1)
    res, written = parity(ckpt, info.rank, info)
    res["sync"] = sync(written[1])
    res["resume"] = resume(ckpt, info.rank, info, written, Path(out))
    res["export"] = export(written[1], Path(out) / "export", info.rank)
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps(res))
    shutdown(info)


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
