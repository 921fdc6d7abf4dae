"""Request seeds of the clients of `grpo serve-rollout` and SGLang (issue 47, item 3), built as the trainer builds them
(`make_engine` with the rank's `EngineContext`): every rank sends the step's seed, the client keys each request by
rank and prompt (`rollout/seeds.py`), so a prompt on two ranks, or twice in one step, gets distinct completions from
the real hf engine behind the server. The seed function itself: tests/rollout/test_seeds_distinct.py."""

from __future__ import annotations

import pytest
from served_app import app_in_thread

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.rollout.base import EngineContext, SamplingParams
from grpo_cli.rollout.factory import make_engine
from grpo_cli.rollout.seeds import child_seed, request_seed, step_seed
from grpo_cli.server.app import create_app
from grpo_cli.server.engines import ServeOptions
from grpo_cli.server.launch import sglang_command
from grpo_cli.server.sglang_contract import create_contract_app

PROMPT = [3, 5, 7, 9]
SEED = step_seed(0, 0)


def _engine(engine: str, url: str, model: str, rank: int, tmp_path):
    server = {"urls": [url], "connect_timeout_s": 5, "retries": 0}
    if engine == "sglang":
        server["weight_sync_dir"] = str(tmp_path)
    cfg = GRPOConfig.model_validate({"model": {"name_or_path": model},
                                     "rollout": {"engine": engine, "mode": "server", "server": server}})
    return make_engine(cfg, EngineContext(model, [1], 0, rank=rank, world_size=2))


def _completions(eng, prompts) -> list[tuple]:
    try:
        return [tuple(c) for c in eng.generate(prompts, SamplingParams(n=3, max_tokens=10, seed=SEED)).completion_ids]
    finally:
        eng.close()


def test_serve_rollout_client_keys_each_ranks_request(served_tiny, tiny_checkpoint, tmp_path, monkeypatch):
    """One request per server slice with `request_seed(step seed, rank, first prompt)`; the server's hf engine
    derives its generator's seed from it. Before: every rank sent the step's seed, so rank 0 and rank 1 sampled
    a shared prompt identically."""
    got = []
    real = served_tiny.engine.generate
    def generate(prompts, sampling, *args, **kwargs):
        got.append(sampling.seed)
        return real(prompts, sampling, *args, **kwargs)

    monkeypatch.setattr(served_tiny.engine, "generate", generate)
    with app_in_thread(create_app(served_tiny)) as url:
        every = [c for r in (0, 1) for c in _completions(_engine("hf", url, tiny_checkpoint, r, tmp_path), [PROMPT])]
    assert len(set(every)) == len(every) == 6
    assert got == [request_seed(SEED, rank=r, prompt=0) for r in (0, 1)]


def test_sglang_client_seeds_each_child_by_rank_prompt_and_child(served_tiny, tiny_checkpoint, tmp_path):
    """One input per completion with `child_seed(step seed, rank, prompt, child)` (SGLang's launcher turns on
    deterministic inference, so the seed decides the draw). Before: `seed + i·n + j`, the same on every rank and
    shifted by one per step."""
    launch = sglang_command(ServeOptions(engine="sglang", model=tiny_checkpoint))  # what serve-rollout runs
    app = create_contract_app(served_tiny, launch_args=launch)
    with app_in_thread(app) as url:
        every, sent = [], []
        for r in (0, 1):
            every += _completions(_engine("sglang", url, tiny_checkpoint, r, tmp_path / str(r)), [PROMPT, PROMPT])
            sent += [p["sampling_seed"] for p in app.state.contract["requests"][-1]["sampling_params"]]
    assert len(set(every)) == len(every) == 12
    assert sent == [child_seed(SEED, rank=r, prompt=i, child=j) for r in (0, 1) for i in (0, 1) for j in range(3)]
