"""`grpo train` in one process (or one worker of a launched job): build the parts, run the loop, summarise."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.data.prompts import PromptCursor, tokenize_prompts
from grpo_cli.data.sources import load_rows
from grpo_cli.launch.dist import DistInfo, init_from_env
from grpo_cli.rewards.resolve import build_reward_fns
from grpo_cli.rollout.factory import EngineContext, make_engine
from grpo_cli.train.loop import LoopState, Trainer, reward_rise, run_loop
from grpo_cli.train.policy import eos_token_ids, load_policy, pick_device
from grpo_cli.train.run_dir import RunDir, default_output_dir
from grpo_cli.train.tiny_model import resolve_model_path


def _wrap_ddp(info: DistInfo):
    if info.world_size == 1:
        return None
    from torch.nn.parallel import DistributedDataParallel

    return lambda module: DistributedDataParallel(module)


def build_trainer(cfg: GRPOConfig, info: DistInfo, *, log=print) -> Trainer:
    """Load data, rewards, policy and engine for this process."""
    model_path = resolve_model_path(cfg.model.name_or_path)
    device = pick_device(cfg, info.local_rank)
    reward_fns = build_reward_fns(cfg.rewards.functions)
    policy = load_policy(cfg, model_path, device=device, wrap=_wrap_ddp(info))
    rows = load_rows(cfg.data.source, seed=cfg.train.seed)
    prompts, dropped = tokenize_prompts(
        rows, policy.tokenizer, prompt_column=cfg.data.prompt_column,
        max_prompt_length=cfg.data.max_prompt_length, overlong_prompts=cfg.data.overlong_prompts,
    )
    if dropped:
        log(f"data: dropped {dropped} of {len(rows)} prompts longer than {cfg.data.max_prompt_length} tokens")
    cursor = PromptCursor(prompts, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    ctx = EngineContext(model_path, eos_token_ids(policy.tokenizer, policy.module), policy.tokenizer.pad_token_id,
                        info.rank, info.world_size)
    engine = make_engine(cfg, ctx, policy=policy.module)
    trainer = Trainer(cfg, policy, engine, cursor, reward_fns, info)
    if not engine.shares_policy_weights:
        from grpo_cli.train.weight_sync import sync_weights

        trainer.sync = lambda version: sync_weights(
            engine, policy.module, version=version, bucket_mb=cfg.distributed.weight_sync_bucket_mb,
            verify=cfg.rollout.vllm.verify_sync, probe=[prompts[0].ids],
        )
    return trainer


def run_training(cfg: GRPOConfig, *, output_dir: str | None = None, reporter=None) -> dict:
    """Train per `cfg`; returns the summary (also written to summary.json). `reporter` renders progress."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    info = init_from_env("cuda" if cfg.distributed.device == "cuda" else "cpu")
    path = Path(output_dir or cfg.logging.output_dir or default_output_dir(cfg))
    run_dir = RunDir(path, cfg) if info.is_main else None
    log = reporter.message if reporter is not None and info.is_main else (lambda *_: None)
    trainer = build_trainer(cfg, info, log=log)
    state = LoopState()

    def on_step(step, metrics, samples):
        if run_dir is not None:
            run_dir.log_step(step, metrics, samples)
        if reporter is not None and info.is_main:
            reporter.update(step, metrics)

    try:
        run_loop(trainer, state, on_step)
    finally:
        trainer.engine.close()
        if run_dir is not None:
            run_dir.close()
    first, last = reward_rise(state.reward_history)
    summary = {"steps": state.step, "reward_first_10pct": first, "reward_last_10pct": last,
               "skipped_steps": state.skipped_steps, "output_dir": str(path)}
    if run_dir is not None:
        run_dir.write_summary(summary)
    return summary
