"""The GRPO loop: rollout → reward → advantage → old/ref logprobs → loss → optimizer step → weight sync."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo_cli.config.errors import UserError
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.data.prompts import PromptCursor, images_of, vision_of
from grpo_cli.runtime.dist import DistInfo, all_reduce_sum, any_rank, mean_metrics
from grpo_cli.runtime.faults import FaultPlan
from grpo_cli.rewards.resolve import RewardFn
from grpo_cli.rollout.base import RolloutEngine, SamplingParams, generate_with_images
from grpo_cli.rollout import seeds
from grpo_cli.rollout.factory import sampling_params
from grpo_cli.train.batch import TrainBatch, build_batch
from grpo_cli.train.distill import TeacherScore, distill_phase
from grpo_cli.train.scoring.dynamic_sampling import fill_step
from grpo_cli.train.sequence_parallel import data_parallel_size, gather_batch
from grpo_cli.train.loss import trained_mask
from grpo_cli.train.pipeline import RolloutPipeline, take_step_prompts
from grpo_cli.train.stream_pool import StreamPipeline
from grpo_cli.train.policy import Policy
from grpo_cli.train.scoring.rewards_phase import ScoredRollout, reward_step, score_rollout
from grpo_cli.train.step import NonFiniteStep, optimizer_step
from grpo_cli.train.weights.sync_ranks import generate_with_resync
from grpo_cli.train.weights.weight_sync import settle_deferred
from grpo_cli.train.supervise.timing import PhaseTimer, peak_rss_mb

StepCallback = Callable[[int, dict[str, float], list[dict]], None]


@dataclass
class LoopState:
    """What advances every step (checkpointed with the policy)."""

    step: int = 0
    weight_version: int = 0
    nonfinite_streak: int = 0
    skipped_steps: int = 0
    reward_history: list[float] = field(default_factory=list)


@dataclass
class Trainer:
    """The parts the loop drives. `on_step(step, metrics, samples)` renders and logs (rank 0)."""

    cfg: GRPOConfig
    policy: Policy
    engine: RolloutEngine
    cursor: PromptCursor
    reward_fns: list[RewardFn]
    dist: DistInfo
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    sync: Callable[[int], dict[str, float]] | None = None
    offload: object | None = None
    pipeline: RolloutPipeline | StreamPipeline | None = None
    """Async mode: batches generated ahead of the step that trains on them; stream mode: the pool of groups."""
    evaluate: Callable[[int], dict[str, float]] | None = None
    """`eval.every_steps`: held-out metrics after a step (empty when none is due)."""
    teacher: TeacherScore | None = None
    """`algorithm.distill`: the teacher's logprobs of a batch's completion tokens."""
    faults: FaultPlan = field(default_factory=FaultPlan.from_env)
    """`GRPO_INJECT_FAULT`: failures injected on purpose (rehearsals, reliability tests)."""


class TrainingStopped(UserError):
    """Too many non-finite steps in a row (or `train.on_nonfinite: stop`); reported without a traceback."""


def step_seed(cfg: GRPOConfig, step: int) -> int:
    """Sampling seed of a step: a function of (seed, step) only, so a resumed run samples the same batches."""
    return seeds.step_seed(cfg.train.seed, step)


def rollout_phase(tr: Trainer, state: LoopState):
    """Take this rank's prompts and sample G completions of each (async mode: collect the batch generated
    ahead, after queueing the next ones; `generate` then times only the wait the trainer sees)."""
    cfg, step = tr.cfg, state.step
    if tr.pipeline is not None:
        with tr.timer.phase("generate"):
            tr.pipeline.top_up(step)
            return tr.pipeline.take(step, state.weight_version)
    prompts = take_step_prompts(tr.cursor, prompts_per_step=cfg.train.prompts_per_step, rank=tr.dist.rank,
                                world_size=tr.dist.world_size)
    return prompts, generate_phase(tr, prompts, seed=step_seed(cfg, step))


def generate_phase(tr: Trainer, prompts, *, seed: int | None, sampling: SamplingParams | None = None):
    """Sample G completions of each prompt with the engine (training state offloaded meanwhile, if configured);
    `sampling` (e.g. evaluation's) replaces the step's sampling parameters."""
    if tr.offload is not None:
        with tr.timer.phase("offload"):
            tr.offload.offload()
    # The hf engine runs the policy's own forward: it computes in the trainer's dtype (autocast under ddp).
    compute = tr.policy.backend.compute_context() if tr.engine.shares_policy_weights else contextlib.nullcontext()
    tr.engine.bind_prompts(prompts)  # multi-turn: an environment is reset with each prompt's row
    with tr.timer.phase("generate"), compute:
        rollout = generate_with_recovery(tr, [p.ids for p in prompts], sampling or sampling_params(tr.cfg, seed=seed),
                                         images=images_of(prompts))
    if tr.offload is not None:
        with tr.timer.phase("offload"):
            tr.offload.reload()
    return rollout


def extra_round(tr: Trainer, state: LoopState, round_index: int) -> ScoredRollout:
    """Dynamic sampling: this rank's share of `prompts_per_step` new prompts, generated (with the current
    weights, also in async mode) and scored."""
    cfg = tr.cfg
    prompts = take_step_prompts(tr.cursor, prompts_per_step=cfg.train.prompts_per_step, rank=tr.dist.rank,
                                world_size=tr.dist.world_size)
    rollout = generate_phase(tr, prompts, seed=seeds.round_seed(step_seed(cfg, state.step), round_index))
    with tr.timer.phase("reward"):
        return score_rollout(cfg, tr.reward_fns, tr.policy.tokenizer, prompts, rollout)


def score_phase(tr: Trainer, state: LoopState) -> tuple[ScoredRollout, ScoredRollout, dict[str, float]]:
    """Generate and score the step's batch: (batch to train on, everything generated, metrics). With
    `train.dynamic_sampling`, groups of identical rewards are replaced by groups of new prompts."""
    cfg = tr.cfg
    prompts, rollout = rollout_phase(tr, state)
    with tr.timer.phase("reward"):
        scored = score_rollout(cfg, tr.reward_fns, tr.policy.tokenizer, prompts, rollout)
    ds = cfg.train.dynamic_sampling
    if not ds.enabled:
        return scored, scored, {}
    return fill_step(scored, lambda r: extra_round(tr, state, r), weights=[f.weight for f in tr.reward_fns],
                     group_size=cfg.train.generations_per_prompt, max_extra_rounds=ds.max_extra_rounds, dist=tr.dist)


def generate_with_recovery(tr: Trainer, prompt_ids: list[list[int]], sampling, images: list[list] | None = None):
    """Generate (with each prompt's `images` when some prompt has one: the engine `accepts_images`, checked when
    the run starts); when a rollout server died and came back (`recovered`), push the weights again and retry once
    (`sync_ranks.generate_with_resync`: collectively where rank 0 alone pushes)."""
    return generate_with_resync(tr.engine, tr.sync, tr.dist,
                                lambda: generate_with_images(tr.engine, prompt_ids, sampling, images))


def logprob_phase(tr: Trainer, batch: TrainBatch) -> dict[str, float]:
    """Old-policy logprobs only when μ > 1 (at μ = 1 they equal the first forward, detached); reference only
    when β > 0; with `algorithm.distill`, the teacher's, and the distilled advantages (returns its metrics)."""
    cfg, micro, temp = tr.cfg, tr.cfg.train.micro_batch_size, tr.cfg.rollout.temperature
    backend = tr.policy.backend
    with tr.timer.phase("logprobs"):
        if cfg.algorithm.num_iterations > 1:
            batch.old_logprobs = backend.batch_logprobs(batch, micro_batch_size=micro, temperature=temp)
        if cfg.algorithm.kl.beta > 0:
            batch.ref_logprobs = backend.batch_logprobs(batch, micro_batch_size=micro, temperature=temp,
                                                        reference=True)
        if tr.teacher is not None:  # the student's behaviour logprobs: the old ones, or the same no-grad pass
            return distill_phase(cfg, batch, tr.teacher, lambda: backend.batch_logprobs(
                batch, micro_batch_size=micro, temperature=temp), info=tr.dist)
    return {}


def train_phase(tr: Trainer, state: LoopState, batch: TrainBatch) -> dict[str, float]:
    """μ optimizer steps on the batch; non-finite steps are skipped (counted) or stop the run. The backends raise
    `NonFiniteStep` on every rank together (`TrainingBackend.agree_finite`), so every rank counts the same skips
    and stops at the same step."""
    cfg = tr.cfg
    trained = trained_mask(batch.completion_mask, batch.truncated, algorithm=cfg.algorithm)
    shard = tr.policy.backend.sequence  # a sequence-parallel group's ranks hold the same rows: count them once
    num_items = all_reduce_sum(float(trained.sum()), tr.dist) / (1 if shard is None else shard.size)
    poison = tr.faults.nonfinite_loss(rank=tr.dist.rank, step=state.step + 1)
    out: dict[str, float] = {}
    with tr.timer.phase("train"):
        for _ in range(cfg.algorithm.num_iterations):
            try:
                out = optimizer_step(tr.policy, batch, cfg, num_items=num_items,
                                     num_sequences=len(batch) * data_parallel_size(tr.dist, shard),
                                     inject_nonfinite=poison)
                state.nonfinite_streak = 0
            except NonFiniteStep as exc:
                state.nonfinite_streak += 1
                state.skipped_steps += 1
                if cfg.train.on_nonfinite == "stop" or state.nonfinite_streak >= cfg.train.max_consecutive_nonfinite:
                    raise TrainingStopped(
                        f"{exc} at step {state.step + 1} ({state.nonfinite_streak} in a row); stopping. Lower "
                        "train.learning_rate or check the reward scale; the last checkpoint is intact."
                    ) from exc
    out["train/skipped_steps"] = float(state.skipped_steps)
    return out


def sync_phase(tr: Trainer, state: LoopState) -> dict[str, float]:
    """Push the new weights to the engine (no-op when it generates with the policy's own parameters)."""
    state.weight_version += 1
    with tr.timer.phase("sync"):
        if tr.engine.shares_policy_weights or tr.sync is None:
            tr.engine.weight_version = state.weight_version
            return {}
        return tr.sync(state.weight_version)


def take_deferred_probe(engine) -> dict[str, float]:
    """The last sync's probe figures (`sync/max_probe_diff`, …) when a sleeping vLLM engine scored them at this
    step's wake-up (`VLLMEngine.probe_when_awake`), once: the engine's record is emptied."""
    figures = engine.last_probe or {}
    if figures:
        engine.last_probe = {}
    return figures


def run_step(tr: Trainer, state: LoopState) -> tuple[dict[str, float], list[dict]]:
    """One full GRPO step; returns rank-averaged metrics and a few sample completions."""
    cfg, start = tr.cfg, time.perf_counter()
    scored, generated, sampling_metrics = score_phase(tr, state)
    prompts, rollout, completions = scored.prompts, scored.rollout, scored.completions
    with tr.timer.phase("reward"):
        advantages, rewards, metrics = reward_step(cfg, tr.reward_fns, scored, generated)
    metrics.update(sampling_metrics)
    batch = build_batch(rollout, group_size=cfg.train.generations_per_prompt,
                        pad_token_id=tr.policy.tokenizer.pad_token_id, vision=vision_of(prompts))
    batch.advantages = advantages
    shard = tr.policy.backend.sequence
    batch = gather_batch(batch, shard, pad_token_id=tr.policy.tokenizer.pad_token_id).to(tr.policy.device)
    metrics.update(logprob_phase(tr, batch))
    metrics.update(train_phase(tr, state, batch))
    if state.step == 0:
        local, total = tr.policy.backend.param_numel()
        metrics.update({"dist/param_numel_local": float(local), "dist/param_numel_total": float(total),
                        "dist/sequence_parallel": float(1 if shard is None else shard.size)})
    metrics.update(sync_phase(tr, state))
    metrics.update(tr.timer.pop())
    for kind, moved in getattr(tr.offload, "moved_bytes", {}).items():  # measured, not what the config asked
        metrics[f"offload/moved_bytes/{kind}"] = float(moved)
    metrics.update(take_deferred_probe(tr.engine))
    elapsed = time.perf_counter() - start
    metrics["time/step"] = elapsed
    metrics["tokens_per_second"] = float(batch.completion_mask.sum()) * data_parallel_size(tr.dist, shard) / elapsed
    metrics["memory/peak_rss_mb"] = peak_rss_mb()
    metrics["weight_version"] = float(state.weight_version)
    metrics["staleness"] = float(state.weight_version - 1 - rollout.weight_version)
    if tr.pipeline is not None:
        metrics.update(tr.pipeline.step_metrics(rollout))
    metrics.update(rollout.metrics)  # tools/* of a multi-turn rollout
    samples = [
        {"step": state.step, "prompt": prompts[j // cfg.train.generations_per_prompt].text,
         "completion": completions[j], "reward": float(rewards[j]), "advantage": float(advantages[j].flatten()[0]),
         **({"messages": rollout.trajectories[j]} if rollout.trajectories is not None else {})}
        for j in range(min(cfg.logging.log_completions, len(completions)))
    ]
    return mean_metrics(metrics, tr.dist), samples


def run_loop(tr: Trainer, state: LoopState, on_step: StepCallback, on_checkpoint: Callable[[LoopState], None]
             | None = None, should_stop: Callable[[], bool] = lambda: False) -> LoopState:
    """Run steps `state.step .. train.steps-1`, calling `on_step` after each and `on_checkpoint` when due;
    `should_stop()` (a signal arrived) ends the loop between steps, on every rank at the same step: a signal reaches
    each process on its own, and a rank that stopped alone would save (collectively) while its peers train on."""
    every = tr.cfg.checkpoint.every_steps
    while state.step < tr.cfg.train.steps and not any_rank(should_stop(), tr.dist):
        tr.faults.kill_if_due(rank=tr.dist.rank, step=state.step + 1)
        metrics, samples = run_step(tr, state)
        state.reward_history.append(metrics["reward/mean"])
        state.step += 1
        due = on_checkpoint is not None and every and state.step % every == 0 and state.step < tr.cfg.train.steps
        if due or state.step >= tr.cfg.train.steps:  # a checkpoint holds only steps whose syncs passed their checks
            metrics.update(settle_deferred(tr.engine, tr.dist))
        if tr.evaluate is not None:
            metrics.update(tr.evaluate(state.step))
        on_step(state.step, metrics, samples)
        if due:
            on_checkpoint(state)
    settle_deferred(tr.engine, tr.dist)  # stopped by a signal: the save that follows holds verified steps only
    return state


def reward_rise(history: list[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last 10% of steps (at least one step each)."""
    k = max(1, len(history) // 10)
    first = torch.tensor(history[:k]).nanmean()
    last = torch.tensor(history[-k:]).nanmean()
    return float(first), float(last)
