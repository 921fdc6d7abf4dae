"""A local reward model (`{model: PATH}`): its own tokenizer and chat template, the score at the last non-pad
token, the same whatever a sequence is batched with; weighted with function rewards."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.config.rewards import RewardFunctionConfig
from grpo_cli.rewards.resolve import build_reward_fns, score


@pytest.fixture(scope="module")
def reward_ckpt(tmp_path_factory):
    """A random-init Llama sequence classifier (1 label) with the character-level tokenizer: not the policy's."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpo_cli.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("rm")
    tok = build_tokenizer(path, chars=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    return str(path), tok


def _by_hand(path: str, tok, text: str) -> float:
    from transformers import AutoModelForSequenceClassification

    net = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        hidden = net.model(input_ids=ids).last_hidden_state[0, -1]  # the last token, no padding at all
        return float(net.score(hidden)[0])


def test_scores_are_the_last_token_score_in_the_models_own_template(reward_ckpt):
    path, tok = reward_ckpt
    fns = build_reward_fns([RewardFunctionConfig.model_validate({"model": path, "batch_size": 2})])
    messages = [[{"role": "user", "content": "say hi"}], [{"role": "user", "content": "a much longer question ?"}]]
    completions = ["hi", "an answer that is long"]
    table, _ = score(fns, ["<policy text>"] * 2, completions, {}, on_error="raise",
                     extras={"prompt_messages": messages})
    for (value,), m, c in zip(table, messages, completions, strict=True):
        text = tok.apply_chat_template([*m, {"role": "assistant", "content": c}], tokenize=False)
        assert value == pytest.approx(_by_hand(path, tok, text), abs=1e-5)
    alone, _ = score(fns, ["<policy text>"], completions[:1], {}, on_error="raise",
                     extras={"prompt_messages": messages[:1]})
    assert alone[0][0] == pytest.approx(table[0][0], abs=1e-5)  # batched with a longer one or alone: the same


def test_model_and_function_rewards_are_weighted_and_summed(reward_ckpt):
    from grpo_cli.algo.advantages import weighted_rewards

    path, _ = reward_ckpt
    fns = build_reward_fns([RewardFunctionConfig.model_validate({"model": path, "weight": 0.5, "alias": "rm"}),
                            RewardFunctionConfig(name="length", weight=2.0, kwargs={"target": 1})])
    table, _ = score(fns, ["q "] * 2, ["one", "one two"], {}, on_error="raise")
    total = weighted_rewards(torch.tensor(table), [f.weight for f in fns])
    expected = [0.5 * rm + 2.0 * length for rm, length in table]
    assert total.tolist() == pytest.approx(expected) and [row[1] for row in table] == [0.0, -1.0]
    assert fns[0].label == "rm"


class _Stub:
    """A reward-model server on 127.0.0.1 that fails its first call with 503, then scores len(text) per text."""

    def __init__(self):
        import http.server
        import json
        import threading

        stub = self
        self.calls = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                stub.calls += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if stub.calls == 1:
                    self.send_response(503)
                    self.end_headers()
                    return
                out = json.dumps([{"embedding": [float(len(t))]} for t in body["text"]]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_served_reward_model_is_retried_after_a_5xx_and_keeps_the_order():
    stub = _Stub()
    try:
        fns = build_reward_fns([RewardFunctionConfig.model_validate({"url": stub.url, "batch_size": 2})])
        table, _ = score(fns, ["p:"] * 3, ["a", "bbb", "cc"], {}, on_error="raise")
    finally:
        stub.server.shutdown()
    assert [row[0] for row in table] == [3.0, 5.0, 4.0]  # len("p:" + completion), in order, over two batches
    assert stub.calls == 3  # 503, then the two batches


def test_serve_rollout_task_reward_scores_like_the_local_model(reward_ckpt, tmp_path):
    import os
    import re
    import subprocess
    import sys
    import time

    path, _ = reward_ckpt
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", "serve-rollout", "--task", "reward", "--model", path,
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None and time.monotonic() < deadline:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", proc.stdout.readline())
            url = m.group(1) if m else None
            assert proc.poll() is None, "server exited early"
        served = build_reward_fns([RewardFunctionConfig.model_validate({"url": url, "tokenizer": path})])
        local = build_reward_fns([RewardFunctionConfig.model_validate({"model": path})])
        messages = [[{"role": "user", "content": "say hi"}], [{"role": "user", "content": "a longer one ?"}]]
        args = (["<policy text>"] * 2, ["hi", "an answer"], {})
        remote, _ = score(served, *args, on_error="raise", extras={"prompt_messages": messages})
        here, _ = score(local, *args, on_error="raise", extras={"prompt_messages": messages})
    finally:
        proc.kill()
        proc.wait(10)
    assert [r[0] for r in remote] == pytest.approx([h[0] for h in here], abs=1e-5)


def test_auto_device_is_the_training_device(monkeypatch):
    """`device: auto` places the reward model where this rank trains (CUDA faked: the branch runs on CPU)."""
    import torch

    from grpo_cli.rewards.model import resolve_rm_device

    assert resolve_rm_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_rm_device("auto") == torch.device("cuda", 1)
