"""Acceptance: a real `python -m grpo_cli.cli.serve --engine hf` on 127.0.0.1 in a subprocess. Generate, push
weights changed by a real optimizer step, check the server's logprobs equal the trainer's (1e-4), auth and
malformed input, and a server killed mid-run making the client fail fast with a clear message."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from grpo_cli.rollout.base import RolloutError, SamplingParams
from grpo_cli.models.logprobs import completion_logprobs, score_sequences
from grpo_cli.rollout.remote.client import ServerEngine, model_identity
from grpo_cli.rollout.transport.http_client import Policy, RolloutServerDown

TOKEN = "tok-123"


def _trainer(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _optimizer_step(model) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()


def _engine(url: str, model_path: str, **policy) -> ServerEngine:
    pol = Policy(**{"connect_timeout_s": 20, "request_timeout_s": 30, "retries": 1, "backoff_s": 0.1, **policy})
    return ServerEngine([url], policy=pol, token=TOKEN, stop_token_ids=[1], expected=model_identity(model_path))


def test_hf_server_generate_sync_parity_auth_and_limits(server_process, tiny_checkpoint):
    srv = server_process(token=TOKEN)
    assert srv.url.startswith("http://127.0.0.1:")
    eng = _engine(srv.url, tiny_checkpoint)
    trainer = _trainer(tiny_checkpoint)
    seqs = [[3, 4, 5, 6, 7], [8, 9, 10]]
    before = eng.score(seqs)
    _optimizer_step(trainer)
    trainer.eval()
    eng.update_weights(trainer.named_parameters(), 1)
    assert eng.weight_version == 1 and eng.last_sync["bytes"] > 0

    after, ref = eng.score(seqs), score_sequences(trainer, seqs, pad_token_id=0)
    assert max(abs(a - b) for x, y in zip(after, ref, strict=True) for a, b in zip(x, y, strict=True)) < 1e-4
    assert max(abs(a - b) for x, y in zip(after, before, strict=True) for a, b in zip(x, y, strict=True)) > 1e-3

    batch = eng.generate([[3, 4, 5]], SamplingParams(n=4, max_tokens=6, temperature=0.7, seed=0))
    assert batch.weight_version == 1
    for ids, lps in zip(batch.completion_ids, batch.sampler_logprobs, strict=True):
        full = torch.tensor([[3, 4, 5, *ids]])
        with torch.no_grad():
            mine = completion_logprobs(trainer, full, torch.ones_like(full), logits_to_keep=len(ids), temperature=0.7)
        assert torch.allclose(mine[0], torch.tensor(lps), atol=1e-4)

    url = srv.url
    assert httpx.post(f"{url}/generate", json={}, headers={"Authorization": "Bearer nope"}).status_code == 401
    with pytest.raises(RolloutError, match="401.*token"):
        ServerEngine([url], policy=Policy(connect_timeout_s=5, retries=0), token="wrong")
    auth = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    assert httpx.post(f"{url}/generate", content=b"{]", headers=auth).status_code == 400
    assert httpx.post(f"{url}/score", content=b"[" * (17 << 20), headers=auth).status_code == 413
    assert httpx.post(f"{url}/update_weights?version=2", content=b"GRW1" + b"\xff" * 60,
                      headers=auth).status_code == 400
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert eng.generate([[3]], SamplingParams(n=2, max_tokens=2)).weight_version == 1
    eng.close()


def test_no_server_message_names_url_and_command(tiny_checkpoint):
    from grpo_cli.server.launch import bind

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    start = time.monotonic()
    with pytest.raises(RolloutError) as err:
        ServerEngine([f"http://127.0.0.1:{port}"], policy=Policy(connect_timeout_s=1.0))
    assert time.monotonic() - start < 5
    msg = str(err.value)
    assert f"no rollout server at http://127.0.0.1:{port} after 1 s: start it with `grpo serve-rollout" in msg
    assert f"--port {port}" in str(err.value)


def test_vocab_mismatch_is_refused(served_tiny):
    from served_app import app_in_thread

    from grpo_cli.server.app import create_app

    with app_in_thread(create_app(served_tiny)) as url:
        with pytest.raises(RolloutError, match="vocab_size=68, but the trainer's model has vocab_size=1000"):
            ServerEngine([url], policy=Policy(connect_timeout_s=20), expected={"vocab_size": 1000})


def test_server_killed_mid_run_raises_within_the_timeout(server_process, tiny_checkpoint):
    srv = server_process(token=TOKEN)
    eng = _engine(srv.url, tiny_checkpoint, request_timeout_s=5)
    eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2))
    srv.kill()
    start = time.monotonic()
    with pytest.raises(RolloutServerDown) as err:
        eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2))
    assert time.monotonic() - start < 5
    assert not err.value.recovered and "stopped answering during /generate" in str(err.value)
    assert "save a checkpoint" in str(err.value)
    eng.close()


def test_wait_mode_reports_recovery_so_the_caller_resyncs(server_process, tiny_checkpoint):
    srv = server_process(token=TOKEN)
    port = int(srv.url.rsplit(":", 1)[1])
    eng = _engine(srv.url, tiny_checkpoint, on_failure="wait", wait_for_recovery_s=30)
    eng.update_weights(_trainer(tiny_checkpoint).named_parameters(), 1)
    srv.kill()
    restart = threading.Timer(1.0, lambda: server_process(token=TOKEN, port=port))  # back with v0 weights
    restart.start()
    start = time.monotonic()
    with pytest.raises(RolloutServerDown) as err:
        eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2))
    restart.join()
    assert err.value.recovered and "came back after" in str(err.value) and "push the weights again" in str(err.value)
    assert time.monotonic() - start < 30
    eng.update_weights(_trainer(tiny_checkpoint).named_parameters(), 1)
    assert eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2)).weight_version == 1
    eng.close()
