"""Sampling seeds never repeat (issue 47, item 3): the seed function over a run's realistic ranges; the seeds the hf
engine, the colocated vLLM engine and the `vllm serve` client use are that function's; and a prompt sampled on two
ranks with the step's seed gets distinct completions from a real engine (hf). The clients of `grpo serve-rollout`
and SGLang: tests/server/test_server_seeds.py; a real `vllm serve`: tests/e2e/test_vllm_serve_seeds.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.seeds import SEED_BITS, child_seed, eval_seed, request_seed, round_seed, turn_seed
from grpo_cli.train.loop import step_seed

INT64_MAX = 2**63 - 1


def _cfg(seed: int) -> GRPOConfig:
    return GRPOConfig.model_validate({"model": {"name_or_path": "m"}, "train": {"seed": seed}})


def test_no_two_completions_of_a_run_share_a_seed():
    """Two runs (train.seed 0 and 1) × 3 consecutive steps, each with a dynamic-sampling round and an agent turn,
    and the evaluation: 4 ranks × 512 prompts × 64 children (vLLM's `seed + j`). No child seed repeats (the
    children of request s are s..s+63, so request seeds must lie 64 apart), all fit an int64, and the step seed is
    the trainer's (a function of train.seed and step only: resumed runs draw the same)."""
    n = 64
    calls = []
    for run in (0, 1):
        steps = [step_seed(_cfg(run), s) for s in range(3)]
        calls += steps + [round_seed(s, 1) for s in steps] + [turn_seed(s, 1) for s in steps] + [eval_seed(run)]
    assert len(set(calls)) == len(calls)
    starts = sorted(request_seed(c, rank=r, prompt=i) for c in calls for r in range(4) for i in range(512))
    assert all(b - a >= n for a, b in zip(starts, starts[1:])), "two requests' children overlap"
    assert 0 <= starts[0] and starts[-1] + n - 1 <= INT64_MAX and starts[-1] < 2**SEED_BITS
    one_step = {child_seed(calls[0], rank=r, prompt=i, child=j) for r in range(4) for i in range(512) for j in range(n)}
    assert len(one_step) == 4 * 512 * n
    assert step_seed(_cfg(0), 7) == step_seed(_cfg(0), 7) == 2835583723240294641  # pinned: resume across versions
    assert (round_seed(calls[0], 0), turn_seed(calls[0], 0)) == (calls[0], calls[0])


# ---- hf: one generator per call, seeded per rank -----------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def test_hf_ranks_sample_a_shared_prompt_differently_with_the_functions_seed(model, tiny_checkpoint):
    """Every rank gets the step's seed; the same prompt on ranks 0 and 1 (a prompt that appears twice in a step)
    must not draw the same noise. Rank r's engine (as the trainer builds it) decodes with
    `request_seed(seed, rank=r, prompt=0)`."""
    from grpo_cli.rollout.base import EngineContext
    from grpo_cli.rollout.factory import make_hf_engine
    from grpo_cli.rollout.hf.decode import decode

    prompts, cfg = [[3, 5, 7, 9], [3, 5, 7, 9]], _cfg(0)
    seed = step_seed(cfg, 0)
    sampling = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=seed)
    batches = [make_hf_engine(cfg, EngineContext(tiny_checkpoint, [1], 0, rank=r, world_size=2), policy=model
                              ).generate(prompts, sampling).completion_ids for r in (0, 1)]
    every = [tuple(c) for b in batches for c in b]
    assert len(set(every)) == len(every) == 16, "a completion repeats within a step"
    with torch.no_grad():
        want = decode(model, prompts, SamplingParams(n=4, max_tokens=12, seed=request_seed(seed, rank=1, prompt=0)),
                      eos_token_ids=[1], pad_token_id=0)
    assert batches[1] == [row[: int(n)].tolist() for row, n in zip(want.tokens, want.lengths, strict=True)]


# ---- colocated vLLM (vLLM's own LLM replaced: its SamplingParams are real) ---------------------------------------
def test_colocated_vllm_requests_carry_the_functions_seeds(monkeypatch):
    pytest.importorskip("vllm")
    from vllm_fakes import FakeLLM, bare_engine

    llm = FakeLLM()
    sent = []
    real = llm.generate
    monkeypatch.setattr(llm, "generate", lambda reqs, params, use_tqdm=False: sent.extend(params) or real(reqs, params))
    eng = bare_engine(llm, sleep_level=0)
    eng.rank = 3
    eng.generate([[5, 6], [5, 6], [7]], SamplingParams(n=2, max_tokens=2, seed=11))
    assert [p.seed for p in sent] == [request_seed(11, rank=3, prompt=i) for i in range(3)]


# ---- `vllm serve` client: the request bodies, through a 127.0.0.1 stub (the real server: tests/e2e) -------------
class _Stub(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        n = body["sampling_params"]["n"]
        out = {"choices": [{"index": j, "token_ids": [1], "logprobs": {"content": [{"logprob": -0.5}]},
                            "finish_reason": "stop"} for j in range(n)]}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_vllm_serve_client_sends_the_functions_seeds_per_rank_and_step():
    """One request per prompt, seed `request_seed(step seed, rank, prompt)`; vLLM adds the child index. Over two
    ranks and two consecutive steps of a repeated prompt, no child seed repeats (the old `step seed + prompt`
    gave prompt i child 1 and prompt i+1 child 0 the same seed, and the next step's prompt i child 0 too)."""
    from grpo_cli.rollout.transport.http_client import Policy
    from grpo_cli.rollout.vllm_serve.client import VLLMServeEngine

    _Stub.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    children, n = [], 4
    try:
        for rank in (0, 1):
            eng = VLLMServeEngine([f"http://127.0.0.1:{server.server_address[1]}"], model="m", connect=False,
                                  policy=Policy(connect_timeout_s=5, request_timeout_s=10, retries=0))
            eng.rank = rank
            eng.synced = True  # as after the run's first weight round (the stub takes no weights)
            for step in (0, 1):
                _Stub.bodies.clear()
                seed = step_seed(_cfg(0), step)
                eng.generate([[3, 4], [3, 4], [3, 4]], SamplingParams(n=n, max_tokens=1, seed=seed))
                sent = sorted(b["sampling_params"]["seed"] for b in _Stub.bodies)
                assert sent == sorted(request_seed(seed, rank=rank, prompt=i) for i in range(3))
                children += [s + j for s in sent for j in range(n)]
            eng.close()
    finally:
        server.shutdown()
        server.server_close()
    assert len(set(children)) == len(children) == 2 * 2 * 3 * n
