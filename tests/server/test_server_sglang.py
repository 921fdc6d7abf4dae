"""SGLangEngine against grpo_cli/server/sglang_contract.py: a fake that follows SGLang's source (the sglang 0.5.23
wheel: `srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`, `srt/managers/scheduler_components/
weight_updater.py`, `srt/managers/tp_worker.py`, `srt/sampling/sampling_batch_info.py`), NOT SGLang: SGLang needs
CUDA and cannot run on these machines. Plus `serve-rollout --engine sglang`'s command and its errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from served_app import app_in_thread

from grpo_cli.rollout.base import RolloutError, SamplingParams
from grpo_cli.models.logprobs import completion_logprobs, score_sequences
from grpo_cli.rollout.seeds import child_seed
from grpo_cli.rollout.sglang.client import SGLangEngine, ServerFacts
from grpo_cli.server.engines import ServeError, ServeOptions
from grpo_cli.server.launch import run_sglang, sglang_command
from grpo_cli.server.sglang_contract import create_contract_app, safetensors_b64_serializer
from grpo_cli.rollout.transport.http_client import Policy

KEY = "sgl-key"
FAST = Policy(connect_timeout_s=5, request_timeout_s=30, retries=0)


def launch_args(model: str, **opts) -> list[str]:
    """What `grpo serve-rollout --engine sglang` would run (with the token it appends), for the fake to obey."""
    return sglang_command(ServeOptions(engine="sglang", model=model, **opts)) + ["--api-key", KEY]


@pytest.fixture
def sgl(served_tiny, tiny_checkpoint, tmp_path):
    app = create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint))
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
    assert [p["sampling_seed"] for p in params] == [child_seed(7, rank=0, prompt=i, child=j) for i in (0, 1)
                                                    for j in (0, 1)]
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


def test_update_from_disk_makes_the_next_scores_match_the_trainer(sgl, tiny_checkpoint):
    eng, state, _ = sgl
    trainer = _trained(tiny_checkpoint)
    seqs = [[3, 4, 5, 6, 7], [8, 9]]
    flushes = state["flushes"]
    eng.update_weights(trainer.named_parameters(), 3)
    assert eng.weight_version == 3 and state["weight_version"] == "3" and state["flushes"] == flushes + 1
    assert _max_diff(eng.score(seqs), score_sequences(trainer, seqs, pad_token_id=0)) < 1e-4


def test_disk_update_keeps_the_folder_sglang_reports_until_the_next_update(sgl, tiny_checkpoint, tmp_path):
    """Mismatch 5: SGLang's /model_info names the folder it loaded (tokenizer_manager._update_model_path_info); the
    client used to delete it right after the update."""
    eng, state, _ = sgl
    trainer = _trained(tiny_checkpoint)
    eng.update_weights(trainer.named_parameters(), 1)
    first = Path(eng.model_info(eng.urls[0])["model_path"])
    assert first.parent == tmp_path / "sync" and (first / "config.json").is_file()
    assert (first / "model.safetensors").is_file()
    eng.update_weights(trainer.named_parameters(), 2)
    second = Path(eng.model_info(eng.urls[0])["model_path"])
    assert second != first and not first.exists() and (second / "model.safetensors").is_file()
    eng.close()
    assert list((tmp_path / "sync").iterdir()) == []


def _tensor_engine(url, model, **kw):
    # As SGLangEngine.from_config builds it: no TP size given (the server reports its own).
    return SGLangEngine([url], policy=FAST, api_key=KEY, model_path=model, weight_transport="tensor",
                        serializer=safetensors_b64_serializer, **kw)


def test_tensor_update_runs_inside_a_weight_update_session(served_tiny, tiny_checkpoint):
    """Mismatch 1: sglang >= 0.5.21 refuses /update_weights_from_tensor outside /begin_weight_update …
    /end_weight_update (scheduler_components/weight_updater.py)."""
    app = create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint))
    with app_in_thread(app) as url:
        eng = _tensor_engine(url, tiny_checkpoint)
        eng.chunk_bytes = 20_000  # several buckets for the tiny model
        trainer = _trained(tiny_checkpoint)
        eng.update_weights(trainer.named_parameters(), 4)
        state = app.state.contract
        paths = [path for path, _ in state["log"] if "weight" in path]
        assert paths[0] == "/begin_weight_update" and paths[-1] == "/end_weight_update"
        assert set(paths[1:-1]) == {"/update_weights_from_tensor"} and len(paths) > 3
        assert state["session"] is None and state["weight_version"] == "4" and state["flushes"] == 1
        assert _max_diff(eng.score([[3, 4, 5]]), score_sequences(trainer, [[3, 4, 5]], pad_token_id=0)) < 1e-4
        state["session"] = {"selector": "all", "loaded_weights": False}  # left open by a trainer that died
        eng.update_weights(trainer.named_parameters(), 5)
        assert state["session"] is None and state["weight_version"] == "5"
        eng.close()


def test_tensor_update_posts_each_bucket_as_soon_as_it_is_full(served_tiny, tiny_checkpoint):
    """One POST per bucket of weight_chunk_mb while the trainer's stream is read: when a bucket is serialized the
    stream has given at most one tensor beyond it (the one that overflowed it), so the trainer never holds the whole
    model; only the last POST flushes the cache and sets the version."""
    app = create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint))
    chunk, pulled, seen = 40_000, [0], []

    def serializer(named):
        seen.append((pulled[0], len(named), sum(t.nbytes for _, t in named)))
        return safetensors_b64_serializer(named)

    trainer = _trained(tiny_checkpoint)

    def stream():
        for item in trainer.named_parameters():
            pulled[0] += 1
            yield item

    with app_in_thread(app) as url:
        eng = SGLangEngine([url], policy=FAST, api_key=KEY, model_path=tiny_checkpoint, weight_transport="tensor",
                           serializer=serializer)
        eng.chunk_bytes = chunk
        eng.update_weights(stream(), 3)
        bodies = [b for path, b in app.state.contract["log"] if path == "/update_weights_from_tensor"]
        n = len(bodies)
        assert n > 1 and n == len(seen)
        assert [b["flush_cache"] for b in bodies] == [False] * (n - 1) + [True]
        assert [b["weight_version"] for b in bodies] == [None] * (n - 1) + ["3"]
        sent = 0
        for pulled_then, count, nbytes in seen:
            assert nbytes <= chunk or count == 1
            sent += count
            assert pulled_then <= sent + 1
        assert sent == len(list(trainer.named_parameters()))
        state = app.state.contract
        assert state["weight_version"] == "3" and state["flushes"] == 1 and state["session"] is None
        assert _max_diff(eng.score([[3, 4, 5]]), score_sequences(trainer, [[3, 4, 5]], pad_token_id=0)) < 1e-4
        eng.close()


def test_tensor_update_without_sessions_on_older_sglang(served_tiny, tiny_checkpoint):
    app = create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint), version="0.5.20")
    with app_in_thread(app) as url:
        eng = _tensor_engine(url, tiny_checkpoint)
        trainer = _trained(tiny_checkpoint)
        eng.update_weights(trainer.named_parameters(), 1)
        eng.update_weights(trainer.named_parameters(), 2)
        paths = [path for path, _ in app.state.contract["log"] if "weight" in path]
        assert paths == ["/begin_weight_update", "/update_weights_from_tensor", "/update_weights_from_tensor"]
        assert _max_diff(eng.score([[3, 4, 5]]), score_sequences(trainer, [[3, 4, 5]], pad_token_id=0)) < 1e-4
        eng.close()


@pytest.mark.parametrize("version", ["0.5.20", "0.5.23"])
def test_tensor_update_sends_one_payload_per_tp_rank(served_tiny, tiny_checkpoint, version):
    """Mismatch 2: each TP rank deserializes serialized_named_tensors[rank] (managers/tp_worker.py); one payload
    for a TP-2 server is an IndexError that kills the scheduler."""
    app = create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint, tensor_parallel_size=2),
                              version=version)
    with app_in_thread(app) as url:
        eng = _tensor_engine(url, tiny_checkpoint)
        trainer = _trained(tiny_checkpoint)
        eng.update_weights(trainer.named_parameters(), 1)
        bodies = [b for path, b in app.state.contract["log"] if path == "/update_weights_from_tensor"]
        assert bodies and all(len(b["serialized_named_tensors"]) == 2 for b in bodies)
        assert app.state.contract["dead"] is None
        assert _max_diff(eng.score([[3, 4, 5]]), score_sequences(trainer, [[3, 4, 5]], pad_token_id=0)) < 1e-4
        eng.close()


def test_sglang_older_than_the_supported_range_is_refused(served_tiny, tiny_checkpoint):
    with app_in_thread(create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint),
                                           version="0.4.6.post5")) as url:
        with pytest.raises(RolloutError, match=r"sglang 0.4.6.post5; grpo-cli needs sglang >= 0.5.3"):
            SGLangEngine([url], policy=FAST, api_key=KEY, model_path=tiny_checkpoint)


def test_tensor_transport_with_host_tensors_says_what_to_do(served_tiny, tiny_checkpoint):
    """The payload is written here (sglang_payload, no sglang package needed); host tensors cannot travel as CUDA
    IPC handles, so they are refused before anything is sent."""
    app = create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint))
    with app_in_thread(app) as url:
        eng = SGLangEngine([url], policy=FAST, api_key=KEY, model_path=tiny_checkpoint, weight_transport="tensor")
        with pytest.raises(RolloutError, match=r"streams cpu tensors.*rollout\.server\.weight_transport: disk"):
            eng.update_weights([("model.norm.weight", torch.ones(64))], 1)
        assert not [p for p, _ in app.state.contract["log"] if p == "/update_weights_from_tensor"]
        eng.close()


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_data_parallel_replicas_refuse_tensor_updates_up_front(served_tiny, tiny_checkpoint, tmp_path, transport):
    """SGLang asserts dp_size == 1 in update_weights_from_tensor (managers/tokenizer_control_mixin.py): an HTTP 500
    at the first sync. The client reads dp_size from /server_info and refuses at start; disk updates are fine."""
    app = create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint) + ["--dp-size", "2"])
    with app_in_thread(app) as url:
        if transport == "tensor":
            with pytest.raises(RolloutError, match=r"2 data-parallel replicas.*rollout\.server\.weight_transport: disk"):
                _tensor_engine(url, tiny_checkpoint)
            eng = _tensor_engine(url, tiny_checkpoint, connect=False)  # what refusing spares: a bare 500
            eng.facts[url] = ServerFacts(version=(0, 5, 23), tp_size=1, deterministic=True)
            with pytest.raises(RolloutError, match="answered 500"):
                eng.update_weights(_trained(tiny_checkpoint).named_parameters(), 1)
        else:
            eng = SGLangEngine([url], policy=FAST, api_key=KEY, model_path=tiny_checkpoint,
                               weight_sync_dir=str(tmp_path / "sync"))
            eng.update_weights(_trained(tiny_checkpoint).named_parameters(), 1)
            assert app.state.contract["weight_version"] == "1"
        eng.close()


def test_dp_attention_takes_tensor_updates(served_tiny, tiny_checkpoint):
    """Older SGLang took tensor updates with `--dp-size N --enable-dp-attention` (the assert's second clause)."""
    args = launch_args(tiny_checkpoint) + ["--dp-size", "2", "--enable-dp-attention"]
    with app_in_thread(create_contract_app(served_tiny, launch_args=args, version="0.5.20")) as url:
        eng = _tensor_engine(url, tiny_checkpoint)
        eng.update_weights(_trained(tiny_checkpoint).named_parameters(), 1)
        eng.close()


def test_release_drops_weights_so_generate_waits_for_a_sync(sgl, tiny_checkpoint):
    eng, state, _ = sgl
    eng.sleep(1)
    assert state["released"] == {"kv_cache", "weights", "cuda_graph"}
    eng.wake_up()
    assert state["released"] == set()
    with pytest.raises(RolloutError, match="released its weights"):
        eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2))
    trainer = _trained(tiny_checkpoint)
    eng.update_weights(trainer.named_parameters(), 1)
    assert _max_diff(eng.score([[3, 4, 5]]), score_sequences(trainer, [[3, 4, 5]], pad_token_id=0)) < 1e-4
    eng.reset_prefix_cache()


def test_wake_up_resumes_only_what_sleep_released(sgl, tiny_checkpoint):
    """Mismatch 3: SGLang's resume removes each tag from its released set, and a tag never released raises KeyError
    in the scheduler (scheduler_components/weight_updater.py); `tags: null` means all three tags."""
    eng, state, _ = sgl
    eng.sleep(0)
    eng.wake_up()
    assert state["released"] == set() and state["dead"] is None
    assert len(eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2)).completion_ids) == 2
    # The rehearsal's lifecycle: sleep, wake the weights, sync, wake the KV cache (and its CUDA graphs), generate.
    eng.sleep(1)
    eng.wake_up(["weights"])
    assert state["released"] == {"kv_cache", "cuda_graph"}
    eng.update_weights(_trained(tiny_checkpoint).named_parameters(), 1)
    eng.wake_up(["kv_cache"])
    eng.wake_up(["kv_cache"])  # again: nothing left to resume, nothing sent
    assert state["released"] == set() and state["dead"] is None
    assert len(eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2)).completion_ids) == 2


def test_launcher_turns_on_deterministic_inference_so_seeds_reproduce(served_tiny, tiny_checkpoint):
    """Mismatch 4: SGLang uses sampling_seed only with --enable-deterministic-inference
    (sampling/sampling_batch_info.py); the fake runs the launcher's own command."""
    app = create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint, seed=5))
    with app_in_thread(app) as url:
        eng = SGLangEngine([url], policy=FAST, api_key=KEY, stop_token_ids=[1], model_path=tiny_checkpoint)
        sampling = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=11)
        first = eng.generate([[3, 4, 5], [6, 7]], sampling).completion_ids
        assert eng.generate([[3, 4, 5], [6, 7]], sampling).completion_ids == first
        eng.close()


def test_a_server_that_ignores_seeds_is_named(served_tiny, tiny_checkpoint):
    args = [a for a in launch_args(tiny_checkpoint) if a != "--enable-deterministic-inference"]
    with app_in_thread(create_contract_app(served_tiny, launch_args=args)) as url:
        with pytest.warns(RuntimeWarning, match="without --enable-deterministic-inference.*not reproducible"):
            eng = SGLangEngine([url], policy=FAST, api_key=KEY, model_path=tiny_checkpoint)
        eng.close()


def test_wrong_api_key_is_reported(served_tiny, tiny_checkpoint):
    with app_in_thread(create_contract_app(served_tiny, api_key=KEY)) as url:
        with pytest.raises(RolloutError, match="401"):
            SGLangEngine([url], policy=FAST, api_key="nope", model_path=tiny_checkpoint)


def test_sglang_launch_command():
    opts = ServeOptions(engine="sglang", model="/m", port=30001, tensor_parallel_size=2,
                        gpu_memory_utilization=0.6, dtype="bfloat16", max_model_len=4096, sleep_level=1, seed=3)
    assert sglang_command(opts, python="py") == [
        "py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port", "30001",
        "--tp-size", "2", "--mem-fraction-static", "0.6", "--random-seed", "3", "--enable-deterministic-inference",
        "--dtype", "bfloat16", "--context-length", "4097", "--enable-memory-saver"]  # 4096 + 1: test_served_lengths


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
