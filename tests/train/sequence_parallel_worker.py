"""Worker for test_sequence_parallel: one rank of a 2-process gloo job. On a tiny Qwen3 (tied embeddings, one K/V head
for two query heads: Ulysses repeats it) it computes, for each combination of style (Ulysses with the packed layout,
Ulysses with causal chunks, ring with the fused CPU blocks and with the hand-written ones), loss (grpo with KL, dapo with an entropy bonus, gspo, cispo), LoRA and one
sequence, the logprobs, entropy, loss and gradients of one micro-batch whole (one process's computation, no
collective) and cut across the 2 ranks (`models.sequence_logprobs`), and writes the largest differences. Then one
optimizer step's reduced gradients through the ddp and fsdp2 backends at sequence_parallel.size=2 (ddp with
Ulysses, fsdp2 with ring; token-budget micro-batches, the ranks' batches gathered, KL to the reference) against the
whole batch's, the no-grad passes' logprobs (policy, reference), and a step where one shard predicts no token; fsdp2
(the group is the whole mesh) runs its embedding and output layer vocabulary-parallel (`models.vocab_parallel`),
untied (llama) and tied (qwen3), once after a plain forward that left their unit gathered, and under bf16 compute.

Run as `RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python sequence_parallel_worker.py LLAMA OUT` (LLAMA:
the tiny Llama checkpoint, untied output layer, which the backend steps train)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from grpo_cli.config.load import build_config
from grpo_cli.models.logprobs import completion_logprobs_entropy
from grpo_cli.models.sequence_attention import SequenceShard
from grpo_cli.models import sequence_logprobs
from grpo_cli.models.sequence_logprobs import sharded_logprobs_entropy
from grpo_cli.models.tiny import build_tiny_checkpoint
from grpo_cli.runtime.dist import init_from_env, shutdown
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.loss import compute_loss
from grpo_cli.train.sequence_parallel import gather_batch

LOSSES = {
    "grpo": ["algorithm.loss=grpo", "algorithm.kl.beta=0.1"],
    "dapo": ["algorithm.loss=dapo", "algorithm.entropy_coef=0.01"],
    "gspo": ["algorithm.loss=gspo"],
    "cispo": ["algorithm.objective.kind=cispo"],
}
G, P, T = 3, 5, 9
KL_DAPO = ["algorithm.loss=dapo", "algorithm.kl.beta=0.1"]


def make_batch(seed: int, vocab: int) -> TrainBatch:
    """2 prompts × G completions: left-padded prompts of 5 and 3 tokens, completions of 1..9 tokens (the first group
    runs past the middle of the packed row) with a run of environment tokens (mask 0, a multi-turn rollout) in one; an
    odd packed length (not a multiple of 2)."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * G
    ids = torch.randint(6, vocab, (rows, P + T), generator=g)
    ids[G:, :P] = ids[G, :P]
    ids[:G, :P] = ids[0, :P]
    attn = torch.zeros(rows, P + T, dtype=torch.long)
    attn[:G, :P], attn[G:, P - 3 : P] = 1, 1
    widths = [9, 8, 3, 7, 2, 6] if seed == 0 else [5, 9, 3, 8, 1, 2]
    cmask = torch.zeros(rows, T)
    for b, w in enumerate(widths):
        attn[b, P : P + w], cmask[b, :w] = 1, 1.0
    cmask[3, 2:4] = 0.0  # environment tokens
    return TrainBatch(ids, attn, cmask, advantages=torch.randn(rows, generator=g),
                      old_logprobs=-torch.rand(rows, T, generator=g) * cmask,
                      ref_logprobs=-torch.rand(rows, T, generator=g) * cmask,
                      sampler_logprobs=-torch.rand(rows, T, generator=g) * cmask)


def load(ckpt: str, lora: bool):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.attention import attention_implementation

    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation=attention_implementation("sdpa"))
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    return model


def loss_and_grads(model, batch, cfg, stats):
    """(logprobs, entropy, loss, {name: grad}) of `stats(model, batch)` → (logprobs, entropy) and the loss on them."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = stats(model, batch)
    loss, _ = compute_loss(
        logprobs=logprobs, old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs,
        sampler_logprobs=batch.sampler_logprobs, advantages=batch.advantages, completion_mask=batch.completion_mask,
        algorithm=cfg.algorithm, num_items_in_batch=float(batch.completion_mask.sum()),
        num_sequences_in_batch=len(batch), max_completion_length=T, entropy=entropy)
    return logprobs.detach(), entropy.detach(), loss.detach(), loss


def one_sequence(seed: int, vocab: int) -> TrainBatch:
    """One row, a whole prompt and a completion of 8 tokens (13 positions): Ulysses' plain causal attention."""
    batch = make_batch(seed, vocab).rows(0, 1)
    batch.attention_mask[0, P + 8 :], batch.completion_mask[0, 8:] = 0, 0.0
    return batch


def combination(ckpt: str, shard: SequenceShard, loss_name: str, lora: bool, batch_of=make_batch) -> dict:
    cfg = build_config(overrides=LOSSES[loss_name])
    model = load(ckpt, lora)
    batch = batch_of(0, model.config.vocab_size)
    grad = cfg.algorithm.entropy_coef > 0
    kw = dict(logits_to_keep=T, temperature=0.7, entropy_grad=grad)

    def whole(m, b):
        return completion_logprobs_entropy(m, b.input_ids, b.attention_mask, **kw)

    def cut(m, b):
        return sharded_logprobs_entropy(m, b.input_ids, b.attention_mask, with_entropy=True, shard=shard, **kw)

    out = {}
    lp, ent, loss, graph = loss_and_grads(model, batch, cfg, whole)
    graph.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    lp2, ent2, loss2, graph2 = loss_and_grads(model, batch, cfg, cut)
    (graph2 / shard.size).backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=shard.group)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    out["logprobs"] = float((lp - lp2).abs().max())
    out["entropy"] = float((ent - ent2).abs().max())
    out["loss"] = abs(float(loss - loss2))
    out["grads"] = max(float((ref[n] - got[n]).abs().max()) for n in ref)
    out["grad_scale"] = max(float(g.abs().max()) for g in ref.values())
    out["names"] = sorted(ref) == sorted(got)
    return out


def uneven_batch(seed: int, vocab: int) -> TrainBatch:
    """Rank 0: `make_batch`'s 6 rows; rank 1: its second group only, cut to its own padding (3 rows, prompt 3
    columns, completions 8): the gather widens rank 1's rows to 5 + 9 columns."""
    batch = make_batch(seed, vocab)
    return batch if seed == 0 else batch.select([3, 4, 5])


def short_batch(seed: int, vocab: int) -> TrainBatch:
    """One prompt of P tokens and 2 one-token completions: packed [prompt | c₁ | c₂], 7 positions cut 4 + 4, so the
    first shard holds prompt positions only and predicts no token (the head runs on a dummy position)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (1, P + T), generator=g).expand(2, -1).clone()
    ids[1, P] = (ids[0, P] + 1) % vocab
    cmask = torch.zeros(2, T)
    cmask[:, 0] = 1.0
    attn = torch.cat([torch.ones(2, P, dtype=torch.long), cmask.long()], dim=1)
    return TrainBatch(ids, attn, cmask, advantages=torch.tensor([1.0, -1.0]),
                      old_logprobs=-torch.rand(2, T, generator=g) * cmask, ref_logprobs=-torch.rand(2, T) * cmask)


def backend_step(ckpt: str, backend: str, style: str, info, *, batch_of=make_batch, rows: str = "",
                 group: int = G, gathered: bool = False, dtype: str = "float32") -> dict:
    """One step's reduced gradients at sequence_parallel.size=2 (each rank's own batch gathered; budgeted
    micro-batches, or `rows` per micro-batch) against the whole gathered batch's gradient computed in this process
    alone; and the no-grad logprobs of the policy and the KL reference (`batch_logprobs`, old/ref passes).
    `gathered` (fsdp2): before the step, a plain forward of the whole batch (the model called as it is, not cut)
    leaves the vocabulary unit gathered, so the step's first micro-batch takes the whole-weight path. `dtype`:
    `model.dtype` (bfloat16: FSDP2's mixed precision, float32 masters; the vocabulary rows are cast to it)."""
    from grpo_cli.train.policy import load_policy
    from grpo_cli.train.step import optimizer_step

    micro = [f"train.micro_batch_size={rows}"] if rows else ["train.micro_batch_tokens=24"]
    cfg = build_config(overrides=[
        f"model.name_or_path={ckpt}", f"distributed.backend={backend}", "rollout.engine=vllm",
        "distributed.num_processes=2", "distributed.sequence_parallel.size=2", *micro,
        "train.prompts_per_step=2", f"train.generations_per_prompt={group}", *KL_DAPO,
        f"distributed.sequence_parallel.style={style}",
        "data.max_prompt_length=5", f"rollout.max_completion_length={T}", f"model.dtype={dtype}"])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    run = policy.backend
    own = batch_of(info.rank, policy.module.config.vocab_size)
    whole = gather_batch(own, run.sequence, pad_token_id=0)
    grads: dict[str, torch.Tensor] = {}
    step = run.clip_and_step

    def clip_and_step():
        grads.update({n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
                      for n, p in policy.module.named_parameters() if (g := p.grad) is not None})
        return step()

    run.clip_and_step = clip_and_step
    calls = {"_vocab_parallel": 0, "_own_positions": 0}
    paths = {name: getattr(sequence_logprobs, name) for name in calls}
    rows_dtypes = set()

    def counted(name):
        def call(*args, **kw):
            calls[name] += 1
            if name == "_vocab_parallel":  # (model, cut, slots, embedding rows, output rows, shard)
                rows_dtypes.update({str(args[3].local.dtype), str(args[4].local.dtype)})
            return paths[name](*args, **kw)
        return call

    for name in calls:
        setattr(sequence_logprobs, name, counted(name))
    passes = [run.batch_logprobs(whole, micro_batch_size=cfg.train.micro_batch_size, temperature=1.0, reference=r)
              for r in (False, True)]
    plain = None
    if gathered:
        with torch.no_grad():
            plain = completion_logprobs_entropy(policy.module, whole.input_ids, whole.attention_mask,
                                                logits_to_keep=T, temperature=1.0, entropy_grad=False)[0]
    before_step = dict(calls)
    num_items = float(whole.completion_mask.sum())
    optimizer_step(policy, whole, cfg, num_items=num_items, num_sequences=len(whole))
    for name, path in paths.items():
        setattr(sequence_logprobs, name, path)
    embedding = policy.module.get_input_embeddings().weight
    model = load(ckpt, lora=False)
    lp, _, _, graph = loss_and_grads(model, whole, build_config(overrides=KL_DAPO), lambda m, b: (
        completion_logprobs_entropy(m, b.input_ids, b.attention_mask, logits_to_keep=T, temperature=1.0,
                                    entropy_grad=False)))
    graph.backward()
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    mine = lp[len(whole) - len(own) :] if info.rank else lp[: len(own)]  # this rank's rows, widened by the gather
    alone = completion_logprobs_entropy(model, own.input_ids, own.attention_mask, entropy_grad=False, temperature=1.0,
                                        logits_to_keep=own.num_completion_tokens)[0].detach()
    steps = own.num_completion_tokens
    widened = float((mine[:, :steps] - alone).abs().max() + mine[:, steps:].abs().sum())
    return {"rows": len(whole), "grads": max(float((ref[n] - grads[n]).abs().max()) for n in ref),
            "names": sorted(ref) == sorted(grads), "logprobs": max(float((lp - got).abs().max()) for got in passes),
            "widened": widened, "paths": calls, "step_paths": {k: v - before_step[k] for k, v in calls.items()}, "rows_dtypes": sorted(rows_dtypes), "plain": None if plain is None else float((plain - lp).abs().max()),
            "embedding_sharded": hasattr(embedding, "placements"),
            "tied": policy.module.get_output_embeddings().weight is embedding}


def main(llama: str, out: str) -> None:
    info = init_from_env(torch.device("cpu"), timeout_minutes=1)
    torch.manual_seed(0)
    ckpt = str(build_tiny_checkpoint(Path(out) / f"qwen3-{info.rank}", arch="qwen3", seed=3))
    group = dist.new_group([0, 1])
    res: dict = {}
    from grpo_cli.models import ring_attention, sequence_attention

    ring_attention.SCORES = 2 * 23 * 5  # ring's query chunks of 5 rows (2 heads x 23 keys): several per block
    layout_pays = sequence_logprobs.layout_pays
    for style in ("ulysses", "ulysses-chunks", "ring", "ring-math"):
        shard = SequenceShard(group, 2, info.rank, style.split("-")[0], (0, 1))
        if style == "ulysses-chunks":  # Ulysses' other inner attention, queries 7 at a time (46 positions)
            sequence_logprobs.layout_pays, sequence_attention.MASK = (lambda packing: False), 46 * 7
        ring_attention.FUSED = style != "ring-math"  # ring's hand-written blocks (CUDA's path) on the CPU too
        for loss_name in LOSSES:
            res[f"{style}/{loss_name}"] = combination(ckpt, shard, loss_name, lora=False)
        res[f"{style}/dapo+lora"] = combination(ckpt, shard, "dapo", lora=True)
        res[f"{style}/one-sequence"] = combination(ckpt, shard, "dapo", lora=False, batch_of=one_sequence)
        sequence_logprobs.layout_pays = layout_pays
    ring_attention.FUSED = True
    for backend, style in (("ddp", "ulysses"), ("fsdp2", "ring")):  # llama: untied head, K/V heads split by Ulysses
        res[f"backend/{backend}"] = backend_step(llama, backend, style, info, batch_of=uneven_batch)
    res["backend/fsdp2-tied"] = backend_step(ckpt, "fsdp2", "ulysses", info, batch_of=uneven_batch)  # qwen3: tied
    res["backend/fsdp2-gathered"] = backend_step(ckpt, "fsdp2", "ring", info, batch_of=uneven_batch, gathered=True)
    res["backend/fsdp2-bf16"] = backend_step(ckpt, "fsdp2", "ulysses", info, batch_of=uneven_batch, dtype="bfloat16")
    for backend in ("ddp", "fsdp2"):
        res[f"backend/{backend}-empty-shard"] = backend_step(llama, backend, "ulysses", info, batch_of=short_batch,
                                                             rows="2", group=2)
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps(res))
    shutdown(info)


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()
