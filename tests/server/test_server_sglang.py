"""SGLangEngine against a contract server (grpo_cli/server/sglang_contract.py), which is written from
SGLang's documented native request/response schema (sglang 0.5.23 http_server.py / io_struct.py) and is NOT
SGLang: SGLang needs CUDA and cannot run on these machines. Plus `serve-rollout --engine sglang`'s command
and its error when sglang is not installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from served_app import app_in_thread

from grpo_cli.rollout.base import RolloutError, SamplingParams
from grpo_cli.rollout.scoring import completion_logprobs, score_sequences
from grpo_cli.rollout.sglang_client import SGLangEngine
from grpo_cli.server.engines import ServeError, ServeOptions
from grpo_cli.server.launch import run_sglang, sglang_command
from grpo_cli.server.sglang_contract import create_contract_app, safetensors_b64_serializer
from grpo_cli.server.transport import Policy

KEY = "sgl-key"
FAST = Policy(connect_timeout_s=5, request_timeout_s=30, retries=0)


@pytest.fixture
def sgl(served_tiny, tiny_checkpoint, tmp_path):
    app = create_contract_app(served_tiny, api_key=KEY)
    with app_in_thread(app) as url:
        eng = SGLangEngine([url], policy=FAST, api_key=KEY, stop_token_ids=[1], model_path=tiny_checkpoint,
                           weight_sync_dir=str(tmp_path / "sync"))
        yield eng, app.state.contract, served_tiny
        eng.close()


def _trained(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    return model.eval()


def _max_diff(a, b):
    return max(abs(x - y) for r, s in zip(a, b, strict=True) for x, y in zip(r, s, strict=True))


def test_generate_request_schema_groups_and_logprobs(sgl):
    eng, state, served = sgl
    batch = eng.generate([[3, 4, 5], [6, 7]], SamplingParams(n=2, max_tokens=5, temperature=0.8, seed=7))
    req = state["requests"][-1]
    assert req["return_logprob"] is True and req["logprob_start_len"] == -1
    assert req["input_ids"] == [[3, 4, 5], [3, 4, 5], [6, 7], [6, 7]]
    params = req["sampling_params"]
    assert [p["sampling_seed"] for p in params] == [7, 8, 9, 10]
    assert all(p["n"] == 1 and p["top_k"] == -1 and p["stop_token_ids"] == [1] and p["max_new_tokens"] == 5
               for p in params)
    assert len(batch.completion_ids) == 4
    for i, (ids, lps, reason) in enumerate(zip(batch.completion_ids, batch.sampler_logprobs, batch.finish_reasons,
                                               strict=True)):
        assert (reason == "stop") == (ids[-1] == 1)
        prompt = [[3, 4, 5], [6, 7]][i // 2]
        full = torch.tensor([prompt + ids])
        with torch.no_grad():
            ref = completion_logprobs(served.engine.model, full, torch.ones_like(full), logits_to_keep=len(ids),
                                      temperature=0.8)
        assert torch.allclose(ref[0], torch.tensor(lps), atol=1e-4)


def test_score_uses_prompt_logprobs_of_a_zero_token_generation(sgl):
    eng, state, served = sgl
    seqs = [[3, 4, 5, 6], [7, 8]]
    got = eng.score(seqs)
    assert state["requests"][-1]["sampling_params"]["max_new_tokens"] == 0
    assert _max_diff(got, score_sequences(served.engine.model, seqs, pad_token_id=0)) < 1e-5


def test_update_from_disk_makes_the_next_scores_match_the_trainer(sgl, tiny_checkpoint, tmp_path):
    eng, state, _ = sgl
    trainer = _trained(tiny_checkpoint)
    seqs = [[3, 4, 5, 6, 7], [8, 9]]
    flushes = state["flushes"]
    eng.update_weights(trainer.named_parameters(), 3)
    assert eng.weight_version == 3 and state["weight_version"] == "3" and state["flushes"] == flushes + 1
    assert _max_diff(eng.score(seqs), score_sequences(trainer, seqs, pad_token_id=0)) < 1e-4
    assert list((tmp_path / "sync").iterdir()) == []  # the temporary checkpoint is removed


def test_update_from_tensor_buckets_flush_once_and_set_the_version_last(served_tiny, tiny_checkpoint):
    app = create_contract_app(served_tiny)
    with app_in_thread(app) as url:
        eng = SGLangEngine([url], policy=FAST, model_path=tiny_checkpoint, weight_transport="tensor", tp_size=2,
                           chunk_mb=0, serializer=safetensors_b64_serializer)
        eng.chunk_bytes = 20_000  # several buckets for the tiny model
        trainer = _trained(tiny_checkpoint)
        eng.update_weights(trainer.named_parameters(), 4)
        state = app.state.contract
        assert state["weight_version"] == "4" and state["flushes"] == 1
        assert _max_diff(eng.score([[3, 4, 5]]), score_sequences(trainer, [[3, 4, 5]], pad_token_id=0)) < 1e-4
        eng.close()


def test_tensor_transport_without_sglang_says_what_to_do(served_tiny, tiny_checkpoint):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed")
    with app_in_thread(create_contract_app(served_tiny)) as url:
        eng = SGLangEngine([url], policy=FAST, model_path=tiny_checkpoint, weight_transport="tensor")
        with pytest.raises(RolloutError, match="needs the sglang package"):
            eng.update_weights([("model.norm.weight", torch.ones(64))], 1)
        eng.close()


def test_release_drops_weights_so_generate_waits_for_a_sync(sgl, tiny_checkpoint):
    eng, state, _ = sgl
    eng.sleep(1)
    eng.wake_up()
    assert state["released"] is False
    with pytest.raises(RolloutError, match="released its weights"):
        eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2))
    trainer = _trained(tiny_checkpoint)
    eng.update_weights(trainer.named_parameters(), 1)
    assert _max_diff(eng.score([[3, 4, 5]]), score_sequences(trainer, [[3, 4, 5]], pad_token_id=0)) < 1e-4
    eng.reset_prefix_cache()


def test_wrong_api_key_is_reported(served_tiny, tiny_checkpoint):
    with app_in_thread(create_contract_app(served_tiny, api_key=KEY)) as url:
        with pytest.raises(RolloutError, match="401"):
            SGLangEngine([url], policy=FAST, api_key="nope", model_path=tiny_checkpoint)


def test_sglang_launch_command():
    opts = ServeOptions(engine="sglang", model="/m", port=30001, tensor_parallel_size=2,
                        gpu_memory_utilization=0.6, dtype="bfloat16", max_model_len=4096, sleep_level=1, seed=3)
    assert sglang_command(opts, python="py") == [
        "py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port", "30001",
        "--tp-size", "2", "--mem-fraction-static", "0.6", "--random-seed", "3", "--dtype", "bfloat16",
        "--context-length", "4096", "--enable-memory-saver"]


def test_serve_rollout_sglang_without_sglang_exits_2_with_a_message(tiny_checkpoint):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed")
    with pytest.raises(ServeError, match="needs the sglang package"):
        run_sglang(ServeOptions(engine="sglang", model=tiny_checkpoint))
    import typer
    from typer.testing import CliRunner

    from grpo_cli.cli.serve import serve_rollout

    app = typer.Typer()
    app.command()(serve_rollout)
    result = CliRunner().invoke(app, ["--engine", "sglang", "--model", tiny_checkpoint])
    assert result.exit_code == 2 and "needs the sglang package" in result.output
