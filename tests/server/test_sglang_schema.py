"""Every request body SGLangEngine sends, checked against SGLang's own request schemas read from the sglang wheel
(tests/server/sglang_schema.py: `api/v1/api_types.py`, `srt/managers/io_struct.py`,
`srt/entrypoints/http_server.py`). The bodies are captured from real client calls against the fake in
grpo_cli/server/sglang_contract.py, for both weight transports and TP 1 and 2. Skipped, with the reason, when pip cannot
download the wheel (offline); GRPO_SGLANG_WHEEL=/path/to/sglang-….whl checks a local copy instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from served_app import app_in_thread
from sglang_schema import VERSION, SGLangSchema, download_wheel
from test_server_sglang import FAST, KEY, launch_args

from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.sglang.client import SGLangEngine
from grpo_cli.server.sglang_contract import (
    create_contract_app,
    safetensors_b64_serializer,
)


@pytest.fixture(scope="session")
def sglang_schema(request, tmp_path_factory):
    if os.environ.get("GRPO_SGLANG_WHEEL"):
        return SGLangSchema(Path(os.environ["GRPO_SGLANG_WHEEL"]))
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("sglang-wheel") if cache else tmp_path_factory.mktemp("sglang-wheel")
    wheel, why = download_wheel(Path(folder))
    if wheel is None:
        pytest.skip(f"sglang {VERSION} wheel not available, SGLang's schemas cannot be read: {why}")
    return SGLangSchema(wheel)


WEIGHT_PATHS = {"disk": {"/update_weights_from_disk"},
                "tensor": {"/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"}}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("transport", ["disk", "tensor"])
def test_every_body_the_client_sends_passes_sglangs_schema(sglang_schema, served_tiny, tiny_checkpoint, tmp_path,
                                                           transport, tp):
    app = create_contract_app(served_tiny, launch_args=launch_args(tiny_checkpoint, tensor_parallel_size=tp))
    trained = {n: p.detach() + 0.01 for n, p in served_tiny.engine.model.named_parameters()}
    with app_in_thread(app) as url:
        eng = SGLangEngine([url], policy=FAST, api_key=KEY, stop_token_ids=[1], model_path=tiny_checkpoint,
                           weight_transport=transport, weight_sync_dir=str(tmp_path), chunk_mb=0,
                           serializer=safetensors_b64_serializer)
        eng.generate([[3, 4, 5], [6, 7]], SamplingParams(n=2, max_tokens=3, temperature=0.7, top_k=5, seed=3))
        eng.generate([[3, 4]], SamplingParams(n=1, max_tokens=2))
        eng.score([[3, 4, 5, 6]])
        eng.update_weights(trained.items(), 1)
        eng.sleep(0)
        eng.wake_up()
        eng.sleep(1)  # the rehearsal's lifecycle: wake the weights, sync, wake the KV cache
        eng.wake_up(["weights"])
        eng.update_weights(trained.items(), 2)
        eng.wake_up(["kv_cache"])
        eng.reset_prefix_cache()
        eng.close()
    log = app.state.contract["log"]
    assert app.state.contract["dead"] is None
    sent = {path for path, _ in log}
    assert {"/generate", "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
            "/model_info", "/server_info"} | WEIGHT_PATHS[transport] <= sent
    for path, body in log:
        sglang_schema.check(path, body)
    tensor_bodies = [b for path, b in log if path == "/update_weights_from_tensor"]
    assert all(len(b["serialized_named_tensors"]) == tp for b in tensor_bodies)
    assert len(tensor_bodies) == (2 * len(trained) if transport == "tensor" else 0)  # chunk_mb=0: a bucket each


@pytest.mark.parametrize(("path", "body", "why"), [
    ("/generate", {"input_ids": [[1]], "sampling_params": {"max_tokens": 3}}, "unknown field `max_tokens`"),
    ("/generate", {"input_ids": [[1]], "return_logprobs": True}, r"no field\(s\) \['return_logprobs'\]"),
    ("/generate", {"input_ids": [[1]], "sampling_params": {"sampling_seed": "3"}}, "expected i64"),
    ("/generate", {"input_ids": [[1]], "sampling_params": {"logit_bias": [8]}}, "a map"),
    ("/update_weights_from_disk", {"model_path": "/w", "version": "3"}, "would ignore them"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, "base64"),
    ("/release_memory_occupation", {"tags": "kv_cache"}, "ReleaseMemoryOccupationReqInput"),
    ("/update_weights", {}, "no such route"),
])
def test_the_schema_check_refuses_what_sglang_refuses_or_ignores(sglang_schema, path, body, why):
    with pytest.raises(ValueError, match=why):
        sglang_schema.check(path, body)


def test_the_fake_server_answers_only_routes_sglang_has(sglang_schema, served_tiny):
    fake = {r.path for r in create_contract_app(served_tiny).routes if hasattr(r, "methods")}
    fake -= {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    assert fake and fake <= set(sglang_schema.routes)


def test_image_bodies_pass_sglangs_schema(sglang_schema, served_vlm, tmp_path):
    """A vision-language model's bodies: `image_data` per input and the placeholder ban as `logit_bias` (a map of
    decimal token ids to floats in `api/v1/api_types.py`)."""
    served, ids, images = served_vlm
    app = create_contract_app(served, launch_args=["--enable-deterministic-inference"])
    with app_in_thread(app) as url:
        eng = SGLangEngine([url], policy=FAST, model_path=served.model, weight_sync_dir=str(tmp_path))
        eng.generate(ids, SamplingParams(n=2, max_tokens=2, seed=1), images=images)
        eng.score(ids, images=images)
        eng.close()
    bodies = [b for path, b in app.state.contract["log"] if path == "/generate"]
    assert len(bodies) == 2 and all("logit_bias" in p for p in bodies[0]["sampling_params"])
    for body in bodies:
        sglang_schema.check("/generate", body)
