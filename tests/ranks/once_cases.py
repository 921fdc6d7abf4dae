"""The rank-divergence cases of divergence_worker.py that do not depend on the training backend: metric keys on one
rank only, dynamic sampling drawing different rounds, a stop signal on one rank, a served teacher failing for one
rank's request. Each returns what this rank saw."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from grpo_cli.config.load import build_config
from grpo_cli.data.prompts import Prompt
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.runtime.dist import DistInfo, all_gather_object, all_reduce_sum, mean_metrics
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.scoring.dynamic_sampling import fill_step
from grpo_cli.train.scoring.rewards_phase import ScoredRollout

G = 2


def metrics_case(info: DistInfo) -> dict:
    """Rank 1 reports a `tools/*` key rank 0 lacks and a NaN reward mean (all its rewards missing)."""
    if info.rank == 0:
        mine = {"loss": 1.0, "reward/mean": 2.0, "memory/peak_rss_mb": 10.0}
    else:
        mine = {"loss": 3.0, "reward/mean": math.nan, "memory/peak_rss_mb": 20.0, "tools/calls_per_rollout": 1.5}
    return mean_metrics(mine, info)


def _scored(tag: str, rewards: list[list[float]]) -> ScoredRollout:
    """One group per inner list of G rewards."""
    prompts = [Prompt(f"{tag}{k}", [k], {}) for k in range(len(rewards))]
    ids = [[100 * k + j] for k in range(len(rewards)) for j in range(G)]
    batch = RolloutBatch(prompt_ids=[p.ids for p in prompts], completion_ids=ids, finish_reasons=["stop"] * len(ids),
                         sampler_logprobs=None, weight_version=0, timings={})
    per_func = torch.tensor([r for group in rewards for r in group]).unsqueeze(1)
    return ScoredRollout(prompts, batch, [str(i[0]) for i in ids], per_func)


def dynamic_case(info: DistInfo) -> dict:
    """Rank 0's first round is all informative; rank 1's has one informative group of three and each extra round one
    more: every rank must draw (generation and the prompt cursor are shared) until rank 1 is full."""
    informative, flat = [0.0, 1.0], [1.0, 1.0]
    first = _scored("a", [informative] * 3 if info.rank == 0 else [informative, flat, flat])
    drawn: list[int] = []

    def draw(r: int) -> ScoredRollout:
        drawn.append(r)
        all_gather_object(("generate", r), info)  # a round's generation is collective (TP gathers, the cursor)
        return _scored(f"r{r}", [informative, flat, flat])

    batch, _, metrics = fill_step(first, draw, weights=[1.0], group_size=G, max_extra_rounds=4, dist=info)
    return {"drawn": drawn, "groups": len(batch.prompts), "rows": len(batch.rollout.completion_ids),
            "metrics": mean_metrics(metrics, info)}


def stop_case(info: DistInfo) -> dict:
    """`run_loop` where rank 0 alone receives a stop signal after step 1; each step runs a collective."""
    from grpo_cli.train import loop

    steps = []

    def run_step(tr, state):
        steps.append(all_reduce_sum(1.0, info))
        return {"reward/mean": 0.0}, []

    from grpo_cli.runtime.faults import FaultPlan
    from grpo_cli.train.run import stopped_by_signal

    settled = []  # rank 0's engine (stream mode's way) settles its background checks; the ranks agree on them
    engine = SimpleNamespace(push_from_main_only=True, settle_checks=lambda: settled.append(state.step) or {"x": 1.0})
    tr = SimpleNamespace(cfg=build_config(overrides=["train.steps=4"]), dist=info, evaluate=None, faults=FaultPlan(),
                         engine=engine)
    state = loop.LoopState()
    real, loop.run_step = loop.run_step, run_step
    try:
        loop.run_loop(tr, state, lambda *a: None, should_stop=lambda: info.rank == 0 and state.step >= 1)
    finally:
        loop.run_step = real
    # after the loop, run.py exports the final model (collective) only where no rank was stopped
    stopped = stopped_by_signal(SimpleNamespace(signum=15 if info.rank == 0 else None), info)
    return {"steps": state.step, "collectives": steps, "stopped": stopped, "settled": settled}


def teacher_case(ckpt: str, url: str, info: DistInfo, cfg) -> dict:
    """A served teacher (`grpo serve-rollout`, max_model_len below rank 1's rows) refuses rank 1's /score request."""
    from grpo_cli.train.policy import load_tokenizer
    from grpo_cli.train.distill import distill_phase, served_teacher

    teacher = served_teacher(cfg, ckpt, load_tokenizer(ckpt))
    width = 2 if info.rank == 0 else 10
    ids = torch.randint(6, 40, (2, 4 + width), generator=torch.Generator().manual_seed(info.rank))
    batch = TrainBatch(ids, torch.ones_like(ids), torch.ones(2, width), advantages=torch.tensor([1.0, -1.0]),
                       truncated=torch.zeros(2, dtype=torch.bool))
    try:
        metrics = distill_phase(cfg, batch, teacher, lambda: torch.zeros(2, width), info=info)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"raised": type(exc).__name__, "message": str(exc)[:300]}
    return {"raised": None, "keys": sorted(metrics)}


def resume_case(info: DistInfo, root: str) -> dict:
    """`checkpoint.resume: auto` on machines without a shared output directory: only rank 1's disk holds a complete
    checkpoint (its manifest written)."""
    from pathlib import Path

    from grpo_cli.train.checkpoint import resolve_resume
    from grpo_cli.train.manifest import MANIFEST

    mine = Path(root, f"output-rank{info.rank}")
    if info.rank == 1:
        (mine / "checkpoint-2").mkdir(parents=True)
        (mine / "checkpoint-2" / MANIFEST).write_text("{}")
    try:
        found = resolve_resume("auto", mine, info)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"raised": type(exc).__name__, "message": str(exc)[:300]}
    return {"raised": None, "found": None if found is None else found.name}
