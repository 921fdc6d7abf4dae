"""`grpo plan`'s text: the batch plan, the per-GPU memory rows with what each holds, and the host rows per node,
with the verdicts against `--gpu-mem` / `--host-mem` (the figures come from planner/plan.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.config.hsdp import layout_note, shard_ranks
from grpo_cli.planner.plan_sequence import long_context_lines
from grpo_cli.config.reward_models import parks_reward_models
from grpo_cli.config.rules_megatron import megatron_layout
from grpo_cli.planner.plan import (GIB, GPU_HEADROOM, HOST_HEADROOM, async_plan, batch_plan, host_plan, memory_plan,
                              stream_plan,
                                   peak_bytes, plan_device)
from grpo_cli.planner.plan_deploy import deployment_lines, training_view
from grpo_cli.planner.plan_tokens import token_budget_lines

if TYPE_CHECKING:
    from grpo_cli.config.schema import GRPOConfig


def _gpu_notes(cfg: GRPOConfig) -> dict[str, str]:
    d, world = cfg.distributed, shard_ranks(cfg)
    if d.backend == "fsdp2":
        where = "; shards on the host (cpu_offload)" if d.fsdp2.cpu_offload else ""
        grads = (f"whole model, unsharded, {d.reduce_dtype}, between micro-batches (unsharded_grad_accumulation)"
                 if d.fsdp2.unsharded_grad_accumulation else
                 f"1/{world} shard, reduce-scattered every micro-batch{where}")
        notes = {"gradients": grads, "weights_gathered": "root unit + 2 layers, unsharded while computing",
                 "gradients_transient": "unsharded root + layer gradients and reduce-scatter input"}
        if d.fsdp2.cpu_offload:
            notes |= {"weights": "shards on the host (cpu_offload)", "optimizer": "on the host (cpu_offload)"}
        return notes
    if d.backend == "megatron":
        lay = megatron_layout(cfg)
        grid = f"tp {lay['tp']} x pp {lay['pp']}"
        experts = f"; experts 1/(ep {lay['ep']} x etp {lay['etp']} x pp {lay['pp']})"
        dp = f"dp {lay['dp']}" + (f" x cp {lay['cp']}" if lay["cp"] > 1 else "")
        opt = (f"dense 1/(tp x pp x {dp}), experts also 1/edp {lay['edp']} (distributed_optimizer)"
               if d.megatron.distributed_optimizer else "whole on every data-parallel rank (no distributed_optimizer)")
        return {"weights": f"{cfg.model.dtype}, dense 1/({grid}){experts}",
                "gradients": "float32 Megatron DDP buffers, same split as the weights",
                "optimizer": f"fp32 master + Adam moments, {opt}",
                "activations": f"per stage: layers/pp x min(pp, micro-batches) in flight, /tp; recompute "
                               f"{d.megatron.recompute}; + one chunk of the head's float32 logits/tp",
                "hf_engine_copy": "the hf engine's own whole model on every rank (rollout.dtype); vLLM splits "
                                  "it by its TP"}
    notes = {"hf_generation_copy": "the hf engine decodes a copy of the weights in model.dtype, refreshed each step",
             "head_chunk": "one chunk of the output layer's float32 logits (x3 buffers): 2^28 logits on CUDA, 2^24 "
                           "on the CPU"}
    if d.backend == "deepspeed" and d.deepspeed.offload_optimizer:
        notes["optimizer"] = "on the host (deepspeed.offload_optimizer)"
        if d.deepspeed.zero_stage >= 2:
            notes["gradients"] = "one reduce bucket; the gradient partitions are on the host"
    if d.backend == "deepspeed" and d.deepspeed.offload_params:
        notes["weights"] = "on the host (deepspeed.offload_params)"
    return notes


def _render_memory(cfg: GRPOConfig, mem: dict[str, float], gpu_mem: float | None) -> list[str]:
    lines = [f"# memory per GPU (estimate; mode {cfg.rollout.mode}, engine {cfg.rollout.engine}, "
             f"backend {cfg.distributed.backend})"]
    notes = _gpu_notes(cfg)
    lines += [f"  ({note})" for note in [layout_note(cfg)] if note]
    if "reward_model" in mem:
        notes["reward_model"] = "local reward model(s) and judge(s), one copy per process; " + (
            "on the GPU only while scoring" if parks_reward_models(cfg) else "resident for the whole run")
    lines += [f"  {k:28s} {v / GIB:8.2f} GiB" + (f"   {notes[k]}" if k in notes else "") for k, v in mem.items()]
    peak = peak_bytes(cfg, mem)
    lines.append(f"  {'peak':28s} {peak / GIB:8.2f} GiB")
    if gpu_mem:
        verdict = "fits" if peak <= gpu_mem * (1 - GPU_HEADROOM) else "does NOT fit"
        lines.append(f"# verdict: {verdict} in {gpu_mem / GIB:.0f} GiB ({GPU_HEADROOM:.0%} headroom)")
    return lines


def _render_host(cfg: GRPOConfig, mem: dict[str, float], host_mem: float | None) -> list[str]:
    rows = host_plan(cfg, mem)
    lines = [f"# host memory per node (estimate; {cfg.distributed.num_processes} process(es) per machine; pinned "
             "unless said)"]
    if cfg.distributed.device == "cpu":
        lines.append("  (device cpu: the per-GPU rows above are host memory as well)")
    lines += [f"  {k:28s} {b / GIB:8.2f} GiB   {why}" for k, (b, why) in rows.items()]
    if not rows:
        lines.append("  (nothing: no offload, no vLLM sleep level 1, no Ray object store)")
    total = sum(b for b, _ in rows.values())
    lines.append(f"  {'total':28s} {total / GIB:8.2f} GiB")
    if host_mem:
        verdict = "fits" if total <= host_mem * (1 - HOST_HEADROOM) else "does NOT fit"
        lines.append(f"# host verdict: {verdict} in {host_mem / GIB:.0f} GiB per node ({HOST_HEADROOM:.0%} headroom "
                     "for the OS and the processes' runtimes)")
    return lines


def render_plan(cfg: GRPOConfig, *, gpu_mem: float | None, host_mem: float | None = None) -> str:
    cfg = training_view(cfg)  # under deployment: the figures of the job's real number of training nodes
    lines = ["# batch plan"]
    lines += [f"  {k:28s} {v}" for k, v in batch_plan(cfg).items()]
    if cfg.rollout.mode == "async":
        lines.append("# async rollouts (Ray)")
        lines += [f"  {k:28s} {v}" for k, v in async_plan(cfg).items()]
    if cfg.rollout.mode == "stream":
        lines.append("# stream rollouts (pool, buffer, lag)")
        lines += [f"  {k:28s} {v}" for k, v in stream_plan(cfg).items()]
    mem = memory_plan(cfg, gpu_mem)
    if cfg.distributed.backend != "megatron":
        lines += token_budget_lines(cfg, mem, gpu_mem and gpu_mem * (1 - GPU_HEADROOM), peak=peak_bytes)
    lines += long_context_lines(cfg, mem, batch_plan(cfg), gpu_mem and gpu_mem * (1 - GPU_HEADROOM),
                                device=plan_device(cfg, gpu_mem), peak=peak_bytes)
    return "\n".join(lines + _render_memory(cfg, mem, gpu_mem) + _render_host(cfg, mem, host_mem)
                     + deployment_lines(cfg, gpu_mem))
