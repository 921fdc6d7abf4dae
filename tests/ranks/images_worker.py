"""Worker for test_ranks_images: one rank of a 2-process gloo job (group timeout 1 minute) where rank 0's rows carry
images and rank 1's are text only, under fsdp2 and ZeRO-3 (tower frozen) and ddp (tower trained) in turn: the
old-policy and reference passes, then one optimizer step (ddp: then two steps on text rows on both ranks). Each rank
also runs the same passes on one process over both ranks' rows (nothing to agree, no dummy image) as a reference.
Writes to `OUT/rank{r}.json`.

Run as `RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python images_worker.py OUT`."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import torch

from grpo_cli.config.load import build_config
from grpo_cli.data.images import ImageProcessor
from grpo_cli.data.prompts import tokenize_prompts, vision_of
from grpo_cli.data.tasks import draw_shapes
from grpo_cli.models.tiny import resolve_model_path
from grpo_cli.models.vision import is_vision_parameter
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.runtime.dist import DistInfo, init_from_env, shutdown
from grpo_cli.train.batch import build_batch
from grpo_cli.train.loss import compute_loss
from grpo_cli.train.policy import load_policy

BACKENDS = {
    "fsdp2": ["distributed.backend=fsdp2"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3"],
    "ddp": ["distributed.backend=ddp", "model.freeze_vision=false"],
}
REFERENCES = {"frozen": ["distributed.backend=ddp"], "trained": BACKENDS["ddp"]}
"""One process over both ranks' rows, tower frozen (as fsdp2's and ZeRO-3's runs) or trained (as ddp's)."""
G, T = 2, 3


def prompts(path: str, tokenizer):
    """Rank 0's two prompts with one image each, then rank 1's two text-only ones."""
    image = draw_shapes("red", 2, "circle", random.Random(0)).resize((56, 56))
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": f"how many {w} ?"}]}]}
            for w in ("shapes", "circles")]
    rows += [{"prompt": [{"role": "user", "content": [{"type": "text", "text": f"what colour {w} ?"}]}]}
             for w in ("is it", "are they")]
    images = ImageProcessor.load(path, max_pixels=56 * 56)
    return tokenize_prompts(rows, tokenizer, prompt_column="prompt", max_prompt_length=64,
                            overlong_prompts="error", images=images)[0]


def batch_of(prompts_, comps: list[list[int]], pad: int):
    """The rows of `prompts_` (G completions each, `comps` in order), advantages −1 … 1 within each rank's rows."""
    rollout = RolloutBatch([p.ids for p in prompts_], comps, ["stop"] * len(comps),
                           sampler_logprobs=[[-0.5] * T for _ in comps])
    batch = build_batch(rollout, group_size=G, pad_token_id=pad, vision=vision_of(prompts_))
    batch.advantages = torch.linspace(-1, 1, 2 * G).repeat(len(comps) // (2 * G))
    return batch


def full_weights(policy) -> dict[str, torch.Tensor]:
    """Every weight, gathered from shards/partitions (collective)."""
    stats = {"tensors": 0, "bytes": 0, "copies": {}}
    return {n: t.detach().float().clone() for n, t in policy.backend.weight_source().named_tensors(
        bucket_mb=1, stats=stats, keep_copies=set(), keep_rows=set())}


def passes(cfg, policy, batch, num_items: float) -> dict:
    """Old-policy and reference logprobs (no grad), then forward/backward and one optimizer step: each micro-batch's
    loss, the gradient norm, and the weights before and after."""
    backend = policy.backend
    before = full_weights(policy)
    batch.old_logprobs = backend.batch_logprobs(batch, micro_batch_size=2, temperature=1.0)
    batch.ref_logprobs = backend.batch_logprobs(batch, micro_batch_size=2, temperature=1.0, reference=True)

    def loss_fn(mb, logprobs, entropy):
        return compute_loss(
            logprobs=logprobs, old_logprobs=mb.old_logprobs, ref_logprobs=mb.ref_logprobs,
            sampler_logprobs=mb.sampler_logprobs, advantages=mb.advantages, completion_mask=mb.completion_mask,
            algorithm=cfg.algorithm, num_items_in_batch=num_items, num_sequences_in_batch=4 * G,
            max_completion_length=cfg.rollout.max_completion_length, entropy=entropy, truncated=mb.truncated)

    backend.zero_grad()
    per_micro = backend.forward_backward(batch, micro_batch_size=2, temperature=1.0, entropy_grad=False,
                                         loss_fn=loss_fn)
    norm = backend.clip_and_step()
    after = full_weights(policy)
    return {"old": batch.old_logprobs.tolist(), "ref": batch.ref_logprobs.tolist(),
            "losses": [float(m["loss"]) for m in per_micro], "grad_norm": norm,
            "moved": {n: (after[n] - before[n]).tolist() for n in before}}


def run(overrides: list[str], info, path: str, batch, num_items: float, text=None) -> dict:
    """`passes` under `overrides` on `info`'s ranks; with `text` (text-only rows, the tower trained), then two more
    steps on them on every rank: no rank has an image, and ddp's reducer still needs the tower's gradients."""
    cfg = build_config(overrides=[
        "model.name_or_path=builtin:tiny-vlm", f"distributed.num_processes={info.world_size}",
        "algorithm.kl.beta=0.1", "train.micro_batch_size=2", "train.learning_rate=1e-2", "train.max_grad_norm=1e9",
        "train.prompts_per_step=2", f"train.generations_per_prompt={G}", "rollout.mode=server",
        'rollout.server.urls=["http://127.0.0.1:1"]', *overrides])  # no engine is built
    policy = load_policy(cfg, path, device=torch.device("cpu"), info=info)
    out = passes(cfg, policy, batch, num_items)
    if text is not None:
        out["text_norms"] = [passes(cfg, policy, text, num_items)["grad_norm"] for _ in range(2)]
    out["trainable_vision"] = sum(p.requires_grad for n, p in policy.module.named_parameters()
                                  if is_vision_parameter(n))
    return out


def main(out: str) -> None:
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # DeepSpeed asks for it (one machine: the rank)
    info = init_from_env(torch.device("cpu"), timeout_minutes=1)  # a collective mismatch fails within a minute
    path = resolve_model_path("builtin:tiny-vlm")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ps = prompts(path, tok)
    g = torch.Generator().manual_seed(0)
    comps = [torch.randint(10, 40, (T,), generator=g).tolist() for _ in range(len(ps) * G)]
    rows = [batch_of(ps[:2], comps[: 2 * G], tok.pad_token_id), batch_of(ps[2:], comps[2 * G :], tok.pad_token_id)]
    num_items = float(len(comps) * T)
    report = {"has_vision": rows[info.rank].vision is not None}
    for backend in BACKENDS:
        report[backend] = run(BACKENDS[backend], info, path, rows[info.rank], num_items,
                              text=rows[1] if backend == "ddp" else None)
    # one process over both ranks' rows (rank 0's first): no agreement, no dummy image; one reference on each rank
    name = list(REFERENCES)[info.rank]
    report[name] = run(REFERENCES[name], DistInfo(), path, batch_of(ps, comps, tok.pad_token_id), num_items)
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(report))
    shutdown(info)


if __name__ == "__main__":
    main(sys.argv[1])
