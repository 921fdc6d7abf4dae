"""The serve-rollout app over real HTTP on 127.0.0.1 (uvicorn on a thread): auth, limits, malformed input,
weight updates (streamed, partial, from disk) and the client's splitting over several servers."""

from __future__ import annotations

import httpx
import pytest
import torch
from served_app import app_in_thread

from grpo_cli.rollout.base import RolloutError, SamplingParams
from grpo_cli.rollout.remote.client import ServerEngine
from grpo_cli.server.app import create_app
from grpo_cli.rollout.transport.codec import encode_stream
from grpo_cli.rollout.transport.http_client import Policy

TOKEN = "s3cret-token"
FAST = Policy(connect_timeout_s=5, request_timeout_s=30, retries=1, backoff_s=0.05)


@pytest.fixture
def server(served_tiny):
    with app_in_thread(create_app(served_tiny, token=TOKEN, max_request_bytes=64 << 10)) as url:
        yield url, served_tiny


def _auth(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


def test_every_call_but_health_needs_the_token(server):
    url, _ = server
    assert httpx.get(f"{url}/health").status_code == 200
    gen = {"prompt_ids": [[3, 4]], "sampling": {"max_tokens": 2}}
    for method, path, body in [("GET", "/info", None), ("POST", "/generate", gen), ("POST", "/sleep", {}),
                               ("POST", "/update_weights?version=1", None), ("POST", "/reset_prefix_cache", None),
                               ("POST", "/update_weights_from_disk", {"path": "/etc", "version": 1})]:
        for headers in ({}, _auth("wrong"), {"Authorization": TOKEN}):
            r = httpx.request(method, url + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert "bearer token" in r.json()["error"]
    assert httpx.get(f"{url}/info", headers=_auth()).status_code == 200


@pytest.mark.parametrize("content, match", [
    (b"{not json", "JSON"),
    (b'{"prompt_ids": [[1, 2]]}', "sampling"),
    (b'{"prompt_ids": [[1, 99999]], "sampling": {"max_tokens": 2}}', "outside"),
    (b'{"prompt_ids": [[]], "sampling": {"max_tokens": 2}}', "at least 1"),
    (b'{"prompt_ids": [[1]], "sampling": {"max_tokens": 100000}}', "max_model_len"),
    (b'{"prompt_ids": [[1]], "sampling": {"max_tokens": 2, "n": 0}}', "sampling.n"),
    (b'{"prompt_ids": [[1]], "sampling": {"max_tokens": 2}, "evil": 1}', "evil"),
])
def test_malformed_generate_gets_400_with_a_message_and_server_stays_up(server, content, match):
    url, _ = server
    r = httpx.post(f"{url}/generate", content=content, headers={**_auth(), "content-type": "application/json"})
    assert r.status_code == 400 and match in r.json()["error"], r.text
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_oversized_bodies_get_413(server):
    url, _ = server
    big = b'{"sequences": [[' + b"1," * 60000 + b'1]]}'
    r = httpx.post(f"{url}/score", content=big, headers={**_auth(), "content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks():  # no Content-Length: counted while streaming
        for _ in range(100):
            yield b" " * 1024

    r = httpx.post(f"{url}/score", content=chunks(), headers={**_auth(), "content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(f"{url}/health").status_code == 200


def test_generate_shapes_version_and_sampler_logprobs(server):
    url, _ = server
    eng = ServerEngine([url], policy=FAST, token=TOKEN)
    batch = eng.generate([[3, 4, 5], [6, 7]], SamplingParams(n=3, max_tokens=4, seed=1))
    assert len(batch.completion_ids) == 6 and batch.weight_version == 0
    for ids, lps, reason in zip(batch.completion_ids, batch.sampler_logprobs, batch.finish_reasons, strict=True):
        assert len(ids) == len(lps) and reason in ("stop", "length")
    eng.close()


def _push(url, tensors, version, *, cut_after: int | None = None, token=TOKEN):
    data = b"".join(bytes(p) for f in encode_stream(tensors, chunk_bytes=1 << 12, version=version) for p in f)
    if cut_after is not None:
        data = data[:cut_after]
    return httpx.post(f"{url}/update_weights", params={"version": version}, content=data,
                      headers=_auth(token), timeout=30)


def test_unknown_name_or_wrong_shape_is_refused_and_weights_stay_usable(server):
    url, served = server
    r = _push(url, [("model.nope.weight", torch.zeros(2))], 1)
    assert r.status_code == 400 and "unknown tensor" in r.json()["error"]
    name, p = next(iter(served.engine.model.named_parameters()))
    r = _push(url, [(name, torch.zeros(1, *p.shape))], 1)
    assert r.status_code == 400 and "shape" in r.json()["error"]
    info = httpx.get(f"{url}/info", headers=_auth()).json()
    assert info["state"] == "ready" and info["weight_version"] == 0


def test_partial_update_blocks_generation_until_a_complete_one(server):
    url, served = server
    params = [(n, p.detach().clone() + 0.01) for n, p in served.engine.model.named_parameters()]
    r = _push(url, params, 5, cut_after=20000)
    assert r.status_code == 400 and "ended" in r.json()["error"]
    info = httpx.get(f"{url}/info", headers=_auth()).json()
    assert info["state"] == "inconsistent" and info["weight_version"] == 0
    eng = ServerEngine([url], policy=FAST, token=TOKEN)
    with pytest.raises(RolloutError, match="409: weights are inconsistent"):
        eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2))
    eng.update_weights(params, 5)
    assert eng.weight_version == 5
    assert eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2)).weight_version == 5
    eng.close()


def test_update_from_disk_loads_a_safetensors_folder(server, tmp_path):
    from safetensors.torch import save_file

    url, served = server
    name, p = next(iter(served.engine.model.named_parameters()))
    save_file({name: torch.full_like(p, 0.5)}, str(tmp_path / "w.safetensors"))
    eng = ServerEngine([url], policy=FAST, token=TOKEN)
    eng.update_weights_from_disk(str(tmp_path), 2)
    assert torch.all(dict(served.engine.model.named_parameters())[name] == 0.5)
    with pytest.raises(RolloutError, match="no .safetensors"):
        eng.update_weights_from_disk(str(tmp_path / "missing"), 3)
    eng.close()


def test_generation_is_split_over_servers_with_groups_whole(tiny_checkpoint):
    from grpo_cli.server.engines import ServeOptions, build

    a, b = (build(ServeOptions(engine="hf", model=tiny_checkpoint)) for _ in range(2))
    calls = {"a": [], "b": []}
    for key, served in (("a", a), ("b", b)):
        orig = served.engine.generate
        served.engine.generate = lambda p, s, _o=orig, _k=key: calls[_k].append(p) or _o(p, s)
    with app_in_thread(create_app(a)) as ua, app_in_thread(create_app(b)) as ub:
        eng = ServerEngine([ua, ub], policy=FAST)
        prompts = [[3, 4], [5, 6], [7, 8]]
        batch = eng.generate(prompts, SamplingParams(n=2, max_tokens=3, seed=0))
        assert len(batch.completion_ids) == 6
        assert calls["a"] == [prompts[:2]] and calls["b"] == [prompts[2:]]
        eng.generate(prompts[:1], SamplingParams(n=2, max_tokens=3))  # by load, not round-robin: both idle, the first
        assert calls["a"][-1] == prompts[:1] and len(calls["b"]) == 1
        params = [(n, p.detach() * 1.0) for n, p in a.engine.model.named_parameters()]
        eng.update_weights(params, 1)
        assert eng.generate(prompts, SamplingParams(n=2, max_tokens=2)).weight_version == 1
        eng.close()


def test_make_engine_builds_the_server_client_from_config(server, tiny_checkpoint, monkeypatch):
    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.base import EngineContext
    from grpo_cli.rollout.factory import make_engine

    url, _ = server
    monkeypatch.setenv("MY_TOKEN", TOKEN)
    cfg = GRPOConfig(rollout={"mode": "server", "server": {"urls": [url], "token_env": "MY_TOKEN",
                                                           "connect_timeout_s": 5}})
    eng = make_engine(cfg, EngineContext(model_path=tiny_checkpoint, eos_token_ids=[1], pad_token_id=0))
    assert isinstance(eng, ServerEngine) and eng.stop_token_ids == [1]
    assert len(eng.generate([[3, 4]], SamplingParams(n=2, max_tokens=2)).completion_ids) == 2
    eng.close()


def test_idempotent_calls_retry_with_backoff_and_surface_the_last_error():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, hits = FastAPI(), []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/info")
    async def info():
        hits.append(1)
        if len(hits) < 3:
            return JSONResponse({"error": "warming up"}, status_code=503)
        return {"weight_version": 0, "state": "ready"}

    @app.post("/score")
    async def score():
        return JSONResponse({"error": "engine exploded: CUDA OOM"}, status_code=500)

    with app_in_thread(app) as url:
        eng = ServerEngine([url], policy=Policy(connect_timeout_s=5, retries=3, backoff_s=0.01))
        assert len(hits) == 3
        with pytest.raises(RolloutError, match="500: engine exploded: CUDA OOM"):
            eng.score([[1, 2]])
        eng.close()


def test_shm_transport_loads_the_weights_checks_every_frame_and_removes_the_file(server, tmp_path, monkeypatch):
    """Same host: the frames go into an owner-only /dev/shm file handed over by name (token-guarded), kept and
    overwritten by the next sync (removed at close, or after each sync with shm_keep_file=False); a corrupted file
    is refused by its checksum and leaves the served weights untouched."""
    import os
    import stat

    from grpo_cli.rollout.transport import codec

    url, served = server
    params = [(n, p.detach().clone() + 0.25) for n, p in served.engine.model.named_parameters()]
    eng = ServerEngine([url], policy=FAST, token=TOKEN, transport="shm", chunk_mb=1)
    before = set(os.listdir(codec.SHM_DIR))
    eng.update_weights(params, 3)
    assert eng.weight_version == 3 and eng.last_sync["bytes"] == sum(t.nbytes for _, t in params)
    for (name, want), (_, got) in zip(params, served.engine.model.named_parameters(), strict=True):
        assert torch.equal(want, got), name
    (kept,) = set(os.listdir(codec.SHM_DIR)) - before
    assert kept.startswith(f"grpo-weights-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(os.path.join(codec.SHM_DIR, kept)).st_mode) == 0o600
    eng.update_weights([(n, t * 2) for n, t in params], 4)  # the same file, overwritten
    assert set(os.listdir(codec.SHM_DIR)) - before == {kept}
    for (name, want), (_, got) in zip(params, served.engine.model.named_parameters(), strict=True):
        assert torch.equal(want * 2, got), name
    body = {"name": "grpo-weights-x", "bytes": 0, "version": 4}
    assert httpx.post(f"{url}/update_weights_shm", json=body).status_code == 401
    assert httpx.post(f"{url}/update_weights_shm", json={**body, "name": "../etc/passwd"},
                      headers=_auth()).status_code == 400

    real_write = codec.write_stream

    def corrupt(out, *args, **kwargs):
        size = real_write(out, *args, **kwargs)
        out.seek(size // 2)
        out.write(b"\xff\xfe")  # flips bytes inside a frame after its checksum was taken
        out.seek(size)
        return size

    monkeypatch.setattr(codec, "write_stream", corrupt)
    with pytest.raises(RolloutError, match="checksum mismatch"):
        eng.update_weights([(n, t + 1.0) for n, t in params], 5)
    info = httpx.get(f"{url}/info", headers=_auth()).json()
    assert info["weight_version"] == 4
    eng.close()
    assert set(os.listdir(codec.SHM_DIR)) == before  # close removed the file
    monkeypatch.setattr(codec, "write_stream", real_write)
    once = ServerEngine([url], policy=FAST, token=TOKEN, transport="shm", chunk_mb=1, shm_keep_file=False)
    once.update_weights(params, 6)
    assert set(os.listdir(codec.SHM_DIR)) == before and once.weight_version == 6
    once.close()  # a server on another host is refused by the config (tests/config/test_weight_transport_key.py)


def test_shm_files_of_dead_trainers_are_swept(tmp_path):
    """A weight file left by a trainer that was killed (its pid no longer runs) is removed when the next shm file
    is created; a live process's file and files of other names stay."""
    import os
    import subprocess
    import sys

    from grpo_cli.rollout.transport.shm import ShmFile

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = tmp_path / f"grpo-weights-{int(dead.stdout)}-abc123"
    live = tmp_path / f"grpo-weights-{os.getppid()}-abc123"
    other = tmp_path / "grpo-weights-notes.txt"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    made = ShmFile.create(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists() and made.path.exists()
    made.remove()
    assert not made.path.exists()


def test_tied_checkpoint_is_served_under_every_name_and_syncs_verified(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_cli.server.engines import ServeOptions, build, checkpoint_shapes
    from grpo_cli.models.tiny import build_tiny_checkpoint
    from grpo_cli.train.weights.weight_sync import sync_weights

    path = str(build_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2"))
    assert "lm_head.weight" in checkpoint_shapes(path)  # stored once, accepted under its tied name (vllm server)
    served = build(ServeOptions(engine="hf", model=path))
    assert served.param_shapes["lm_head.weight"] == served.param_shapes["model.embed_tokens.weight"]
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        policy.model.embed_tokens.weight.mul_(1.5)  # the tied output projection changes with it
    with app_in_thread(create_app(served)) as url:
        client = ServerEngine([url], policy=FAST, stop_token_ids=[1])
        try:
            metrics = sync_weights(client, policy, version=1, bucket_mb=1, verify=True, probe=[[3, 4, 6, 7, 8, 5]])
        finally:
            client.close()
    assert metrics["sync/max_probe_diff"] < 1e-5 and served.engine.weight_version == 1
