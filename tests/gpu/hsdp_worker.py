"""Worker for test_gpu_hsdp: HSDP's code path in one process on the GPU (or the CPU under GRPO_GPU_SUITE_ON_CPU=1).
fsdp2 on a 1 x 1 mesh made by `hsdp_mesh` (subgroups of the `cpu:gloo,cuda:nccl` group; the R > 1 shapes need more
GPUs than a lent machine has), with and without `cpu_offload`: the rows read from the checkpoint, a bf16 step with
clipping, the weight-sync gather in the shard group on the training device, DCP save and load into a fresh policy.

Run as `python hsdp_worker.py CKPT OUT DEVICE`; writes OUT/result.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from grpo_cli.config.load import build_config
from grpo_cli.runtime.dist import DistInfo, ensure_process_group, release_own_group
from grpo_cli.train.backends.fsdp2 import FSDP2Backend
from grpo_cli.train.backends.hsdp import hsdp_mesh
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step
from grpo_cli.train.weights.hf_module import stream_named_tensors

ROWS, P, T = 4, 5, 7


def batch_for(vocab: int, device: torch.device) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, vocab, (ROWS, P + T), generator=g)
    cmask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (ROWS,), generator=g)[:, None]).float()
    attn = torch.cat([torch.ones(ROWS, P, dtype=torch.long), cmask.long()], dim=1)
    return TrainBatch(ids, attn, cmask, advantages=torch.randn(ROWS, generator=g),
                      sampler_logprobs=-torch.rand(ROWS, T, generator=g) * cmask).to(device)


def full_state(policy) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in policy.module.named_parameters():
        out[n] = p.full_tensor().detach().float().cpu()
        out.update({f"{n}:{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).float().cpu()
                    for k, v in policy.optimizer.state[p].items()})
    return out


def case(ckpt: str, device: torch.device, offload: bool, folder: Path) -> dict:
    cfg = build_config(overrides=[
        f"model.name_or_path={ckpt}", "distributed.backend=fsdp2", "rollout.engine=vllm",
        f"distributed.device={device.type}", "model.dtype=bfloat16", "train.max_grad_norm=0.05",
        "train.learning_rate=1e-3", "train.prompts_per_step=1", f"train.generations_per_prompt={ROWS}",
        f"train.micro_batch_size={ROWS // 2}", f"distributed.fsdp2.cpu_offload={str(offload).lower()}"])
    policy = load_policy(cfg, ckpt, device=device, info=DistInfo())
    param = next(policy.module.parameters())
    weights = load_file(str(Path(ckpt) / "model.safetensors"))
    read = all(torch.equal(p.full_tensor().float().cpu(), weights[n].float())
               for n, p in policy.module.named_parameters() if n in weights)
    batch = batch_for(policy.module.config.vocab_size, device)
    out = optimizer_step(policy, batch, cfg, num_items=float(batch.completion_mask.sum()), num_sequences=ROWS)
    stats = {"tensors": 0, "bytes": 0, "copies": {}}
    sent = dict(stream_named_tensors(policy.module, bucket_mb=1, peft=False, stats=stats, keep_copies=set(),
                                     dtype=torch.bfloat16, device=device))
    synced = all(torch.equal(sent[n].cpu(), p.full_tensor().to(torch.bfloat16).cpu())
                 for n, p in policy.module.named_parameters())
    policy.backend.save_state(folder)
    fresh = load_policy(cfg, ckpt, device=device, info=DistInfo())
    fresh.backend.load_state(folder)
    before, after = full_state(policy), full_state(fresh)
    return {"placements": [str(p) for p in param.placements], "mesh_device": param.device_mesh.device_type,
            "shard_backend": str(dist.get_backend(param.device_mesh.get_group(1))),
            "local_device": param.to_local().device.type, "read_rows": read,
            "grad_norm": out["grad_norm"], "loss": out["loss"], "synced": synced,
            "sent_device": next(iter(sent.values())).device.type,
            "resumed": all(torch.equal(before[k], after[k]) for k in before)}


def main(ckpt: str, out: str, device_type: str) -> None:
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ensure_process_group(device, timeout_minutes=2)
    mesh = hsdp_mesh(device, replicas=1, shard=1, timeout_minutes=2)
    FSDP2Backend._mesh = property(lambda self: mesh)  # R = 1 builds no HSDP mesh; one GPU can hold only 1 x 1
    result = {name: case(ckpt, device, offload, Path(out) / name)
              for name, offload in (("plain", False), ("cpu_offload", True))}
    Path(out, "result.json").write_text(json.dumps(result))
    release_own_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
