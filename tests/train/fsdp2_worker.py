"""Worker for test_fsdp2: one rank of a 2-process gloo job that trains the tiny model under fsdp2 in several
settings and writes what it measured to `OUT/rank{r}.json`.

- accumulation: one optimizer step of 4 micro-batches with the default (reduce-scatter every micro-batch) and with
  `distributed.fsdp2.unsharded_grad_accumulation`, the gradient bytes this rank holds after each micro-batch, and
  the difference of the two updates; the unsharded run once more after an abandoned micro-batch.
- cpu_offload / reduce_dtype: the policies `fully_shard` was given, and the offloaded step against the default.
- offload: a `distributed.offload` round trip of DTensor gradients, AdamW state and parameters, with the pinned-copy
  branch taken (`accel.wants_pinned` → True, pinning itself off: CPU only), then a second step against a twin.
- sync: `stream_named_tensors` against `full_tensor()` per parameter, counting the all-gathers per bucket cap.

Run as `RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fsdp2_worker.py CKPT OUT`."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from grpo_cli.config.load import build_config
from grpo_cli.runtime import accel
from grpo_cli.runtime.dist import all_reduce_sum, init_from_env, shutdown
from grpo_cli.train.backends.fsdp2 import _fsdp_params, fsdp_param_groups, gradient_bytes
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.weights.offload import TrainingStateOffload
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import forward_logprobs, optimizer_step
from grpo_cli.train.weights.hf_module import buckets, stream_named_tensors

ROWS, MICRO, P, T = 16, 4, 5, 7  # per rank: 4 micro-batches of 4


def config(ckpt: str, *overrides: str):
    return build_config(overrides=[f"model.name_or_path={ckpt}", "distributed.backend=fsdp2", "rollout.engine=vllm",
                                   "distributed.num_processes=2", f"train.micro_batch_size={MICRO}",
                                   "train.learning_rate=1e-2", "train.prompts_per_step=4",
                                   "train.generations_per_prompt=8", *overrides])


def batch_for(rank: int, vocab: int, step: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(6, vocab, (ROWS, P + T), generator=g)
    cmask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (ROWS,), generator=g)[:, None]).float()
    attn = torch.cat([torch.ones(ROWS, P, dtype=torch.long), cmask.long()], dim=1)
    return TrainBatch(ids, attn, cmask, advantages=torch.randn(ROWS, generator=g),
                      sampler_logprobs=-torch.rand(ROWS, T, generator=g) * cmask)


def step(policy, cfg, rank: int, n: int = 0) -> None:
    batch = batch_for(rank, policy.module.config.vocab_size, n)
    num_items = all_reduce_sum(float(batch.completion_mask.sum()), policy.backend.info)
    optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=2 * ROWS)


def full_params(policy) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in policy.module.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def held_per_micro_batch(policy) -> list[int]:
    """Wrap the backend's accumulation context: gradient bytes held after each micro-batch's backward."""
    backend, held = policy.backend, []
    inner = backend.accumulation_context

    @contextlib.contextmanager
    def measured(*, last: bool):
        with inner(last=last):
            yield
        held.append(gradient_bytes(policy.module))

    backend.accumulation_context = measured
    return held


def accumulation(ckpt: str, rank: int, info) -> tuple[dict, dict]:
    out, weights = {}, {}
    for mode, extra in (("default", []), ("unsharded", ["distributed.fsdp2.unsharded_grad_accumulation=true"])):
        cfg = config(ckpt, *extra)
        policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
        held = held_per_micro_batch(policy)
        step(policy, cfg, rank)
        params = list(policy.module.parameters())
        out[mode] = {"held": held, "shard_bytes": sum(p.to_local().numel() * 4 for p in params),
                     "full_bytes": sum(p.numel() * 4 for p in params)}
        weights[mode] = full_params(policy)
    out["update_diff"] = max_diff(weights["default"], weights["unsharded"])
    cfg = config(ckpt, "distributed.fsdp2.unsharded_grad_accumulation=true")
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    abandon(policy, rank)
    step(policy, cfg, rank)
    out["abandoned_diff"] = max_diff(full_params(policy), weights["unsharded"])
    return out, weights["default"]


def abandon(policy, rank: int) -> None:
    """One micro-batch accumulated without reduction (large, ×100), then the step given up with `zero_grad`."""
    backend, batch = policy.backend, batch_for(rank, policy.module.config.vocab_size, 7)
    backend.zero_grad()
    with backend.accumulation_context(last=False), backend.compute_context():
        logprobs = forward_logprobs(policy.model, batch.rows(0, MICRO), temperature=1.0)
        backend.backward((logprobs * batch.completion_mask[:MICRO]).sum() * 100.0)
    backend.zero_grad()


def policies(ckpt: str, rank: int, reference: dict, info) -> dict:
    """What `fully_shard` was given under `cpu_offload` and `reduce_dtype`; the offloaded step against `reference`."""
    out = {}
    for name, extra in (("cpu_offload", ["distributed.fsdp2.cpu_offload=true"]),
                        ("bf16_reduce", ["distributed.reduce_dtype=bfloat16"])):
        cfg = config(ckpt, *extra)
        policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
        groups = list(fsdp_param_groups(policy.module))  # torch's private layout differs across versions
        out[name] = {"offload_policy": sorted({type(g.offload_policy).__name__ for g in groups}),
                     "reduce_dtype": sorted({str(g.mp_policy.reduce_dtype) for g in groups}),
                     "offload_to_cpu": sorted({f.offload_to_cpu for f in _fsdp_params(policy.module)})}
        if name == "cpu_offload":
            step(policy, cfg, rank)
            out[name]["update_diff"] = max_diff(full_params(policy), reference)
    return out


def locals_of(policy) -> dict[str, torch.Tensor]:
    """Clones of this rank's shards: parameters, gradients, AdamW state."""
    out = {}
    for n, p in policy.module.named_parameters():
        out[f"param:{n}"] = p.to_local().detach().clone()
        if p.grad is not None:
            out[f"grad:{n}"] = p.grad.to_local().clone()
        for key, value in policy.optimizer.state[p].items():
            out[f"opt:{n}:{key}"] = (value.to_local() if isinstance(value, DTensor) else value).clone()
    return out


def offload(ckpt: str, rank: int, info) -> dict:
    cfg = config(ckpt)
    policy, twin = (load_policy(cfg, ckpt, device=torch.device("cpu"), info=info) for _ in range(2))
    for p in (policy, twin):
        step(p, cfg, rank)
        with p.backend.accumulation_context(last=True), p.backend.compute_context():  # gradients left in place
            b = batch_for(rank, p.module.config.vocab_size, 3)
            p.backend.backward((forward_logprobs(p.model, b.rows(0, MICRO), temperature=1.0)).sum())
    copies = {"plain": 0, "dtensor": 0}
    real_host_copy = accel.host_copy

    def host_copy(tensor, *, pinned):
        copies["dtensor" if isinstance(tensor, DTensor) else "plain"] += 1
        return real_host_copy(tensor, pinned=False)  # pinning needs CUDA; the copy itself is the real one

    accel.wants_pinned = lambda src, dst: torch.device(dst).type == "cpu"  # as a GPU → host copy would
    accel.host_copy = host_copy
    before, ids = locals_of(policy), [id(p) for p in policy.module.parameters()]
    state = next(iter(policy.optimizer.state.values()))["exp_avg"]
    ptr = state.to_local().data_ptr()
    off = TrainingStateOffload(policy.model, policy.optimizer, optimizer_state=True, grads=True, params=True,
                               force=True)
    error = None
    try:
        off.offload()
        moved = next(iter(policy.optimizer.state.values()))["exp_avg"]
        res = {"state_moved": isinstance(moved, DTensor) and moved.to_local().data_ptr() != ptr,
               "grads_parked": all(p.grad is None for p in policy.module.parameters())}
        off.reload()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which shows it
        error, res = f"{type(exc).__name__}: {exc}", {}
    accel.wants_pinned, accel.host_copy = wants_pinned, real_host_copy
    if error is not None:
        return {"error": error}
    after = locals_of(policy)
    res.update(copies=copies, same_keys=before.keys() == after.keys(),
               bit_identical=all(torch.equal(before[k], after[k]) for k in before),
               identity=[id(p) for p in policy.module.parameters()] == ids,
               optimizer_refs=all(id(p) in {id(q) for q in policy.module.parameters()} for p in policy.optimizer.state))
    for p in (policy, twin):
        step(p, cfg, rank, 1)
    res["second_step_diff"] = max_diff(full_params(policy), full_params(twin))
    return res


wants_pinned = accel.wants_pinned


def sync(ckpt: str, info) -> dict:
    """Bucketed gathers against `full_tensor()`; all-gathers and `full_tensor` calls counted per bucket cap."""
    cfg = config(ckpt)
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    reference = {n: p.full_tensor() for n, p in policy.module.named_parameters()}
    calls = {"all_gather": 0, "full_tensor": 0, "largest": 0}
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real_gather, real_full = getattr(dist, name), DTensor.full_tensor

    def all_gather_into_tensor(output, input, *args, **kw):
        calls["all_gather"] += 1
        calls["largest"] = max(calls["largest"], output.numel() * output.element_size())
        return real_gather(output, input, *args, **kw)

    def full_tensor(self, *args, **kw):
        calls["full_tensor"] += 1
        return real_full(self, *args, **kw)

    setattr(dist, name, all_gather_into_tensor)
    DTensor.full_tensor = full_tensor
    named = list(policy.module.named_parameters())
    out = {"tensors": len(reference), "model_bytes": sum(t.numel() * 4 for t in reference.values()), "caps": {}}
    try:
        for cap_mb in (1.0, 0.05, 0.01):
            calls.update(all_gather=0, full_tensor=0, largest=0)
            stats = {"tensors": 0, "bytes": 0, "copies": {}}
            got = dict(stream_named_tensors(policy.module, bucket_mb=cap_mb, peft=False, stats=stats,
                                            keep_copies=set()))
            out["caps"][str(cap_mb)] = {
                **calls, "identical": all(torch.equal(got[n], reference[n]) for n in reference),
                "buckets": len(list(buckets(named, int(cap_mb * 2**20)))),
                "largest_tensor": max(t.numel() * 4 for t in reference.values())}
        out["uneven"] = uneven(info)
    finally:
        setattr(dist, name, real_gather)
        DTensor.full_tensor = real_full
    return out


def uneven(info) -> bool:
    """Rows that do not split evenly (5 rows: 3 + 2; 1 row: rank 1 holds none) come back whole and in order."""
    from torch.distributed.fsdp import fully_shard

    from grpo_cli.train.weights.shard_gather import GatheredBucket

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 1), torch.nn.Linear(1, 3))
    fully_shard(module)
    params = list(module.parameters())
    gathered = GatheredBucket(params)
    return all(torch.equal(gathered.full(p), real_full_tensor(p)) for p in params)


real_full_tensor = DTensor.full_tensor


def unsharded_after(module) -> list[str]:
    """The parameters `module` has registered unsharded now (plain tensors, not its DTensor shards)."""
    return [n for n, p in module.named_parameters() if not isinstance(p, DTensor)]


def no_grad_passes(ckpt: str, rank: int) -> dict:
    """The policy's and the KL reference's no-grad logprob passes (the reference's is its only use), then a step:
    what each leaves unsharded (FSDP2 keeps a root unit's parameters after its forward for the backward)."""
    cfg = config(ckpt, "algorithm.kl.beta=0.1")
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"))
    backend = policy.backend
    batch = batch_for(rank, policy.module.config.vocab_size)
    got = {"before": unsharded_after(policy.module)}
    batch.ref_logprobs = backend.batch_logprobs(batch, micro_batch_size=MICRO, temperature=1.0, reference=True)
    got["reference"] = unsharded_after(backend.ref_model)
    batch.old_logprobs = backend.batch_logprobs(batch, micro_batch_size=MICRO, temperature=1.0)
    got["policy"] = unsharded_after(policy.module)
    num_items = all_reduce_sum(float(batch.completion_mask.sum()), backend.info)
    optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=2 * ROWS)
    got["after_step"] = unsharded_after(policy.module)
    return got


def main(ckpt: str, out: str) -> None:
    info = init_from_env(torch.device("cpu"), timeout_minutes=5)
    res, reference = accumulation(ckpt, info.rank, info)
    res.update(policies(ckpt, info.rank, reference, info))
    res["offload"] = offload(ckpt, info.rank, info)
    res["sync"] = sync(ckpt, info)
    res["no_grad"] = no_grad_passes(ckpt, info.rank)
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps(res))
    shutdown(info)


if __name__ == "__main__":
    main(*sys.argv[1:])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
