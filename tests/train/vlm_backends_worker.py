"""Worker for test_vlm_backends: one rank of a 2-process gloo job that trains the built-in tiny VLM
(`builtin:tiny-vlm`, vision tower frozen by default) for one optimizer step under each backend in turn (fsdp2,
ZeRO-2, ZeRO-3; one launch: the imports and the group are paid once) on rows whose prompts carry an image, then
writes to `OUT/rank{r}.json`, per backend: whether each vision block and decoder layer is its own FSDP2 unit
(fsdp2), the largest change of any vision-tower weight (gathered full tensors, before/after: 0 when frozen) and of
the language model's, and the names the weight-sync stream gives.

Run as `RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python vlm_backends_worker.py OUT`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from PIL import Image

from grpo_cli.config.load import build_config
from grpo_cli.data.images import ImageProcessor
from grpo_cli.models.tiny import resolve_model_path
from grpo_cli.models.vision import VisionInputs, is_vision_parameter
from grpo_cli.runtime.dist import all_reduce_sum, init_from_env, shutdown
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step

BACKENDS = {
    "fsdp2": ["distributed.backend=fsdp2"],
    "zero2": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=2"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3"],
}
ROWS, T = 4, 3


def batch(path: str, tokenizer, rank: int) -> TrainBatch:
    """ROWS rows of [prompt with one 56×56 image | T completion tokens], the prompt expanded as the processor does."""
    proc = ImageProcessor.load(path, max_pixels=56 * 56)
    g = torch.Generator().manual_seed(rank)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count red"}]}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    rows, parts = [], []
    for r in range(ROWS):
        image = Image.new("RGB", (56, 56), (40 * r + 60 * rank, 200, 30))
        vision = proc.encode([image])
        rows.append(proc.expand(list(prompt), vision, where="row") + torch.randint(10, 40, (T,), generator=g).tolist())
        parts.append(vision)
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids)
    cmask = torch.ones(ROWS, T)
    return TrainBatch(ids, mask, cmask, advantages=torch.linspace(-1, 1, ROWS),
                      sampler_logprobs=-torch.rand(ROWS, T, generator=g), vision=VisionInputs.cat(parts))


def full_weights(policy) -> dict[str, torch.Tensor]:
    """Every weight as the weight sync streams it (gathered from shards/partitions: collective)."""
    stats = {"tensors": 0, "bytes": 0, "copies": {}}
    source = policy.backend.weight_source()
    return {n: t.detach().float().clone() for n, t in source.named_tensors(bucket_mb=1, stats=stats,
                                                                          keep_copies=set(), keep_rows=set())}


def one_backend(backend: str, info, path: str) -> dict:
    cfg = build_config(overrides=["model.name_or_path=builtin:tiny-vlm", "distributed.num_processes=2",
                                  "algorithm.kl.beta=0.0", "train.micro_batch_size=2", "train.learning_rate=1e-2",
                                  "train.prompts_per_step=2", "train.generations_per_prompt=4", "rollout.mode=server",
                                  'rollout.server.urls=["http://127.0.0.1:1"]', *BACKENDS[backend]])  # no engine built
    policy = load_policy(cfg, path, device=torch.device("cpu"), info=info)
    report: dict = {}
    if backend == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        units: dict[str, list[bool]] = {"Qwen2VLVisionBlock": [], "Qwen2VLDecoderLayer": []}
        for m in policy.module.modules():  # fully_shard swaps each class for an FSDP subclass of it
            for name in units.keys() & {c.__name__ for c in type(m).__mro__}:
                units[name].append(isinstance(m, FSDPModule))
        report["units"] = units
    before = full_weights(policy)
    b = batch(path, policy.tokenizer, info.rank)
    num_items = all_reduce_sum(float(b.completion_mask.sum()), info)
    optimizer_step(policy, b, cfg, num_items=num_items, num_sequences=2 * ROWS)
    after = full_weights(policy)
    diff = {n: float((after[n] - before[n]).abs().max()) for n in before}
    report.update(
        names=sorted(before),
        vision_change=max(d for n, d in diff.items() if is_vision_parameter(n)),
        language_change=max(d for n, d in diff.items() if not is_vision_parameter(n)),
        trainable_vision=sum(p.requires_grad for n, p in policy.module.named_parameters() if "visual" in n))
    return report


def main(out: str) -> None:
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # DeepSpeed asks for it (one machine: the rank)
    info = init_from_env(torch.device("cpu"), timeout_minutes=5)
    path = resolve_model_path("builtin:tiny-vlm")
    report = {backend: one_backend(backend, info, path) for backend in BACKENDS}
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(report))
    shutdown(info)


if __name__ == "__main__":
    main(sys.argv[1])
