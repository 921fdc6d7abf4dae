"""`grpo train` in one process (or one worker of a launched job): build the parts, resume, run, checkpoint."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from grpo_cli.config.errors import UserError
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.data.images import ImageProcessor, copy_processor_files
from grpo_cli.data.prompts import PromptCursor, images_of, tokenize_prompts
from grpo_cli.data.sources import load_rows
from grpo_cli.runtime.accel import local_rank_from_env, resolve_device
from grpo_cli.runtime.faults import FaultPlan
from grpo_cli.runtime.dist import DistInfo, any_rank, barrier, broadcast_object, init_from_env, release_own_group, shutdown
from grpo_cli.runtime.quiet import quiet_hf_stack
from grpo_cli.rewards.resolve import reward_fns_for
from grpo_cli.rollout.base import EngineContext
from grpo_cli.rollout.factory import make_engine, sampling_params
from grpo_cli.train import checkpoint as ckpt
from grpo_cli.train.supervise.alarms import StepAlarms
from grpo_cli.train.distill import check_local_teacher, local_teacher, make_teacher
from grpo_cli.train.loop import LoopState, Trainer, reward_rise, run_loop, step_seed
from grpo_cli.train.pipeline import RolloutPipeline
from grpo_cli.train.stream_pool import StreamPipeline
from grpo_cli.rollout import seeds
from grpo_cli.train.policy import eos_token_ids, load_policy
from grpo_cli.train.supervise.run_dir import RunDir, default_output_dir
from grpo_cli.train.supervise.signals import SignalFlag
from grpo_cli.train.supervise.timing import PhaseTimer
from grpo_cli.models.tiny import model_folder, resolve_model_path
from grpo_cli.train.supervise.trackers import close_trackers, log_trackers, open_trackers
from grpo_cli.train.supervise.watchdog import StallWatchdog


def build_trainer(cfg: GRPOConfig, info: DistInfo, device, *, log=print) -> Trainer:
    """Load data, rewards, policy and engine for this process, on its resolved `device`."""
    model_path = resolve_model_path(cfg.model.name_or_path)
    images = ImageProcessor.load(model_path, max_pixels=cfg.data.max_image_pixels)  # None: a text-only model
    if images is not None:
        check_vision_run(cfg)
    reward_fns = reward_fns_for(cfg, device)  # a reward model with `device: auto` follows the training device
    if (teacher_path := local_teacher(cfg)) is not None:  # refused before the policy loads
        check_local_teacher(model_path, teacher_path)
    policy = load_policy(cfg, model_path, device=device, info=info)
    rows = load_rows(cfg.data.source, seed=cfg.train.seed)
    schemas = None
    if cfg.agent is not None:
        from grpo_cli.agent.rollout import agent_tools

        if cfg.agent.chat_template:
            policy.tokenizer.chat_template = cfg.agent.chat_template
        schemas = agent_tools(cfg.agent, policy.tokenizer)[1]
    prompts, dropped = tokenize_prompts(
        rows, policy.tokenizer, prompt_column=cfg.data.prompt_column,
        max_prompt_length=cfg.data.max_prompt_length, overlong_prompts=cfg.data.overlong_prompts, tools=schemas,
        images=images,
    )
    if dropped:
        log(f"data: dropped {dropped} of {len(rows)} prompts longer than {cfg.data.max_prompt_length} tokens")
    cursor = PromptCursor(prompts, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    hf_module = policy.backend.hf_module()  # None (megatron): an hf engine loads its own copy
    ctx = EngineContext(model_path, eos_token_ids(policy.tokenizer, model_path if hf_module is None else hf_module),
                        policy.tokenizer.pad_token_id, info.rank, info.world_size)
    if cfg.rollout.mode == "async":
        share_cores(cfg, device)
    from grpo_cli.agent.wrap import wrap_rollout

    engine = make_engine(cfg, ctx, policy=hf_module, device=device, broadcast=lambda obj: broadcast_object(obj, info),
                         wrap=wrap_rollout)
    if cfg.rollout.mode != "async":  # async: each Ray actor wraps its own engine with it (rollout/ray/actor.py)
        engine = wrap_rollout(engine, cfg, policy.tokenizer)
    if images_of(prompts) is not None and not engine.accepts_images:
        engine.close()
        raise UserError(
            f"the prompts of {cfg.data.source} carry images, and the rollout engine here ({cfg.rollout.engine}, "
            f"mode {cfg.rollout.mode}{', agent: loop' if cfg.agent is not None else ''}"
            f"{', rollout.custom' if cfg.rollout.custom else ''}) generates from text only; use rollout.engine: hf "
            "(docs/vision.md lists the engines that take images) or a text-only dataset.")
    offload = policy.backend.offloader()
    trainer = Trainer(cfg, policy, engine, cursor, reward_fns, info, offload=offload, timer=PhaseTimer(device),
                      teacher=make_teacher(cfg, model_path, policy.tokenizer, policy.backend))
    if not engine.shares_policy_weights:
        from grpo_cli.train.weights.weight_sync import FrozenVision, probe_of, sync_weights

        source = policy.backend.weight_source()
        if info.is_main and (ties := source.describe_ties()):
            log(ties)
        frozen = FrozenVision(cfg.model.freeze_vision and images is not None)

        def sync(version: int, verify: bool = cfg.rollout.vllm.verify_sync and cfg.rollout.mode != "async"):
            return sync_weights(engine, source, version=version, bucket_mb=cfg.distributed.weight_sync_bucket_mb,
                                verify=verify, info=info, skip=frozen.skip(), **probe_of(prompts[0]))

        trainer.sync = sync
    if cfg.eval.every_steps:
        from grpo_cli.train.evaluation import training_hook

        trainer.evaluate = training_hook(trainer)
    if cfg.rollout.mode == "async":
        trainer.pipeline = RolloutPipeline(
            engine, cursor, max_staleness=cfg.rollout.max_staleness, total_steps=cfg.train.steps,
            prompts_per_step=cfg.train.prompts_per_step, rank=info.rank, world_size=info.world_size,
            sampling_for=lambda step: sampling_params(cfg, seed=step_seed(cfg, step)),
        )
    if cfg.rollout.mode == "stream":
        trainer.pipeline = stream_pipeline(cfg, engine, cursor)
    return trainer


def stream_pipeline(cfg: GRPOConfig, engine, cursor: PromptCursor) -> StreamPipeline:
    """Stream mode's pool over the `vllm serve` client (`rollout.stream`); group i samples with `group_seed(i)`."""
    s, per_step = cfg.rollout.stream, cfg.train.prompts_per_step
    return StreamPipeline(engine, cursor, prompts_per_step=per_step, max_in_flight=s.max_in_flight,
                          max_buffered=s.max_buffered_groups or per_step, max_version_lag=s.max_version_lag,
                          on_stale=s.on_stale,
                          sampling_for=lambda i: sampling_params(cfg, seed=seeds.group_seed(cfg.train.seed, i)))


def check_vision_run(cfg: GRPOConfig) -> None:
    """Settings a vision-language model cannot take, refused before the model loads: megatron (no Megatron-core
    model of the vision tower)."""
    if cfg.distributed.backend == "megatron":
        raise UserError(f"distributed.backend: megatron has no model of a vision tower; {cfg.model.name_or_path} "
                        "is a vision-language model: use distributed.backend: ddp, fsdp2 or deepspeed.")


def share_cores(cfg: GRPOConfig, device) -> None:
    """Async mode on CPU: the trainer's torch threads get the cores the rollout actors do not reserve
    (actors on this machine: `rollout.ray.num_actors / processes` × `cpus_per_actor`)."""
    if device.type != "cpu":
        return
    import torch

    d, ray_cfg = cfg.distributed, cfg.rollout.ray
    local_actors = ray_cfg.num_actors // (d.num_processes * d.num_machines) * d.num_processes
    free = (os.cpu_count() or 1) - local_actors * ray_cfg.cpus_per_actor
    torch.set_num_threads(max(1, free // d.num_processes))


def _trainer_state(tr: Trainer, state: LoopState) -> dict:
    out = {**dataclasses.asdict(state), "cursor": tr.cursor.state_dict()}
    if tr.pipeline is not None:
        flight = tr.pipeline.state_dict()
        out["cursor"], out["rollouts_in_flight"] = flight["cursor"], flight["in_flight"]
    return out


def _resume(tr: Trainer, path: Path, state: LoopState, log) -> None:
    """Restore everything, then push the restored weights to the engine before its first generation."""
    saved = ckpt.load_checkpoint(path, cfg=tr.cfg, policy=tr.policy, verify=False)  # run_training verified it
    tr.cursor.load_state_dict(saved["cursor"])
    for f in dataclasses.fields(LoopState):
        setattr(state, f.name, saved[f.name])
    resynced = "engine shares the policy weights"
    if tr.sync is not None:
        tr.sync(state.weight_version, verify=tr.cfg.rollout.vllm.verify_sync)
        resynced = f"engine re-synced to weight version {state.weight_version}"
    else:
        tr.engine.weight_version = state.weight_version
    if tr.pipeline is not None:
        tr.pipeline.load_state_dict(saved.get("rollouts_in_flight", []))
        tr.pipeline.start_at(state.step)
        resynced += f"; {tr.pipeline.restored()}"
    log(f"resumed from {path}: step {state.step}, optimizer + scheduler + RNG + data cursor (epoch "
        f"{tr.cursor.epoch}, index {tr.cursor.index}) restored; {resynced}")


def export_final_model(tr: Trainer, path: Path, log) -> None:
    """A consolidated Hugging Face folder (`final-model/`, weights in `model.dtype`) gathered from any backend;
    with `model.lora`, the adapter folder (`final-adapter/`) and, with `model.lora.export_merged`, the merged
    model as `final-model/`."""
    backend, lora = tr.policy.backend, tr.cfg.model.lora
    folders = []
    if lora is not None:
        backend.export_adapter(path / "final-adapter")
        folders.append(("LoRA adapter", path / "final-adapter"))
        if lora.export_merged:
            backend.export_merged(path / "final-model")
            folders.append(("merged model", path / "final-model"))
    else:
        backend.export_hf(path / "final-model")
        folders.append(("final model", path / "final-model"))
    if tr.dist.is_main:
        for what, out in folders:
            tr.policy.tokenizer.save_pretrained(out)
            copy_processor_files(model_folder(tr.cfg.model.name_or_path), out)  # a VLM's image processor
            log(f"{what} ({backend.name}, {tr.cfg.model.dtype}) exported to {out}")
    barrier(tr.dist)


def stopped_by_signal(flag: SignalFlag, info: DistInfo) -> bool:
    """Whether a stop signal reached any rank (collective): a signal reaches each process on its own, and a rank
    that exported the final model (collective gathers) while its peer only checkpointed would wait forever."""
    return any_rank(flag.signum is not None, info)


def run_training(cfg: GRPOConfig, *, output_dir: str | None = None, reporter=None) -> dict:
    """Train per `cfg`; returns the summary (also written to summary.json). `reporter` renders progress."""
    quiet_hf_stack()
    device = resolve_device(cfg.distributed.device, local_rank_from_env())  # once; `auto` included
    info = init_from_env(device, timeout_minutes=cfg.distributed.timeout_minutes)
    path = Path(output_dir or cfg.logging.output_dir or default_output_dir(cfg))
    log = reporter.message if reporter is not None and info.is_main else (lambda *_: None)
    if faults := FaultPlan.from_env():  # a malformed value stops here, before anything loads
        log(faults.banner())
    resume = ckpt.resolve_resume(cfg.checkpoint.resume, path, info) if cfg.checkpoint.resume else None
    if resume is not None:
        # a corrupt checkpoint fails before anything is loaded or written; collective: each file hashed once, by
        # one rank, so no rank waits past the process group's timeout (the load below does not hash again)
        ckpt.verify_checkpoint(resume, info)
    trackers = open_trackers(cfg, path) if info.is_main else []  # a missing tracker package fails before loading
    trainer = build_trainer(cfg, info, device, log=log)
    state = LoopState()
    if resume is not None:
        _resume(trainer, resume, state, log)
    elif trainer.pipeline is not None:
        checks = trainer.sync(0, verify=cfg.rollout.vllm.verify_sync)
        held = (f"stream: {len(trainer.engine.urls)} vllm serve server(s)" if cfg.rollout.mode == "stream" else
                f"async: {len(trainer.engine.actors)} rollout actor(s) on Ray node "
                + ", ".join(sorted(set(trainer.engine.nodes))))
        log(f"{held} hold weight version 0"
            + (f" (verified: probe logprob diff {checks['sync/max_probe_diff']:.1e})" if "sync/max_probe_diff" in checks
               else ""))
    run_dir = RunDir(path, cfg) if info.is_main else None

    def save(st: LoopState) -> None:  # collective: sharded backends write one part per rank
        saved = ckpt.save_checkpoint(path, step=st.step, cfg=cfg, policy=trainer.policy,
                                     trainer_state=_trainer_state(trainer, st), keep_last=cfg.checkpoint.keep_last)
        log(f"checkpoint saved: {saved}")

    alarms = StepAlarms()

    def on_step(step, metrics, samples):
        if run_dir is not None:
            run_dir.log_step(step, metrics, samples)
        log_trackers(trackers, step, metrics)
        if reporter is not None and info.is_main:
            reporter.update(step, metrics, samples)
            for alarm in alarms.check(metrics):
                reporter.alarm(step, alarm)

    stopped = False
    try:
        with SignalFlag() as flag, StallWatchdog(trainer.timer, minutes=cfg.logging.stall_warning_minutes,
                                                  warn=log, dump_path=path / "stacks.log"):
            try:
                run_loop(trainer, state, on_step, save, should_stop=lambda: flag.signum is not None)
            except Exception as exc:
                if getattr(exc, "recovered", None) is False and state.step > 0:
                    save(state)  # rollout server gone: keep what was trained
                raise
            save(state)
            stopped = stopped_by_signal(flag, info)
            if not stopped:
                export_final_model(trainer, path, log)
            else:
                log(f"stopped by signal {flag.reason if flag.signum is not None else 'on another rank'} after step {state.step}; resume with "
                    f"--set checkpoint.resume=auto --output-dir {path}")
    finally:
        close_trackers(trackers)
        if trainer.pipeline is not None:
            trainer.pipeline.close()
        trainer.engine.close()
        if run_dir is not None:
            run_dir.close()
        release_own_group()  # a one-process job's 1-rank group, also when the run failed (a launched job's: shutdown)
    first, last = reward_rise(state.reward_history)
    summary = {"steps": state.step, "reward_first_10pct": first, "reward_last_10pct": last,
               "skipped_steps": state.skipped_steps, "output_dir": str(path), "interrupted": stopped,
               "world_size": info.world_size, "backend": trainer.policy.backend.name}
    if run_dir is not None:
        summary.update(run_dir.peaks)  # memory/*: the run's largest per-step peaks
        run_dir.write_summary(summary)
    shutdown(info)
    return summary
