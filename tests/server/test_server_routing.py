"""Cache-aware routing over 3 real `grpo serve-rollout` servers (hf engine, tiny model) on 127.0.0.1: a new group
goes to the least-loaded server, a later turn of a trajectory to the server that served its first turn."""

from __future__ import annotations

import threading
import time

from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.remote.client import ServerEngine
from grpo_cli.rollout.transport.http_client import Policy


def test_new_groups_go_to_the_least_loaded_and_later_turns_to_their_first_server(server_process):
    servers = [server_process(token="t") for _ in range(3)]
    engine = ServerEngine([s.url for s in servers], token="t", policy=Policy(connect_timeout_s=60, retries=0))
    posted: list[tuple[str, list[list[int]]]] = []  # (server, prompts) of every /generate, as sent
    real_post = engine._post

    def post(url, path, body):
        posted.append((url, [list(p) for p in body["prompt_ids"]]))
        return real_post(url, path, body)

    engine._post = post
    try:
        # server 0 busy with a long request in flight: the next groups go to the two idle servers
        long = threading.Thread(target=engine.generate, args=([[5, 6, 7]], SamplingParams(n=8, max_tokens=400)))
        long.start()
        deadline = time.monotonic() + 30
        while engine.router.loads[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.router.loads == [8, 0, 0]
        prompts = [[10 + g, 11, 12] for g in range(4)]
        batch = engine.generate(prompts, SamplingParams(n=2, max_tokens=4, seed=0))
        long.join(timeout=120)
        first = {tuple(p): url for url, sent in posted[1:] for p in sent}
        assert {first[tuple(p)] for p in prompts} == {servers[1].url, servers[2].url}
        assert batch.metrics["rollout/server_load/0"] == 8.0 and batch.metrics["rollout/server_load/max"] == 8.0

        # later turns (every trajectory continues, in another order): each on its first turn's server
        go = [7, 0, 5, 2, 3]  # trajectory j belongs to prompt j // 2
        turns = [prompts[j // 2] + batch.completion_ids[j] for j in go]
        n_before = len(posted)
        out = engine.generate_turn(turns, SamplingParams(n=1, max_tokens=3, seed=1), first=[j // 2 for j in go])
        assert len(out.completion_ids) == len(go)
        later = {tuple(p): url for url, sent in posted[n_before:] for p in sent}
        assert all(later[tuple(t)] == first[tuple(prompts[j // 2])] for t, j in zip(turns, go, strict=True))
        assert out.metrics["rollout/sticky_kept"] == 1.0
        assert engine.router.loads == [0, 0, 0]
    finally:
        engine.close()
