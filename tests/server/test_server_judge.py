"""A judge served by `grpo serve-rollout` (its `/generate` route, `api: grpo`) answers what the same checkpoint
loaded locally as the judge answers (both greedy, in the judge's chat template), with the server's bearer token."""

from __future__ import annotations

from served_app import app_in_thread

from grpo_cli.config.judge import JudgeConfig
from grpo_cli.rewards.judge_backends import GrpoServer, JudgeStats, LocalCheckpoint
from grpo_cli.server.app import create_app


def test_serve_rollout_judge_answers_like_the_local_checkpoint(served_tiny, tiny_checkpoint, tmp_path, monkeypatch):
    prompt = tmp_path / "judge.txt"
    prompt.write_text("{{ completion }}")
    texts = ["please count to three", "the cat", "what is two plus two ?"]
    local = LocalCheckpoint(JudgeConfig(judge=tiny_checkpoint, prompt=str(prompt), max_tokens=6, batch_size=2),
                            JudgeStats())
    expected = local.answer(texts)
    monkeypatch.setenv("JUDGE_TOKEN", "s3cret")
    with app_in_thread(create_app(served_tiny, token="s3cret")) as url:
        stats = JudgeStats()
        served = GrpoServer(JudgeConfig(judge=url, api="grpo", prompt=str(prompt), max_tokens=6, batch_size=2,
                                        token_env="JUDGE_TOKEN"), stats)
        answers = served.answer(texts)
    assert answers == expected and any(a.strip() for a in answers), answers
    assert (stats.requests, stats.failed_requests) == (2, 0)  # batches of 2 and 1 prompts
    one_by_one = [local.answer([t])[0] for t in texts]  # left padding does not change a greedy answer
    assert one_by_one == expected
