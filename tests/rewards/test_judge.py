"""Generative judge rewards against a real HTTP server on 127.0.0.1 (OpenAI chat route, serve-rollout's /generate
route) answering fixed texts: scores in order, retries, timeouts, missing answers counted, the per-step cache; the
parsers; bad settings refused with the field named (exit 2)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.judge import JudgeConfig
from grpo_cli.config.rewards import RewardFunctionConfig
from grpo_cli.rewards.judge_parse import parsed_score, regex_parser
from grpo_cli.rewards.resolve import build_reward_fns, pop_reward_metrics, resolve, score


class StubJudge:
    """An OpenAI-compatible chat server: `answers[user message]` is the reply (default "Score: 0"); the listed
    status codes are sent first, one per request; `delay_s` before each reply."""

    def __init__(self, answers: dict[str, str], *, statuses: tuple[int, ...] = (), delay_s: float = 0.0) -> None:
        stub, self.seen, self.statuses = self, [], list(statuses)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body["messages"][0]["content"]
                stub.seen.append((self.path, text, body["max_tokens"], body["temperature"]))
                time.sleep(delay_s)
                status = stub.statuses.pop(0) if stub.statuses else 200
                reply = {"choices": [{"message": {"role": "assistant", "content": answers.get(text, "Score: 0")}}]}
                out = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                try:
                    self.wfile.write(out)
                except BrokenPipeError:  # the client gave up (timeout_s)
                    pass

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judge_prompt(tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("Q: {{ prompt }} A: {{ completion }} ref={{ answer }}")
    return str(path)


def _judge(url: str, prompt: str, **settings):
    return build_reward_fns([RewardFunctionConfig.model_validate({"judge": url, "prompt": prompt, **settings})])


def test_scores_come_back_parsed_and_in_order(judge_prompt):
    answers = {f"Q: q{j} A: c{j} ref=r{j}": f"I think... Score: {j}, final Score: {j + 0.5}" for j in range(5)}
    stub = StubJudge(answers)
    try:
        fns = _judge(stub.url, judge_prompt, batch_size=3, max_tokens=7, parse=r"Score: (\d+(?:\.\d+)?)")
        table, errors = score(fns, [f"q{j}" for j in range(5)], [f"c{j}" for j in range(5)],
                              {"answer": [f"r{j}" for j in range(5)]}, on_error="raise")
    finally:
        stub.close()
    assert [row[0] for row in table] == [0.5, 1.5, 2.5, 3.5, 4.5] and errors == 0  # the last match, in order
    assert {(p, m, t) for p, _, m, t in stub.seen} == {("/v1/chat/completions", 7, 0.0)} and len(stub.seen) == 5
    metrics = pop_reward_metrics(fns)
    assert metrics["judge/judge/requests"] == 5 and metrics["judge/judge/missing"] == 0
    assert metrics["judge/judge/latency_s"] > 0


def test_a_503_is_retried_then_succeeds_and_a_malformed_answer_is_missing(judge_prompt):
    stub = StubJudge({"Q: q A: fine ref=r": "Score: 7", "Q: q A: odd ref=r": "no number here"}, statuses=(503,))
    try:
        fns = _judge(stub.url, judge_prompt, batch_size=1, retries=1)
        table, errors = score(fns, ["q", "q"], ["fine", "odd"], {"answer": ["r", "r"]}, on_error="raise")
    finally:
        stub.close()
    assert table[0][0] == 7.0 and table[1][0] != table[1][0] and errors == 0  # NaN: missing, no exception
    metrics = pop_reward_metrics(fns)
    assert (metrics["judge/judge/retries"], metrics["judge/judge/missing"], metrics["judge/judge/requests"]) == (
        1.0, 1.0, 2.0)
    assert len(stub.seen) == 3  # the 503, its retry, the second completion


def test_failures_after_retries_and_timeouts_are_missing_within_the_timeout(judge_prompt, caplog):
    stub = StubJudge({}, statuses=(500, 500, 500))
    slow = StubJudge({}, delay_s=2.0)
    try:
        failed = score(_judge(stub.url, judge_prompt, retries=1, batch_size=1), ["q"], ["a"], {"answer": ["r"]},
                       on_error="raise")[0]
        fns = _judge(slow.url, judge_prompt, retries=0, timeout_s=0.3)
        started = time.perf_counter()
        timed_out = score(fns, ["q", "q"], ["a", "b"], {"answer": ["r", "r"]}, on_error="raise")[0]
        took = time.perf_counter() - started
    finally:
        stub.close()
        slow.close()
    assert failed[0][0] != failed[0][0] and len(stub.seen) == 2  # a try and one retry, then missing
    assert all(row[0] != row[0] for row in timed_out) and took < 1.5  # both in flight, each cut at 0.3 s
    assert pop_reward_metrics(fns)["judge/judge/failed_requests"] == 2
    warned = [r for r in caplog.records if r.name == "grpo_cli.rewards.judge_backends"]
    assert len(warned) == 2 and "500 Internal Server Error" in warned[0].getMessage()  # one per judge and step


def test_a_repeated_prompt_and_completion_is_asked_once_per_step(judge_prompt):
    stub = StubJudge({"Q: q A: same ref=r": "Score: 3"})
    try:
        fns = _judge(stub.url, judge_prompt)
        args = (["q"] * 3, ["same"] * 3, {"answer": ["r"] * 3})
        first = score(fns, *args, on_error="raise")[0]
        again = score(fns, *args, on_error="raise")[0]  # a dynamic-sampling round of the same step
        assert len(stub.seen) == 1 and pop_reward_metrics(fns)["judge/judge/cache_hits"] == 5
        score(fns, *args, on_error="raise")  # the next step asks again
    finally:
        stub.close()
    assert [r[0] for r in first + again] == [3.0] * 6 and len(stub.seen) == 2


def test_a_judge_with_a_parser_function(judge_prompt):
    stub = StubJudge({"Q: q A: x ref=r": "good", "Q: q A: y ref=r": "bad", "Q: q A: z ref=r": "unsure"})
    try:
        fns = _judge(stub.url, judge_prompt, parse=f"{Path(__file__).parent / 'judge_parsers.py'}:verdict")
        table, _ = score(fns, ["q"] * 3, ["x", "y", "z"], {"answer": ["r"] * 3}, on_error="raise")
    finally:
        stub.close()
    assert [r[0] for r in table[:2]] == [1.0, 0.0] and table[2][0] != table[2][0]
    assert pop_reward_metrics(fns)["judge/judge/missing"] == 1


def test_the_regex_and_function_parsers():
    last_number = regex_parser(JudgeConfig.model_fields["parse"].default)
    assert [parsed_score(last_number, t) for t in ("7", "a 1 then -2.5", "none", "")] == [7.0, -2.5, None, None]
    verdict = resolve(f"{Path(__file__).parent / 'judge_parsers.py'}:verdict")  # as `_judge_fn` imports it
    assert [parsed_score(verdict, t) for t in ("good", " bad\n", "meh")] == [1.0, 0.0, None]
    loads = resolve("json:loads")  # a module's function: a number, or it raises
    assert [parsed_score(loads, t) for t in ("7", "[1]", "x")] == [7.0, None, None]
    assert parsed_score(lambda _: 1 / 0, "x") is None and parsed_score(lambda _: float("inf"), "x") is None


@pytest.mark.parametrize("entry,needle", [
    ({"prompt": "missing.txt"}, "rewards.functions[judge].prompt: the judge prompt file missing.txt does not exist"),
    ({"parse": "Score: \\d+"}, "rewards.functions[judge].parse: parse 'Score: \\\\d+' is neither a regex with "
                               "exactly one capture group (it has 0 groups)"),
    ({"isolation": "process"}, "a judge runs inline"),
    ({"device": "cuda"}, "device do(es) not apply to a judge URL"),
])
def test_bad_settings_exit_2_naming_the_field(tmp_path, judge_prompt, entry, needle):
    rewards = {"judge": "http://127.0.0.1:9", "prompt": judge_prompt, **entry}
    if entry.get("prompt") == "missing.txt":
        rewards["prompt"] = str(tmp_path / "missing.txt")
        needle = needle.replace("missing.txt", rewards["prompt"])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"rewards": {"functions": [rewards]}, "train": {"steps": 1}}))
    result = CliRunner().invoke(app, ["train", "--config", str(cfg), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split()) and "Traceback" not in result.output


def test_a_parser_function_that_cannot_be_imported_stops_the_run_naming_parse(judge_prompt):
    from grpo_cli.config.errors import UserError

    with pytest.raises(UserError, match=r"rewards.functions\[judge\].parse: reward 'no_such_module_x:fn': importing"):
        _judge("http://127.0.0.1:9", judge_prompt, parse="no_such_module_x:fn")


def test_a_template_without_the_completion_is_refused(tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("Rate {{ prompt }}")
    with pytest.raises(ValueError, match="never uses {{ completion }}"):
        RewardFunctionConfig.model_validate({"judge": "http://127.0.0.1:9", "prompt": str(path)})
