"""One evaluation: this rank's share of the held-out prompts, sampled with the run's engine at a fixed seed and
scored with the run's reward functions."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.data.prompts import Prompt, tokenize_prompts
from grpo_cli.data.sources import DataError, load_rows
from grpo_cli.train.eval_metrics import local_sums, reduce_means
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.rewards.resolve import RewardFn, pop_reward_metrics
from grpo_cli.rollout.base import RolloutBatch, SamplingParams
from grpo_cli.rollout.seeds import eval_seed
from grpo_cli.train.scoring.rewards_phase import score_rollout

Generate = Callable[[list[Prompt], SamplingParams], RolloutBatch]


def eval_source(cfg: GRPOConfig) -> str:
    """`eval.source`, with `auto` resolved to the held-out split of the built-in training task."""
    if cfg.eval.source != "auto":
        return cfg.eval.source
    if not cfg.data.source.startswith("builtin:"):
        raise DataError(f"eval.source 'auto' needs a built-in data.source (got '{cfg.data.source}'); give the "
                        "evaluation prompts as eval.source (or --data).")
    return f"builtin:{cfg.data.source.split(':')[1]}:heldout"


def eval_sampling(cfg: GRPOConfig) -> SamplingParams:
    e, r = cfg.eval, cfg.rollout
    return SamplingParams(n=e.generations_per_prompt, max_tokens=e.max_completion_length or r.max_completion_length,
                          temperature=e.temperature, top_p=r.top_p, top_k=r.top_k,
                          seed=eval_seed(cfg.train.seed))


@dataclass
class Evaluator:
    """The fixed evaluation prompts of this rank and what scores them."""

    cfg: GRPOConfig
    prompts: list[Prompt]
    reward_fns: list[RewardFn]
    tokenizer: object
    dist: DistInfo

    @classmethod
    def build(cls, cfg: GRPOConfig, *, reward_fns: list[RewardFn], tokenizer, dist: DistInfo) -> Evaluator:
        """The first `eval.num_prompts` prompts of the eval source (in file order), split evenly over ranks."""
        from grpo_cli.data.images import ImageProcessor
        from grpo_cli.models.tiny import resolve_model_path

        source = eval_source(cfg)
        rows = load_rows(source, seed=cfg.train.seed)[: cfg.eval.num_prompts]
        images = ImageProcessor.load(resolve_model_path(cfg.model.name_or_path), max_pixels=cfg.data.max_image_pixels)
        prompts, _ = tokenize_prompts(rows, tokenizer, prompt_column=cfg.data.prompt_column,
                                      max_prompt_length=cfg.data.max_prompt_length, overlong_prompts="filter",
                                      images=images)
        if len(prompts) < dist.world_size:
            raise DataError(f"eval.source '{source}' gives {len(prompts)} usable prompt(s) (at most "
                            f"data.max_prompt_length tokens); evaluation needs at least one per process.")
        per_rank = len(prompts) // dist.world_size
        mine = prompts[dist.rank * per_rank : (dist.rank + 1) * per_rank]
        return cls(cfg, mine, reward_fns, tokenizer, dist)

    def run(self, generate: Generate) -> dict[str, float]:
        """Sample, score and reduce (collective): the `eval/*` metrics and `time/eval`."""
        start = time.perf_counter()
        sampling = eval_sampling(self.cfg)
        rollout = generate(self.prompts, sampling)
        scored = score_rollout(self.cfg, self.reward_fns, self.tokenizer, self.prompts, rollout,
                               group_size=sampling.n, max_completion_length=sampling.max_tokens)
        sums = local_sums(self.cfg.eval, per_func=scored.per_func, reward_fns=self.reward_fns,
                          completion_ids=rollout.completion_ids, group_size=sampling.n)
        out = reduce_means(sums, self.dist)
        out.update({f"eval/{k}": v for k, v in pop_reward_metrics(self.reward_fns).items()})  # this process's
        out["time/eval"] = time.perf_counter() - start
        return out


def due(cfg: GRPOConfig, step: int) -> bool:
    """Evaluate after every `eval.every_steps`-th step and after the last."""
    every = cfg.eval.every_steps
    return bool(every) and (step % every == 0 or step == cfg.train.steps)


def training_hook(trainer) -> Callable[[int], dict[str, float]]:
    """`Trainer.evaluate`: after a due step, evaluate with the trainer's engine through the loop's generation path
    (offload, autocast for the hf engine, server recovery; the Ray actors in async mode)."""
    from grpo_cli.train.loop import generate_phase

    cfg = trainer.cfg
    evaluator = Evaluator.build(cfg, reward_fns=trainer.reward_fns, tokenizer=trainer.policy.tokenizer,
                                dist=trainer.dist)

    def evaluate(step: int) -> dict[str, float]:
        if not due(cfg, step):
            return {}
        # No weight sync follows evaluation: a sleeping vLLM engine must keep its weights (level 1, not 2) after it.
        with trainer.engine.keeping_weights():
            return evaluator.run(lambda prompts, sampling: generate_phase(trainer, prompts, seed=None,
                                                                          sampling=sampling))

    return evaluate
