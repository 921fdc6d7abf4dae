"""Issue 49 (4): `data.max_prompt_length + rollout.max_completion_length` reaches every engine and server, and a
server started for shorter sequences is refused when the run connects (naming both numbers and the flag that fixes
it), not mid-run when the first long prompt arrives: `grpo serve-rollout` (its `/info`), a stock `vllm serve` (its
resolved config), SGLang (its `--context-length`, which refuses a request whose prompt + completion reaches it);
`rollout.vllm.max_model_len` below the sum is refused before any model loads (colocated vLLM and the async actors
build vLLM with it)."""

from __future__ import annotations

import pytest
from served_app import app_in_thread

from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.rollout.base import EngineContext, RolloutError, SamplingParams
from grpo_cli.rollout.factory import make_engine
from grpo_cli.rollout.sglang.client import SGLangEngine
from grpo_cli.rollout.transport.http_client import Policy
from grpo_cli.server.app import create_app
from grpo_cli.server.engines import ServeOptions, build
from grpo_cli.server.launch import sglang_command
from grpo_cli.server.sglang_contract import create_contract_app

FAST = ["rollout.server.connect_timeout_s=5", "rollout.server.retries=0"]


def _lengths(prompt: int, completion: int) -> list[str]:
    return [f"data.max_prompt_length={prompt}", f"rollout.max_completion_length={completion}"]


def test_grpo_serve_rollout_started_shorter_is_refused_at_connect(tiny_checkpoint):
    served = build(ServeOptions(engine="hf", model=tiny_checkpoint, max_model_len=64))
    with app_in_thread(create_app(served, token=None)) as url:
        sets = ["rollout.mode=server", f'rollout.server.urls=["{url}"]', *FAST]
        ctx = EngineContext(model_path=tiny_checkpoint, eos_token_ids=[1], pad_token_id=0)
        with pytest.raises(RolloutError, match=r"was started with --max-model-len 64, but this run's sequences "
                                               r"reach data.max_prompt_length 16 \+ rollout.max_completion_length "
                                               r"49 = 65 tokens.*--max-model-len 65"):
            make_engine(build_config(overrides=[*sets, *_lengths(16, 49)]), ctx)
        make_engine(build_config(overrides=[*sets, *_lengths(16, 48)]), ctx).close()  # 64: exactly what it holds


def test_vllm_serve_started_shorter_is_refused_at_connect():
    """The client reads vLLM's resolved `max_model_len` at connect (before: only the longest prompt of each step
    was checked, so a run failed hours in, at its first long prompt)."""
    from fastapi import FastAPI

    app = FastAPI()
    config = {"model_config": {"dtype": "torch.float32", "logprobs_mode": "processed_logprobs", "max_model_len": 128},
              "parallel_config": {"tensor_parallel_size": 1}, "scheduler_config": {"enable_chunked_prefill": False},
              "device_config": {"device": "cpu"}, "weight_transfer_config": {"backend": "grpo_shm"}}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/weight_info")
    async def weight_info():
        return {}

    @app.get("/server_info")
    async def server_info():
        return {"vllm_config": config}

    with app_in_thread(app) as url:
        cfg = build_config("tiny-cpu-vllm-serve", overrides=[f'rollout.server.urls=["{url}"]', *FAST,
                                                             *_lengths(100, 29)])
        with pytest.raises(RolloutError, match=r"vllm serve at .* was started with --max-model-len 128, but this "
                                               r"run's sequences reach .* = 129 tokens.*--max-model-len 129"):
            make_engine(cfg, EngineContext(model_path="m", eos_token_ids=[1], pad_token_id=0))


def test_sglang_context_length_leaves_room_for_the_longest_sequence(served_tiny, tiny_checkpoint):
    """SGLang refuses a request whose prompt + max_new_tokens reaches `--context-length` (tokenizer_manager.py
    `_validate_one_request`), so `grpo serve-rollout --engine sglang --max-model-len 64` launches it with 65, and a
    run past what the server reports is refused at connect."""
    args = sglang_command(ServeOptions(engine="sglang", model=tiny_checkpoint, max_model_len=64))
    assert args[args.index("--context-length") + 1] == "65"
    app = create_contract_app(served_tiny, launch_args=args)
    with app_in_thread(app) as url:
        sets = ["rollout.engine=sglang", "rollout.mode=server", f'rollout.server.urls=["{url}"]', *FAST,
                "rollout.server.weight_transport=disk"]
        ctx = EngineContext(model_path=tiny_checkpoint, eos_token_ids=[1], pad_token_id=0)
        eng = make_engine(build_config(overrides=[*sets, *_lengths(16, 48)]), ctx)  # 64 < 65: SGLang takes it
        assert len(eng.generate([[3] * 16], SamplingParams(n=1, max_tokens=48, seed=0)).completion_ids) == 1
        eng.close()
        with pytest.raises(RolloutError, match=r"SGLang server at .* was started with --context-length 65, but this "
                                               r"run's sequences reach .* = 65 tokens.*--context-length 66"):
            make_engine(build_config(overrides=[*sets, *_lengths(16, 49)]), ctx)
    exact = args[:args.index("--context-length") + 1] + ["64"] + args[args.index("--context-length") + 2:]
    with app_in_thread(create_contract_app(served_tiny, launch_args=exact)) as url:  # what the launcher passed before
        eng = SGLangEngine([url], policy=Policy(connect_timeout_s=5, retries=0), model_path=tiny_checkpoint)
        with pytest.raises(RolloutError, match="exceeds the model's maximum context length of 64 tokens"):
            eng.generate([[3] * 16], SamplingParams(n=1, max_tokens=48, seed=0))
        eng.close()


def test_vllm_max_model_len_below_the_longest_sequence_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.vllm.max_model_len=100 is below data.max_prompt_length 64 \+ "
                                          r"rollout.max_completion_length 64 = 128.*at least 128"):
        build_config("tiny-cpu-vllm", overrides=[*_lengths(64, 64), "rollout.vllm.max_model_len=100"])
    assert build_config("tiny-cpu-vllm", overrides=[*_lengths(64, 64), "rollout.vllm.max_model_len=128"])
