"""Stream mode's rules without a server (the real `vllm serve` run: tests/e2e/test_stream_run.py): the lag bound
drops a stale group, a token's version comes from the server's spans (never guessed), IS correction is forced on,
the pool never exceeds `max_in_flight` and spreads groups by load, and a checkpoint restores the buffer exactly.
The pool here drives a recorder engine whose groups carry the versions a test gives them."""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest

from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.data.prompts import Prompt, PromptCursor
from grpo_cli.rollout.base import RolloutError, SamplingParams
from grpo_cli.rollout.vllm_serve.stream import Group, token_versions
from grpo_cli.train.stream_metrics import IdleClock
from grpo_cli.train.stream_pool import StreamPipeline

STREAM = ["rollout.mode=stream"]


class Recorder:
    """`generate_group` as the pool calls it: blocks until `release` is set (`gate`), records the most groups it
    held at once per server, and answers a group whose tokens carry `versions(index)`."""

    def __init__(self, urls=("http://a", "http://b"), versions=lambda index: [[1, 1], [1, 2]], gate=False):
        self.urls, self.versions = list(urls), versions
        self.release = threading.Event()
        if not gate:
            self.release.set()
        self.live, self.peak, self.calls = 0, 0, []
        self.lock = threading.Lock()
        self.in_flight = type("Paused", (), {"paused_seconds": 0.0, "requests_at_pause": 0})()
        self.weight_version = 0
        self.aborted: list[str] = []

    def generate_group(self, url, prompt_ids, sampling, *, index, request_id):
        with self.lock:
            self.live += 1
            self.peak = max(self.peak, self.live)
            self.calls.append((index, url, sampling.seed))
        self.release.wait(30)
        with self.lock:
            self.live -= 1
        rows = self.versions(index)
        return Group(index, list(prompt_ids), [[7] * len(r) for r in rows], [[-0.5] * len(r) for r in rows], rows,
                     ["length"] * len(rows), submitted_version=min(min(r) for r in rows))

    def abort(self, url, request_ids):
        self.aborted += request_ids


def _cursor(n=50) -> PromptCursor:
    return PromptCursor([Prompt(f"p{i}", [100 + i], {}) for i in range(n)], seed=0, shuffle=False)


def _pool(engine, cursor=None, **kw) -> StreamPipeline:
    args = dict(prompts_per_step=2, max_in_flight=3, max_buffered=4, max_version_lag=1, on_stale="drop",
                sampling_for=lambda i: SamplingParams(n=2, max_tokens=2, seed=1000 + i))
    return StreamPipeline(engine, cursor or _cursor(), **{**args, **kw})


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_pool_never_exceeds_max_in_flight_and_sends_each_group_to_the_least_loaded_server():
    engine = Recorder(gate=True)
    pool = _pool(engine, max_in_flight=3)
    pool.top_up(0)
    _wait(lambda: engine.live == 3)
    time.sleep(0.2)  # the pool would start a fourth now if it could
    assert engine.peak == 3 and len(pool.flight) == 3
    assert [u for _, u, _ in engine.calls] == ["http://a", "http://b", "http://a"]  # by load, never round-robin
    engine.release.set()
    prompts, batch = pool.take(0, version=1)
    assert engine.peak == 3
    assert len(prompts) == 2 and len(batch.completion_ids) == 4
    assert [s for _, _, s in engine.calls[:3]] == [1000, 1001, 1002]  # group i samples with its own seed
    pool.close()


def test_a_group_past_the_lag_bound_is_dropped_and_counted():
    """Version 3 trains: a token of version 1 is 2 behind (max_version_lag 1): its group is dropped, the others
    train, and the metrics carry the per-token lag and the mixed-version rows."""
    engine = Recorder(versions=lambda i: [[1, 2], [2, 2]] if i == 0 else [[2, 3], [3, 3]])
    pool = _pool(engine, max_in_flight=3, max_buffered=3)
    pool.top_up(0)
    _wait(lambda: len(pool.buffer) >= 3)
    prompts, batch = pool.take(0, version=3)
    m = pool.step_metrics(batch)
    assert len(prompts) == 2 and [100] not in [p.ids for p in prompts]  # group 0 (a token at v1) dropped
    assert m["stream/dropped_groups"] == 1.0
    assert m["stream/version_lag_max"] == 1.0 and m["stream/version_lag_mean"] == pytest.approx(2 / 8)
    assert m["stream/mixed_version_rows"] == 2.0
    assert batch.token_versions == [[2, 3], [3, 3], [2, 3], [3, 3]] and batch.weight_version == 2
    assert max(3 - v for row in batch.token_versions for v in row) <= 1
    pool.close()


def test_the_pool_starts_only_groups_that_can_train_within_the_lag_bound():
    """Two groups a step, lag 1, weights v0 pushed: four groups can train at v0 or v1, a fifth only at v2 (2 behind),
    so the pool stops at four though max_in_flight is 8. While the step trains v0 (v1 not pushed yet) the two left
    would train at v1: nothing starts; once v1 is pushed, two more can."""
    engine = Recorder(versions=lambda i: [[0, 0], [0, 0]])
    pool = _pool(engine, max_in_flight=8, max_buffered=8)
    pool.top_up(0)
    _wait(lambda: len(pool.buffer) == 4)
    time.sleep(0.3)
    assert len(engine.calls) == 4
    pool.take(0, version=0)
    time.sleep(0.3)
    assert len(engine.calls) == 4 and len(pool.buffer) == 2
    engine.weight_version = 1
    _wait(lambda: len(engine.calls) == 6)
    time.sleep(0.3)
    assert len(engine.calls) == 6
    pool.close()


def test_a_step_takes_the_groups_with_the_oldest_tokens_first():
    """Group 1 holds a v2 token (a long group that finished last): the step at v3 takes it before the groups that
    finished earlier with v3 tokens only, so it trains within the bound instead of being dropped a step later."""
    engine = Recorder(versions=lambda i: [[2, 3], [3, 3]] if i == 1 else [[3, 3], [3, 3]], gate=True)
    pool = _pool(engine, max_in_flight=3, max_buffered=3)
    pool.top_up(0)
    _wait(lambda: engine.live == 3)
    engine.release.set()
    _wait(lambda: len(pool.buffer) >= 3)
    with pool._cond:  # group 1 finished last
        pool.buffer = deque(sorted(pool.buffer, key=lambda item: item[0].index == 1))
    assert pool.buffer[-1][0].index == 1
    prompts, batch = pool.take(0, version=3)
    assert [101] in [p.ids for p in prompts] and batch.token_versions[0] == [2, 3]
    pool.close()


def test_a_stale_group_is_regenerated_with_its_prompt_and_seed():
    engine = Recorder(versions=lambda i: [[1, 1], [1, 1]] if len(engine.calls) <= 3 else [[3, 3], [3, 3]])
    pool = _pool(engine, max_in_flight=3, max_buffered=3, on_stale="regenerate")
    pool.top_up(0)
    _wait(lambda: len(pool.buffer) >= 3)
    engine.weight_version = 3
    prompts, _ = pool.take(0, version=3)  # all three at v1: 2 behind, sampled again first
    _wait(lambda: len(engine.calls) >= 6)
    again = engine.calls[3:6]
    assert sorted(i for i, _, _ in again) == [0, 1, 2]  # the dropped groups first, with their seeds and prompts
    assert all(seed == 1000 + i for i, _, seed in again) and {p.ids[0] - 100 for p in prompts} <= {0, 1, 2}
    pool.close()


def test_a_tokens_version_comes_from_the_servers_spans_never_guessed():
    spans = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 3}]
    assert token_versions("u", spans, 3, pushed=range(1, 6)) == [4, 4, 5]
    assert token_versions("u", [], 0, pushed=range(1, 6)) == []
    with pytest.raises(RolloutError, match="without weight_versions spans"):
        token_versions("u", None, 3, pushed=range(1, 6))
    with pytest.raises(RolloutError, match="cover 2 of 3 tokens"):
        token_versions("u", spans[:1], 3, pushed=range(1, 6))
    with pytest.raises(RolloutError, match="do not tile"):
        token_versions("u", [spans[1], spans[0]], 3, pushed=range(1, 6))
    with pytest.raises(RolloutError, match="did not push"):
        token_versions("u", [{"version": "default", "start": 0, "end": 3}], 3, pushed=range(1, 6))


def test_the_client_reads_each_tokens_version_from_the_reply(monkeypatch):
    """`generate_group` on a reply as vLLM 0.32 sends it: the versions are the spans', not the client's own."""
    from grpo_cli.rollout.vllm_serve import client as mod
    from grpo_cli.rollout.vllm_serve.server_facts import ServerFacts

    eng = mod.VLLMServeEngine(["http://127.0.0.1:9"], model="m", connect=False, streaming=True)
    eng.facts = {eng.urls[0]: ServerFacts.parse({"vllm_config": {"model_config": {"max_model_len": 64}}})}
    eng.synced, eng.weight_version, eng.first_pushed = True, 3, 1
    sent = []
    choice = {"index": 0, "finish_reason": "length", "token_ids": [5, 6, 7],
              "logprobs": {"content": [{"logprob": -1.0}] * 3},
              "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]}
    monkeypatch.setattr(eng, "_post", lambda url, body: (sent.append(body), (url, {"choices": [choice]}))[1])
    group = eng.generate_group(eng.urls[0], [1, 2], SamplingParams(n=1, max_tokens=3, seed=5), index=0,
                               request_id="r0")
    assert group.token_versions == [[2, 3, 3]] and group.mixed_rows() == 1 and group.oldest() == 2
    assert sent[0]["request_id"] == "r0" and sent[0]["cache_salt"]  # its own prefix-cache salt
    del choice["weight_versions"]
    with pytest.raises(RolloutError, match="without weight_versions spans"):
        eng.generate_group(eng.urls[0], [1, 2], SamplingParams(n=1, max_tokens=3), index=1, request_id="r1")
    eng.close()


def test_is_correction_is_forced_on_and_other_engines_are_refused_naming_the_one_that_streams():
    cfg = build_config("tiny-cpu-stream")
    assert cfg.rollout.mode == "stream" and cfg.algorithm.is_correction.enabled
    with pytest.raises(ConfigError, match="algorithm.is_correction.enabled=false.*forces it on"):
        build_config("tiny-cpu-stream", None, ["algorithm.is_correction.enabled=false"])
    with pytest.raises(ConfigError, match="runs with rollout.engine vllm-serve only.*not with 'sglang'"):
        build_config("tiny-cpu-stream", None, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=r"rollout.stream.max_in_flight is set \(to 4\) but rollout.mode is .server."):
        build_config("tiny-cpu-vllm-serve", None, ["rollout.stream.max_in_flight=4"])
    with pytest.raises(ConfigError, match="one training process"):
        build_config("tiny-cpu-stream", None, ["distributed.num_processes=2"])


def test_a_checkpoint_restores_the_buffer_and_regenerates_what_was_in_flight():
    """The buffer's finished groups come back with every token's version; the groups that were generating are
    sampled again first (same index, so the same seed), and the cursor continues where it was saved."""
    engine = Recorder(versions=lambda i: [[1, 2], [2, 2]], gate=True)
    pool = _pool(engine, max_in_flight=3, max_buffered=4)
    pool.top_up(0)
    _wait(lambda: engine.live == 3)
    engine.release.set()
    _wait(lambda: len(pool.buffer) >= 4)  # the buffer's bound: the pool stops starting groups
    engine.release.clear()
    saved = pool.state_dict()
    pool.close()
    engine.release.set()
    flying = [e["index"] for e in saved["in_flight"]["regenerate"]]
    done = [g["index"] for g in saved["in_flight"]["buffer"]]
    assert len(done) >= 4 and sorted(done + flying) == list(range(saved["in_flight"]["next_index"]))  # each once
    assert saved["in_flight"]["buffer"][0]["token_versions"] == [[1, 2], [2, 2]]

    cursor = _cursor()
    cursor.load_state_dict(saved["cursor"])
    again = Recorder(versions=lambda i: [[3, 3], [3, 3]])
    resumed = _pool(again, cursor)
    resumed.load_state_dict(saved["in_flight"])
    assert cursor.state_dict() == saved["cursor"]
    prompts, batch = resumed.take(0, version=2)
    assert [p.ids[0] - 100 for p in prompts] == done[:2] and batch.token_versions[0] == [1, 2]  # the oldest first
    again.weight_version = 3  # the step trained at 2 and pushed 3
    resumed.top_up(1)
    _wait(lambda: len(again.calls) >= len(flying) + 1)
    assert [i for i, _, _ in again.calls[:len(flying)]] == flying  # regenerated first, with their own seeds
    assert again.calls[len(flying)][0] == saved["in_flight"]["next_index"]
    resumed.close()


def test_idle_clock_counts_time_without_groups_and_paused_time():
    now = [0.0]
    clock = IdleClock(["a", "b"], clock=lambda: now[0])
    clock.set("a", 1)
    now[0] = 10.0
    assert clock.idle_fraction(paused_seconds=0.0) == pytest.approx(0.5)  # b idle all along
    clock.set("b", 2)
    now[0] = 20.0
    assert clock.idle_fraction(paused_seconds=1.0) == pytest.approx(0.1)  # both paused 1 s of 10


def test_an_error_in_a_group_reaches_the_step():
    class Broken(Recorder):
        def generate_group(self, *a, **kw):
            raise RolloutError("server gone")

    pool = _pool(Broken())
    pool.top_up(0)
    with pytest.raises(RolloutError, match="server gone"):
        pool.take(0, version=0)
    pool.close()
