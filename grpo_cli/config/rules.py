"""Cross-field rules of `GRPOConfig`: each failure names the field and the fix, before any model loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.config.engine_modes import engine_mode, modes_of
from grpo_cli.config.hsdp import check_hsdp
from grpo_cli.config.rules_deployment import check_deployment
from grpo_cli.config.rules_megatron import check_megatron, divisors
from grpo_cli.config.rules_vision import check_vision
from grpo_cli.config.rules_offload import check_offload
from grpo_cli.config.rules_stream import check_stream, check_unused, refuse_engine
from grpo_cli.config.rules_sequence import check_sequence_parallel
from grpo_cli.config.transports import facts, is_loopback

if TYPE_CHECKING:
    from grpo_cli.config.sections import GRPOSections


def _check_batch(cfg: GRPOSections) -> None:
    t, world = cfg.train, cfg.distributed.num_processes * cfg.distributed.num_machines
    if t.prompts_per_step % world:
        valid = [p for p in range(world, 4 * world + 1, world)]
        raise ValueError(
            f"train.prompts_per_step={t.prompts_per_step} is not divisible by the {world} training processes, "
            f"so prompt groups cannot be split evenly; use a multiple of {world}, e.g. {valid}."
        )
    per_rank = t.prompts_per_step // world * t.generations_per_prompt
    if t.micro_batch_tokens is not None:  # the budget cuts the micro-batches: micro_batch_size divides nothing
        _check_token_budget(cfg)
    elif per_rank % t.micro_batch_size:
        raise ValueError(
            f"train.micro_batch_size={t.micro_batch_size} does not divide the {per_rank} sequences each process "
            f"trains per step (prompts_per_step/processes x generations_per_prompt); valid values: "
            f"{divisors(per_rank)}."
        )


def _check_token_budget(cfg: GRPOSections) -> None:
    budget, longest = cfg.train.micro_batch_tokens, cfg.max_sequence_length
    sp = cfg.distributed.sequence_parallel.size  # the budget is per rank: a group's micro-batch holds sp times it
    if budget * sp < longest:
        least = -(-longest // sp)
        raise ValueError(
            f"train.micro_batch_tokens={budget} is smaller than the longest sequence a step can hold "
            f"(data.max_prompt_length + rollout.max_completion_length = {longest}"
            f"{f', over distributed.sequence_parallel.size={sp} ranks' if sp > 1 else ''}): such a row would run "
            f"alone, past the budget meant to bound a micro-batch's memory; use at least {least} (see `grpo plan`)."
        )
    if cfg.distributed.backend == "megatron":
        raise ValueError(
            "train.micro_batch_tokens is not available with distributed.backend 'megatron': its pipeline schedule "
            "runs micro-batches of train.micro_batch_size rows; remove train.micro_batch_tokens or use ddp, fsdp2 "
            "or deepspeed."
        )
    if cfg.algorithm.aggregation == "token_mean_local":
        raise ValueError(
            "train.micro_batch_tokens cannot be used with algorithm.aggregation 'token_mean_local': that loss "
            "divides by each micro-batch's own token count, so it would change with how rows are grouped; use "
            "'token_mean' (the step's token count) or remove train.micro_batch_tokens."
        )


def _check_layout(cfg: GRPOSections) -> None:
    """The engine × mode is a row of `config/engine_modes.MODES`."""
    r = cfg.rollout
    if engine_mode(r.engine, r.mode) is not None:
        return
    if r.mode == "stream":
        refuse_engine(r.engine)
    modes = modes_of(r.engine)
    if modes == ["server"]:
        raise ValueError(
            f"rollout.engine '{r.engine}' cannot run in mode '{r.mode}': it runs as a separate server; set "
            "rollout.mode=server and point rollout.server.urls at it (or use engine vllm for colocate)."
        )
    raise ValueError(f"rollout.engine '{r.engine}' cannot run in mode '{r.mode}': it runs in mode(s) "
                     f"{', '.join(modes)}; set rollout.mode to one of them.")


def _check_rollout(cfg: GRPOSections) -> None:
    r = cfg.rollout
    _check_layout(cfg)
    if r.layout.remote and not r.server.urls and not cfg.deployment.rollout_nodes:  # derived on each node
        raise ValueError(
            f"rollout.server.urls is empty but rollout.mode is '{r.mode}': give the rollout server's address, "
            "e.g. --set rollout.server.urls='[\"http://127.0.0.1:8000\"]' (start one with `grpo serve-rollout`)."
        )
    if not r.layout.remote and r.server.urls:
        raise ValueError(
            f"rollout.server.urls is set but rollout.mode is '{r.mode}': server URLs are used only in server "
            "mode; set rollout.mode=server or remove the URLs."
        )
    world = cfg.distributed.num_processes
    tp = r.vllm.tensor_parallel_size
    if r.colocated_vllm and world % tp:
        raise ValueError(
            f"rollout.vllm.tensor_parallel_size={tp} must divide distributed.num_processes={world} in colocate "
            f"mode (each TP group is made of training processes); valid values: {divisors(world)}."
        )
    if r.mode == "async":
        _check_async(cfg)
    if r.mode == "stream":
        check_stream(cfg)
    check_unused(cfg)
    _check_weight_transport(cfg)
    if not r.server.shm_keep_file and not (r.layout.remote and r.transport == "shm"):
        raise ValueError(
            "rollout.server.shm_keep_file=false applies only to rollout.mode=server with "
            "rollout.server.weight_transport=shm (no /dev/shm file is written otherwise); remove it."
        )
    if r.vllm.sleep_level and not r.layout.can_sleep:
        raise ValueError(
            "rollout.vllm.sleep_level applies only to rollout.engine=vllm in colocate mode; set it to 0."
        )
    if r.vllm.sleep_level == 2 and cfg.train.dynamic_sampling.enabled:
        raise ValueError(
            "train.dynamic_sampling generates several rounds per step, but rollout.vllm.sleep_level 2 discards the "
            "engine's weights after each generation (they come back only with the next weight sync); use "
            "rollout.vllm.sleep_level 1 (weights kept in host memory) or 0."
        )
    if r.compile and (r.engine != "hf" or r.layout.remote):
        where = f"rollout.engine is '{r.engine}'" if r.engine != "hf" else \
            "rollout.mode 'server' runs the engine in `grpo serve-rollout` (give it --compile there)"
        raise ValueError(f"rollout.compile compiles the hf engine's decode step where the trainer builds the engine, "
                         f"but {where}; set rollout.compile=false.")
    if r.vllm.block_size is not None and not (r.engine == "vllm" and not r.layout.remote):
        where = ("rollout.mode is 'server': the server builds its engine, so give `grpo serve-rollout --block-size` "
                 "instead" if r.layout.remote else f"rollout.engine is '{r.engine}'")
        raise ValueError(f"rollout.vllm.block_size sets the KV block size of the vLLM engine the trainer builds "
                         f"(colocate or async), but {where}; remove rollout.vllm.block_size.")
    if r.vllm.max_model_len is not None and r.vllm.max_model_len < cfg.max_sequence_length:
        raise ValueError(
            f"rollout.vllm.max_model_len={r.vllm.max_model_len} is below data.max_prompt_length "
            f"{cfg.data.max_prompt_length} + rollout.max_completion_length {r.max_completion_length} = "
            f"{cfg.max_sequence_length}: vLLM would stop the longest completions at {r.vllm.max_model_len} tokens "
            f"without an error (finish reason length). Set it to at least {cfg.max_sequence_length} or remove it "
            "(the default is that sum), or lower data.max_prompt_length / rollout.max_completion_length.")


def _check_weight_transport(cfg: GRPOSections) -> None:
    r = cfg.rollout
    name = r.server.weight_transport
    if r.server.weight_fanout == "direct" and (r.mode != "server" or r.transport != "http"):
        how = f"by {r.transport}" if r.mode == "server" else f"in {r.mode} mode"
        raise ValueError(
            "rollout.server.weight_fanout=direct changes nothing here: fan-out applies to the http weight transport "
            f"of rollout.mode=server, and this run's weights go {how} (shm: one file every server maps; nccl: one "
            "broadcast group). Remove it, or set rollout.server.weight_transport=http.")
    if name is None:
        _check_same_host(cfg)
        return
    if not r.layout.remote:
        raise ValueError(
            f"rollout.server.weight_transport={name} applies only to rollout.mode=server (in {r.mode} mode the "
            "engine gets its weights without a server transport); remove it or set rollout.mode=server.")
    valid = r.layout.transports
    if name not in valid:
        server = {"sglang": "an SGLang server", "vllm-serve": "a stock `vllm serve` (vLLM's RL API has no HTTP data path)"}.get(
            r.engine, f"`grpo serve-rollout --engine {r.engine}`")
        raise ValueError(
            f"rollout.server.weight_transport={name} is not a weight transport of rollout.engine '{r.engine}': "
            f"{server} takes {', '.join(valid)} (default {valid[0]}); set rollout.server.weight_transport to one "
            "of these (see docs/server-mode.md for when to use which).")
    _check_same_host(cfg)


def _check_same_host(cfg: GRPOSections) -> None:
    """A transport that needs the server on the trainer's host (`TransportFacts.same_host`: a file in /dev/shm, CUDA
    IPC handles) refuses a URL that is not loopback, default transports included."""
    r = cfg.rollout
    found = facts(r.layout.client, r.transport) if r.layout.client else None
    away = [u.rstrip("/") for u in r.server.urls if not is_loopback(u)]
    if found is None or not found.same_host or not away:
        return
    others = [n for n in r.layout.transports if n != found.name]
    raise ValueError(
        f"rollout.server.weight_transport={found.name} ({found.topology}) needs every rollout server on the "
        f"trainer's host, addressed by a loopback URL (127.0.0.1 or localhost), but rollout.server.urls has "
        f"{', '.join(away)}: point the URLs at 127.0.0.1 for a server on this host, or set "
        f"rollout.server.weight_transport to {' or '.join(others)} (docs/server-mode.md).")


def _check_async(cfg: GRPOSections) -> None:
    r, d = cfg.rollout, cfg.distributed
    world = d.num_processes * d.num_machines
    if r.ray.num_actors % world:
        raise ValueError(
            f"rollout.ray.num_actors={r.ray.num_actors} must be a multiple of the {world} training processes in "
            f"async mode (each process feeds its own rollout actors); e.g. rollout.ray.num_actors={world}."
        )
    if r.vllm.tensor_parallel_size > 1:
        raise ValueError(
            f"rollout.vllm.tensor_parallel_size={r.vllm.tensor_parallel_size} is not available in async mode: each "
            "Ray rollout actor runs one single-process engine on one GPU (vLLM's tensor parallelism would need its "
            "multi-process executor inside the actor, and weight pushes to every worker of it). Set "
            "rollout.vllm.tensor_parallel_size=1 and spread the rollout GPUs over more actors (rollout.ray.num_actors "
            "= distributed.rollout_gpus x num_machines), or serve a tensor-parallel engine with SGLang (`grpo "
            "serve-rollout --engine sglang --tensor-parallel-size N`, rollout.engine=sglang, rollout.mode=server; "
            "`grpo serve-rollout --engine vllm` serves one GPU per server)."
        )
    if r.ray.address is None and d.num_machines > 1:
        raise ValueError(
            "rollout.ray.address is null, so rank 0 starts a Ray cluster on machine 0 alone and every rollout actor "
            f"would land there, but distributed.num_machines={d.num_machines}: start Ray on every machine "
            "(`CUDA_VISIBLE_DEVICES=<rollout GPU ids> ray start --head --num-gpus N` on machine 0, the same with "
            "--address HEAD:6379 on the others) and set rollout.ray.address=auto."
        )
    need = r.ray.num_actors
    if d.device == "cuda" and d.rollout_gpus * d.num_machines < need:
        raise ValueError(
            f"async mode places {r.ray.num_actors} rollout actor(s), one GPU each = {need} GPU(s), but "
            f"distributed.rollout_gpus x num_machines = {d.rollout_gpus * d.num_machines}; raise "
            "distributed.rollout_gpus or lower rollout.ray.num_actors."
        )


def _check_distributed(cfg: GRPOSections) -> None:
    d = cfg.distributed
    if d.num_machines > 1 and not d.main_process_ip:
        raise ValueError(
            f"distributed.num_machines={d.num_machines} needs distributed.main_process_ip, the address of machine 0 "
            "(--master-addr); run the same command on every machine with its --node-rank."
        )
    if d.machine_rank >= d.num_machines:
        raise ValueError(
            f"distributed.machine_rank={d.machine_rank} must be below distributed.num_machines={d.num_machines} "
            f"(valid: 0..{d.num_machines - 1})."
        )
    sharded = d.backend == "fsdp2" or (d.backend == "deepspeed" and d.deepspeed.zero_stage == 3)
    if sharded and cfg.rollout.layout.shares_policy_weights:
        raise ValueError(
            f"rollout.engine 'hf' in colocate mode generates with the policy's own parameters, which "
            f"distributed.backend '{d.backend}' shards across processes (each holds 1/N; in one process they are "
            "still sharded tensors, which the hf engine's decode step cannot read); use rollout.engine=vllm "
            "(colocated, synced from the shards), rollout.mode=server or async, or distributed.backend=ddp."
        )
    check_offload(cfg)
    if cfg.model.cpu_linear == "onednn" and (d.backend != "ddp" or cfg.model.dtype != "float32"):
        raise ValueError(
            f"model.cpu_linear 'onednn' runs plain float32 linear layers on CPU, but distributed.backend is "
            f"'{d.backend}' and model.dtype '{cfg.model.dtype}' (it needs ddp and float32); set "
            "model.cpu_linear=auto (picks it where it applies) or aten."
        )
    if d.backend == "deepspeed" and cfg.model.master_weights != "float32":
        raise ValueError(
            "model.master_weights 'compute_dtype' is not available with distributed.backend 'deepspeed': its bf16 "
            "mode always keeps float32 master weights; set model.master_weights=float32."
        )
    if d.deepspeed.offload_params and d.deepspeed.zero_stage != 3:
        raise ValueError("distributed.deepspeed.offload_params needs zero_stage 3; set zero_stage=3 or turn it off.")


def _check_sharding(cfg: GRPOSections) -> None:
    """Settings of one sharded backend refused under another (they would change nothing)."""
    d = cfg.distributed
    if d.backend != "fsdp2" and d.fsdp2.model_dump() != type(d.fsdp2)().model_dump():
        raise ValueError(
            f"distributed.fsdp2 settings apply only to distributed.backend=fsdp2, but the backend is '{d.backend}'; "
            "remove them or set distributed.backend=fsdp2."
        )
    check_hsdp(cfg)
    if d.reduce_dtype != "float32" and d.backend == "megatron":
        raise ValueError(
            f"distributed.reduce_dtype '{d.reduce_dtype}' is not available with distributed.backend 'megatron': its "
            "DDP reduces and accumulates gradients in float32 buffers (grad_reduce_in_fp32); remove it."
        )
    if d.backend != "megatron" and d.megatron.model_dump() != type(d.megatron)().model_dump():
        raise ValueError(
            f"distributed.megatron settings apply only to distributed.backend=megatron, but the backend is "
            f"'{d.backend}'; remove them or set distributed.backend=megatron."
        )
    if d.reduce_dtype != "float32" and d.backend == "ddp":
        raise ValueError(
            f"distributed.reduce_dtype '{d.reduce_dtype}' sets how the sharded backends (fsdp2, deepspeed) reduce "
            "gradients; ddp reduces in the gradients' own dtype. Remove it or use distributed.backend=fsdp2."
        )
    if d.fsdp2.cpu_offload and any(d.offload.model_dump().values()):
        raise ValueError(
            "distributed.fsdp2.cpu_offload keeps parameters, gradients and optimizer state on the host for the whole "
            "run, so distributed.offload (moving them there while generating) has nothing to move; turn the "
            "distributed.offload flags off."
        )


def _check_lora_and_eval(cfg: GRPOSections) -> None:
    if cfg.model.lora is not None and cfg.distributed.backend == "megatron":
        raise ValueError(
            "model.lora is not available with distributed.backend 'megatron': it trains every weight of the "
            "Megatron-core model; use distributed.backend=fsdp2 or ddp for LoRA, or set model.lora: null."
        )
    if cfg.model.lora is not None and cfg.distributed.backend == "deepspeed":
        raise ValueError(
            "model.lora is not available with distributed.backend 'deepspeed' yet; use distributed.backend=ddp or "
            "fsdp2 (fsdp2 shards the frozen base as well), or set model.lora: null."
        )
    e, world = cfg.eval, cfg.distributed.num_processes * cfg.distributed.num_machines
    if e.every_steps and e.source == "auto" and not cfg.data.source.startswith("builtin:"):
        raise ValueError(
            f"eval.source 'auto' is the held-out split of a built-in task, but data.source is '{cfg.data.source}'; "
            "point eval.source at your evaluation prompts (.jsonl, .parquet or a saved datasets folder), or set "
            "eval.every_steps=0 to train without evaluation."
        )
    if e.every_steps and e.num_prompts % world:
        raise ValueError(
            f"eval.num_prompts={e.num_prompts} is not divisible by the {world} training processes that share the "
            f"evaluation; use a multiple of {world}."
        )


def _check_agent(cfg: GRPOSections) -> None:
    if cfg.rollout.custom and cfg.agent is not None:
        raise ValueError(
            "rollout.custom produces the completions itself, so it does not take agent: (multi-turn tool calls); "
            "call your tools inside the function instead, or drop rollout.custom."
        )
    tp = cfg.rollout.vllm.tensor_parallel_size
    if cfg.rollout.custom and cfg.rollout.colocated_vllm and tp > 1:
        raise ValueError(
            f"rollout.custom cannot run with rollout.vllm.tensor_parallel_size={tp} in colocate mode: every "
            f"generate of a tensor-parallel vLLM engine is made by its {tp} processes together, but your function "
            "runs on each process with that process's own prompts and may call the engine a different number of "
            "times on each, which leaves one process waiting for the others forever. Set "
            "rollout.vllm.tensor_parallel_size=1 (each process then has an engine of its own), use `agent:` (its "
            "turns are agreed across the group), or rollout.mode=server."
        )


def _check_reward_models(cfg: GRPOSections) -> None:
    from grpo_cli.config.reward_models import device_setting, reward_models

    for f in reward_models(cfg):
        if f.isolation == "process" and device_setting(cfg, f) != "cpu":
            raise ValueError(
                f"rewards.functions[{f.alias or f.name}] (model {f.kwargs['model']}) runs on device "
                f"'{device_setting(cfg, f)}' with isolation: process: every worker interpreter of every rank would "
                "load its own copy, all onto the first visible GPU, and memory_mb's address-space cap breaks CUDA's "
                "initialisation. Score it inline (isolation: inline, one copy per training process on its own "
                "device) or on the CPU (device: cpu)."
            )


def _check_distill(cfg: GRPOSections) -> None:
    d = cfg.algorithm.distill
    if d is None:
        return
    if d.served and cfg.rollout.temperature != 1.0:
        raise ValueError(
            f"algorithm.distill.teacher is a served teacher ({d.teacher}), whose /score route gives temperature-1 "
            f"logprobs, but rollout.temperature={cfg.rollout.temperature}: the student's and the teacher's logprobs "
            "would be at different temperatures. Set rollout.temperature: 1.0, or give a local teacher checkpoint "
            "(scored at the rollout temperature).")
    if not d.served and d.token_env != type(d).model_fields["token_env"].default:  # a dumped config sets every field
        raise ValueError(f"algorithm.distill.token_env is the bearer token of a served teacher, but the teacher "
                         f"{d.teacher} is a local checkpoint: remove token_env (or give the teacher's server URL).")
    if not d.served and cfg.distributed.backend == "megatron":
        raise ValueError(
            "algorithm.distill.teacher is a local checkpoint, which the megatron backend does not load (it builds "
            "its reference from Megatron chunks only). Serve the teacher with `grpo serve-rollout --model TEACHER` "
            "and set algorithm.distill.teacher to its URL, or use distributed.backend ddp, fsdp2 or deepspeed.")


def check_rules(cfg: GRPOSections) -> None:
    """Raise ValueError (naming the field and the fix) when fields contradict each other."""
    _check_batch(cfg)
    _check_rollout(cfg)
    _check_distributed(cfg)
    _check_sharding(cfg)
    check_vision(cfg)
    check_megatron(cfg)
    check_sequence_parallel(cfg)
    _check_lora_and_eval(cfg)
    _check_agent(cfg)
    _check_reward_models(cfg)
    _check_distill(cfg)
    check_deployment(cfg)
